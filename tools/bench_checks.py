"""make bench's checks beside the speed: the cost of collating and of fetching one packed MLM batch, whether
data.group_by_length changes what fine-tuning learns (--accuracy), and train.py against the Trainer on quality
(tools/quality.py, --quality-seeds)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_rows import SEED  # noqa: E402
from bench_runs import _run_watched  # noqa: E402


def collate_cost(data: dict, seq: int, batches: tuple = (32, 256), repeats: int = 100) -> dict[str, dict]:
    """Milliseconds to collate one packed MLM micro batch (`batch` blocks of `seq` tokens) on one CPU core,
    median of `repeats` (each with another epoch, so other masks): the default (K predictions a sequence),
    whole-word masking, and the per-token choice (data.max_predictions_per_seq=null). The rows are fetched
    beforehand: this is the collate_fn alone. -> {masking: {batch: ms}}"""
    import torch
    from prepare import prepared_splits
    from transformers import AutoTokenizer

    from bert_recipes.data.batching import Indexed
    from bert_recipes.tasks.mlm import MLMCollator
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(data["mlm"] / "tokenizer")
        train = Indexed(prepared_splits(data["mlm"], seq)["train"])
        k, out = round(0.15 * seq), {}
        for name, kwargs in (("K predictions (default)", {"max_predictions": k}),
                             ("whole-word masking, K", {"max_predictions": k, "whole_word": True}),
                             ("per-token choice", {})):
            collate = MLMCollator(tokenizer, 0.15, SEED, pad_to_multiple_of=None, **kwargs)
            out[name] = {}
            for batch in batches:
                examples = train.__getitems__([i % len(train) for i in range(batch)])
                times = []
                for epoch in range(repeats):
                    collate.epoch = epoch
                    t0 = time.perf_counter()
                    collate(examples)
                    times.append(time.perf_counter() - t0)
                out[name][batch] = statistics.median(times) * 1000
        return out
    finally:
        torch.set_num_threads(threads)

def fetch_cost(data: dict, batch: int = 256, repeats: int = 20) -> dict[str, float]:
    """Milliseconds to read one micro batch of `batch` packed rows from the memory-mapped token store, as the
    DataLoader's fetcher does: row by row (__getitem__) against one call (data.Indexed.__getitems__); and in one
    call with each token's document (data.document_mask), as blocks and as best-fit rows (data.packing: best_fit,
    its plan made once beside the workload's store)."""
    from prepare import prepared_splits
    from transformers import AutoTokenizer

    from bert_recipes.data.batching import Indexed
    from bert_recipes.data.best_fit import BestFitRows
    from bert_recipes.data.store import StoreBlocks, TokenStore
    train = Indexed(prepared_splits(data["mlm"], 128)["train"])
    store, tokenizer = TokenStore(Path(data["mlm"])), AutoTokenizer.from_pretrained(str(Path(data["mlm"]) / "tokenizer"))
    apart = Indexed(StoreBlocks(store, 128, tokenizer.all_special_ids, documents=True))
    fitted = Indexed(BestFitRows(store, 128, tokenizer.all_special_ids, tokenizer.pad_token_id))
    out = {}
    for name, rows, fetch in (("row by row", train, lambda ids: [train[i] for i in ids]),
                              ("one call", train, train.__getitems__),
                              ("one call, documents apart", apart, apart.__getitems__),
                              ("one call, best-fit rows", fitted, fitted.__getitems__)):
        times = []
        for r in range(repeats):
            ids = [(r * 7919 + i * 104729) % len(rows) for i in range(batch)]
            t0 = time.perf_counter()
            fetch(ids)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1000
    return out

def accuracy_check(args) -> dict:
    """Does data.group_by_length change what fine-tuning learns? The sample task (tiny-classify) from one
    tiny model pretrained here (tiny-mlm, --accuracy-pretrain-steps on one process), fine-tuned with and
    without grouping for each of --accuracy-seeds seeds: eval accuracy and the share of padding."""
    out = Path(args.out) / "accuracy"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    common = [f"--data.sample_dir={args.sample_dir}", f"--data.cache_dir={out / 'cache'}", "--logging.trackers=[]",
              "--logging.plot=false", "--logging.progress_bar=false", "--run.overwrite=true"]

    def train(recipe: str, run_dir: Path, extra: list[str]) -> dict:
        cmd = [sys.executable, str(REPO / "train.py"), "--recipe", str(REPO / "recipes" / recipe),
               f"--run.output_dir={run_dir}"] + common + extra
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"[bench] {recipe} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads((run_dir / "metrics.json").read_text())

    pretrained = out / "pretrained"
    if not (pretrained / "model/model.safetensors").exists():
        print(f"[bench] accuracy: pretraining tiny-mlm for {args.accuracy_pretrain_steps} steps ...", flush=True)
        train("tiny-mlm.yaml", pretrained, [f"--train.max_steps={args.accuracy_pretrain_steps}",
                                            "--train.eval_every=null", "--checkpoint.save_every=null"])
    runs = {"grouped": [], "not grouped": []}
    for seed in range(1, args.accuracy_seeds + 1):
        for name, grouped in (("grouped", True), ("not grouped", False)):
            print(f"[bench] accuracy: fine-tuning, seed {seed}, {name} ...", flush=True)
            metrics = train("tiny-classify.yaml", out / f"{name.replace(' ', '-')}-{seed}", [
                f"--model.name_or_path={pretrained / 'model'}", f"--run.seed={seed}",
                f"--data.group_by_length={str(grouped).lower()}", f"--train.max_steps={args.accuracy_steps}",
                f"--train.eval_every={args.accuracy_steps}", "--checkpoint.save_every=null", "--checkpoint.export=false"])
            rows = metrics["history"]["train"]
            real = sum(r["tokens_per_sec"] * r["window_s"] for r in rows)
            padded = sum(r["padded_tokens_per_sec"] * r["window_s"] for r in rows)
            runs[name].append({"seed": seed, "accuracy": metrics["final"]["accuracy"], "padding": 1 - real / padded,
                               "baseline": metrics["final"].get("majority_baseline_accuracy"),
                               "wall_s": metrics["final"]["wall_time_s"]})
    return {"pretrain_steps": args.accuracy_pretrain_steps, "steps": args.accuracy_steps, "runs": runs}

def quality_check(args) -> dict:
    """tools/quality.py in its own process (the Trainer's seeding stays out of this one): --quality-seeds seeds,
    --quality-steps MLM steps, --quality-classify-steps fine-tuning steps, the positive controls included.
    -> its quality.json (the tiny shape whatever --size: the comparison must leave the plateau on 2 cores)."""
    out, demo = Path(args.out) / "quality", REPO / "runs/tiny-mlm/model"
    classify_steps = args.quality_classify_steps if (demo / "config.json").exists() else 0
    if args.quality_classify_steps and not classify_steps:
        print(f"[bench] quality: no fine-tuning rows: they start from make demo's model, and {demo} is missing "
              "(run make demo first)", flush=True)
    cmd = [sys.executable, str(REPO / "tools/quality.py"), f"--seeds=1-{args.quality_seeds}",
           f"--mlm-steps={args.quality_steps}", f"--classify-steps={classify_steps}",
           "--controls=quarter-lr,half-labels", f"--out={out}", f"--sample-dir={args.sample_dir}"]
    print(f"[bench] quality: {' '.join(cmd[1:])}", flush=True)
    code, stdout, _, _ = _run_watched(cmd, {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if code:
        raise SystemExit(f"[bench] quality: tools/quality.py failed:\n{stdout[-3000:]}")
    return json.loads((out / "quality.json").read_text())
