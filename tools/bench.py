"""make bench: train.py against transformers' Trainer on the identical workload, side by side.

    python tools/bench.py --size mini                          # make bench: MLM + fine-tuning, fp32 and bf16
    python tools/bench.py --size base --precisions bf16        # on a GPU: BERT-base at sequence 128
    python tools/bench.py --size tiny --steps 6 --repeats 1    # the smoke test's size

Both sides get the same model config (BERT, sdpa attention), the same prepared token ids (tools/prepare.py:
packed MLM blocks; the sample's classification task), batch, sequence length, optimizer settings,
precision and number of steps; the Trainer gets its own best settings (bf16=True where we use bf16, sdpa,
train_sampling_strategy="group_by_length" for fine-tuning, the fused AdamW on CUDA). Each run is a fresh
process; the sides alternate, repeat after repeat, and the first --warmup steps of every run are not timed. The table
(bench.md, bench.json, bench.png) gives the median tokens/s of each side and their ratio, MFU against a
matmul peak measured in the same run, peak memory and the share of positions that were padding; and our
speed features on and off: torch.compile, fused against foreach AdamW, packed against torch's dropout masks,
length-grouped batches, and under
ZeRO-2 offload DeepSpeed's CPU Adam against torch's AdamW (--offload, 2 processes).

Absolute numbers on a shared machine are noise; the ratios from one run are the result.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

SIZES = {   # model, vocabulary, sequence, micro batch
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256, vocab=1000,
                 seq=64, batch=16),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab=8192,
                 seq=128, batch=16),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab=30522,
                 seq=128, batch=32),
}
MODEL_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
LR, SEED = 1e-4, 7


# ----------------------------------------------------------------------------- the workloads
def prepare_workloads(size: dict, root: Path, sample_dir: Path) -> dict[str, Path]:
    """The MLM corpus (packed) and the classification task, tokenized once by tools/prepare.py."""
    from prepare import prepare

    from bert_recipes.config import load_config, validate
    out = {"mlm": root / "mlm", "classify": root / "classify"}
    common = [f"data.max_seq_length={size['seq']}", f"data.sample_dir={sample_dir}", f"data.cache_dir={root / 'cache'}",
              f"model.max_position_embeddings={max(512, size['seq'])}"]
    if not (out["mlm"] / "prepared.json").exists():
        cfg = load_config(REPO / "recipes/tiny-mlm.yaml", common + [f"tokenizer.vocab_size={size['vocab']}"])
        validate(cfg)
        prepare(cfg, out["mlm"])
    if not (out["classify"] / "prepared.json").exists():
        cfg = load_config(REPO / "recipes/tiny-classify.yaml", common + [
            "model.name_or_path=null", f"tokenizer.name_or_path={out['mlm'] / 'tokenizer'}"])
        validate(cfg)
        prepare(cfg, out["classify"])
    return out


def variants(precisions: list[str], offload: bool) -> list[dict]:
    """What is run: each dict a fresh process. `pair` names the Trainer row a train.py row is compared
    with, or the row a feature's 'off' is compared with."""
    rows = []
    for p in precisions:
        rows += [
            {"name": "mlm: train.py", "workload": "mlm", "side": "ours", "precision": p, "pair": "mlm: Trainer"},
            {"name": "mlm: Trainer", "workload": "mlm", "side": "trainer", "precision": p},
            {"name": "mlm: train.py + compile", "workload": "mlm", "side": "ours", "precision": p,
             "extra": ["train.compile=true", "data.max_predictions_per_seq=20"], "pair": "mlm: train.py, static K"},
            {"name": "mlm: train.py, static K", "workload": "mlm", "side": "ours", "precision": p,   # compile's shapes
             "extra": ["data.max_predictions_per_seq=20"]},
            {"name": "mlm: train.py, foreach AdamW", "workload": "mlm", "side": "ours", "precision": p,
             "extra": ["optim.fused=false"], "pair": "mlm: train.py, fused AdamW"},
            {"name": "mlm: train.py, fused AdamW", "workload": "mlm", "side": "ours", "precision": p,
             "extra": ["optim.fused=true"]},
            {"name": "mlm: train.py, torch dropout", "workload": "mlm", "side": "ours", "precision": p,
             "extra": ["model.dropout_impl=torch"], "pair": "mlm: train.py"},
            {"name": "classify: train.py", "workload": "classify", "side": "ours", "precision": p,
             "extra": ["data.group_by_length=true"], "pair": "classify: Trainer"},
            {"name": "classify: Trainer", "workload": "classify", "side": "trainer", "precision": p},
            {"name": "classify: train.py, no grouping", "workload": "classify", "side": "ours", "precision": p,
             "extra": ["data.group_by_length=false"], "pair": "classify: train.py"},
        ]
    if offload:
        rows += [{"name": "zero2-offload: DeepSpeed CPU Adam", "workload": "mlm", "side": "ours", "precision": "no",
                  "backend": "zero2-offload", "extra": ["optim.cpu_adam=true"],
                  "pair": "zero2-offload: torch AdamW"},
                 {"name": "zero2-offload: torch AdamW", "workload": "mlm", "side": "ours", "precision": "no",
                  "backend": "zero2-offload", "extra": ["optim.cpu_adam=false"]}]
    return rows


# ----------------------------------------------------------------------------- one run (a worker process)
def run_ours(spec: dict) -> dict:
    """train.py as a user runs it, on the prepared data; timing from its own per-step log rows."""
    size, data = SIZES[spec["size"]], Path(spec["data"][spec["workload"]])
    out = Path(spec["dir"])
    recipe = "tiny-mlm.yaml" if spec["workload"] == "mlm" else "tiny-classify.yaml"
    overrides = [f"--run.output_dir={out}", "--run.overwrite=true", f"--run.seed={SEED}", "--data.source=prepared",
                 f"--data.prepared_dir={data}", f"--data.max_seq_length={size['seq']}",
                 f"--model.max_position_embeddings={max(512, size['seq'])}", f"--train.max_steps={spec['steps']}",
                 f"--train.global_batch_size={size['batch'] * spec.get('nproc', 1)}",
                 f"--train.micro_batch_size={size['batch']}", "--train.eval_every=null", f"--optim.lr={LR}",
                 "--optim.warmup_steps=0", f"--train.mixed_precision={spec['precision']}", "--logging.log_every=1",
                 "--logging.trackers=[]", "--logging.plot=false", "--logging.progress_bar=false",
                 "--checkpoint.export=false", "--checkpoint.save_every=null"]
    overrides += [f"--model.{k}={size[k]}" for k in MODEL_KEYS]
    if spec["workload"] == "classify":   # the settings it was prepared with (tools/prepare.py checks them)
        overrides += ["--model.name_or_path=null", f"--tokenizer.name_or_path={Path(spec['data']['mlm']) / 'tokenizer'}"]
    else:
        overrides.append(f"--tokenizer.vocab_size={size['vocab']}")
    overrides += [f"--{e}" for e in spec.get("extra", [])]
    script = [str(REPO / "train.py"), "--recipe", str(REPO / "recipes" / recipe)]
    if spec.get("backend"):   # a backend row, launched as make <mode> does (with CPU=1 on a CPU machine)
        import torch

        from bert_recipes.backend import backend_rows
        row, cuda = backend_rows()[spec["backend"]], torch.cuda.is_available()
        env = dict(os.environ) if cuda else row.cpu_launch_env({**os.environ, "OMP_NUM_THREADS": "1"})
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(REPO / (row.config if cuda else row.cpu_config)), "--num_processes", str(spec["nproc"])] + script
    else:                          # one process: python train.py, as a user runs it
        env, cmd = dict(os.environ), [sys.executable] + script
    proc = subprocess.run(cmd + overrides, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"train.py exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    rows = metrics["history"]["train"][spec["warmup"]:]
    seconds = sum(r["window_s"] for r in rows)
    gpu_peaks = metrics["final"].get("peak_memory_gb_per_rank")   # torch.cuda.max_memory_allocated, per rank
    return {"seconds": seconds, "steps": len(rows), "profile": _profile_block(proc.stdout),
            "peak_memory_mb": max(gpu_peaks) * 1e9 / 2 ** 20 if gpu_peaks else None,
            "padded_tokens": sum(r["padded_tokens_per_sec"] * r["window_s"] for r in rows),
            "real_tokens": sum(r["tokens_per_sec"] * r["window_s"] for r in rows)}


def _profile_block(log: str) -> str | None:
    """train.py --profile's top-10 table, from its log."""
    if "[profile]" not in log:
        return None
    lines = log[log.index("[profile]"):].splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("Self ") and "time total" in line), len(lines) - 1)
    return "\n".join(lines[:end + 1])


def profile_ours(args, data: dict) -> dict:
    """Where train.py's MLM step spends its time: train.py --profile (steps 3-5) at each precision."""
    profiles = {}
    for precision in args.precisions.split(","):
        spec = {"name": "mlm: train.py", "workload": "mlm", "side": "ours", "precision": precision, "size": args.size,
                "data": {k: str(v) for k, v in data.items()}, "steps": 8, "warmup": 0, "nproc": 1,
                "extra": ["logging.profile=true"], "dir": str(Path(args.out) / "profile" / precision)}
        print(f"[bench] profile: mlm: train.py ({precision}) ...", flush=True)
        profiles[precision] = run_ours(spec)["profile"]
    return profiles


def run_trainer(spec: dict) -> dict:
    """transformers' Trainer on the same token ids, model config and settings; its steps timed by a
    callback from one step's end to the next (data loading included, as on our side)."""
    import torch
    from datasets import DatasetDict
    from transformers import (AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification,
                              DataCollatorForLanguageModeling, DataCollatorWithPadding, Trainer, TrainerCallback,
                              TrainingArguments)
    from bert_recipes.config import load_config
    size, data = SIZES[spec["size"]], Path(spec["data"][spec["workload"]])
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    train_set = DatasetDict.load_from_disk(str(data / "data"))["train"]
    meta = json.loads((data / "prepared.json").read_text())
    labels = len(meta["label_names"] or []) or load_config(REPO / "recipes/tiny-classify.yaml").task.num_labels
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=max(512, size["seq"]),
                        pad_token_id=tokenizer.pad_token_id, **{k: size[k] for k in MODEL_KEYS}, num_labels=labels)
    torch.manual_seed(SEED)
    mlm = spec["workload"] == "mlm"
    model = (BertForMaskedLM if mlm else BertForSequenceClassification)(config)
    model.config._attn_implementation = "sdpa"
    base = (DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15) if mlm
            else DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if torch.cuda.is_available() else None))  # as ours
    counts = {"padded": [], "real": []}

    def collate(features):
        batch = base(features)
        counts["padded"].append(batch["input_ids"].numel())
        counts["real"].append(int(batch["attention_mask"].sum()))
        return batch
    marks = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            marks.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            marks.append(time.perf_counter())
    cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=spec["dir"], per_device_train_batch_size=size["batch"], max_steps=spec["steps"], learning_rate=LR,
        weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, warmup_steps=0,
        lr_scheduler_type="linear", max_grad_norm=1.0, bf16=spec["precision"] == "bf16", logging_steps=10 ** 9,
        save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=not cuda, seed=SEED, disable_tqdm=True,
        tf32=(cuda and spec["precision"] == "no" and torch.cuda.get_device_capability()[0] >= 8) or None,  # as ours
        train_sampling_strategy="group_by_length" if not mlm else "random",
        optim="adamw_torch_fused")                         # torch's fused AdamW: CUDA and CPU kernels
    Trainer(model=model, args=args, train_dataset=train_set, data_collator=collate, callbacks=[Clock()]).train()
    w = spec["warmup"]
    return {"seconds": marks[-1] - marks[w], "steps": len(marks) - 1 - w,
            "padded_tokens": sum(counts["padded"][w:len(marks) - 1]), "real_tokens": sum(counts["real"][w:len(marks) - 1])}


def worker(spec_path: str) -> None:
    import torch
    spec = json.loads(Path(spec_path).read_text())
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = run_ours(spec) if spec["side"] == "ours" else run_trainer(spec)
    if spec["side"] == "ours":   # train.py ran as child processes: its GPU peak, or the largest one's RSS
        result["peak_memory_mb"] = result["peak_memory_mb"] or resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    else:
        result["peak_memory_mb"] = (torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available()
                                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    Path(spec["result"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the comparison
def mfu_of(row: dict, size: dict, vocab: int, tokens_per_s: float, peak: float) -> float:
    from types import SimpleNamespace

    from bert_recipes.perf import flops_per_token
    config = SimpleNamespace(hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
                             num_hidden_layers=size["num_hidden_layers"], vocab_size=vocab)
    head = (0.15 if row["side"] == "ours" else 1.0) if row["workload"] == "mlm" else None   # the Trainer's head is dense
    return flops_per_token(config, size["seq"], head) * tokens_per_s / (peak * row_nproc(row))


def row_nproc(row: dict) -> int:
    """Backend rows: 2 CPU processes, or 1 GPU; the rest one process."""
    import torch
    return 2 if row.get("backend") and not torch.cuda.is_available() else 1


def measure(args) -> dict:
    import torch

    from bert_recipes.perf import measured_cpu_peak, peak_flops
    size, out = SIZES[args.size], Path(args.out)
    data = prepare_workloads(size, out / f"data-{args.size}", Path(args.sample_dir))
    vocab = len(json.loads((data["mlm"] / "tokenizer/tokenizer.json").read_text())["model"]["vocab"])
    rows = variants(args.precisions.split(","), args.offload)
    if args.only:   # a subset of the rows, e.g. --only classify
        rows = [r for r in rows if any(word in r["name"] for word in args.only.split(","))]
    if args.rows:   # these rows by name, e.g. --rows "mlm: train.py|mlm: Trainer"
        rows = [r for r in rows if r["name"] in args.rows.split("|")]
    # fine-tuning: one epoch, so both sides see the same sequences (their length mix decides tokens/s)
    epoch_steps = (args.classify_steps or
                   json.loads((data["classify"] / "prepared.json").read_text())["splits"]["train"] // size["batch"])
    runs = {r["name"] + "|" + r["precision"]: [] for r in rows}
    for repeat in range(args.repeats):
        order = rows if repeat % 2 == 0 else list(reversed(rows))   # alternate who goes first
        for row in order:
            key = row["name"] + "|" + row["precision"]
            spec = {**row, "size": args.size, "data": {k: str(v) for k, v in data.items()},
                    "steps": epoch_steps if row["workload"] == "classify" else args.steps,
                    "warmup": args.warmup, "nproc": row_nproc(row),
                    "dir": str(out / "runs" / key.replace(" ", "_").replace(":", "").replace("|", "-").replace(",", "")),
                    "result": str(out / "result.json")}
            (out / "spec.json").write_text(json.dumps(spec))
            print(f"[bench] repeat {repeat + 1}/{args.repeats}: {row['name']} ({row['precision']}) ...", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--worker", str(out / "spec.json")], cwd=REPO,
                                  capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                       "HF_DATASETS_OFFLINE": "1"})
            if proc.returncode:
                raise SystemExit(f"[bench] {row['name']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            runs[key].append(json.loads((out / "result.json").read_text()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = []
    for row in rows:
        key = row["name"] + "|" + row["precision"]
        rates = [r["real_tokens"] / r["seconds"] for r in runs[key]]   # useful tokens: padding does not count
        tokens_per_s = statistics.median(rates)
        sequences_per_s = statistics.median(r["steps"] * size["batch"] * row_nproc(row) / r["seconds"] for r in runs[key])
        peak = (peak_flops(device, row["precision"])[0] if device.type == "cuda" else
                measured_cpu_peak(torch.bfloat16 if row["precision"] == "bf16" else torch.float32))
        last = runs[key][-1]
        table.append({**{k: row[k] for k in ("name", "workload", "side", "precision")}, "pair": row.get("pair"),
                      "tokens_per_s": tokens_per_s, "rates": rates,
                      "sequences_per_s": sequences_per_s,
                      "mfu": mfu_of(row, size, vocab, tokens_per_s, peak),
                      "peak_memory_mb": max(r["peak_memory_mb"] for r in runs[key]),
                      "padding": 1 - last["real_tokens"] / last["padded_tokens"], "matmul_peak": peak})
    ratios = []
    for row in table:
        other = next((o for o in table if row["pair"] and o["name"] == row["pair"] and o["precision"] == row["precision"]),
                     None)
        if other:
            ratios.append({"what": f"{row['name']} / {other['name']}", "precision": row["precision"],
                           "ratio": row["tokens_per_s"] / other["tokens_per_s"]})
    return {"size": args.size, "model": {k: size[k] for k in MODEL_KEYS}, "vocab": vocab, "seq": size["seq"],
            "batch": size["batch"], "steps": args.steps, "classify_steps": epoch_steps, "warmup": args.warmup,
            "repeats": args.repeats,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU, {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"), "rows": table, "ratios": ratios, "runs": runs}


# ----------------------------------------------------------------------------- grouping and accuracy
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


def render(result: dict) -> str:
    m = result["model"]
    lines = [f"# make bench: {result['size']} (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab "
             f"{result['vocab']}, sequence {result['seq']}, micro batch {result['batch']}), {result['device']}, "
             f"{result['date']}", "",
             f"{result['steps']} steps per MLM run and one epoch ({result['classify_steps']} steps) per fine-tuning "
             f"run, the first {result['warmup']} not timed; median of {result['repeats']} alternating runs per row.", "",
             "| row | precision | tokens/s | sequences/s | MFU | peak memory MB | padding |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['precision']} | {r['tokens_per_s']:.0f} | {r['sequences_per_s']:.1f} | "
                     f"{r['mfu']:.1%} | {r['peak_memory_mb']:.0f} | {r['padding']:.0%} |")
    lines += ["", "| ratio (tokens/s) | precision | |", "|---|---|---|"]
    lines += [f"| {r['what']} | {r['precision']} | **{r['ratio']:.2f}x** |" for r in result["ratios"]]
    lines += ["", "tokens/s counts the real tokens (padding is not counted; `padding` is its share of the positions fed "
              "to the model). MFU: "
              "model FLOPs per token (ours: the MLM head on the masked 15%; the Trainer's head is dense) x tokens/s "
              "over the matmul peak measured in this run (CPU) or the datasheet (GPU)."]
    if result.get("accuracy"):
        acc = result["accuracy"]
        lines += ["", f"## Fine-tuning with and without data.group_by_length: the sample task, {acc['steps']} steps "
                  f"from a tiny model pretrained {acc['pretrain_steps']} steps", "",
                  "| batches | eval accuracy per seed | mean | padding | wall s (mean) |", "|---|---|---|---|---|"]
        for name, runs in acc["runs"].items():
            values = [r["accuracy"] for r in runs]
            lines.append(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.mean(values):.3f} | "
                         f"{statistics.mean(r['padding'] for r in runs):.0%} | "
                         f"{statistics.mean(r['wall_s'] for r in runs):.0f} |")
        base = acc["runs"]["grouped"][0]["baseline"]
        if base:
            lines += ["", f"Majority-class baseline: {base:.3f}."]
    for precision, table in (result.get("profiles") or {}).items():
        lines += ["", f"## Where train.py's MLM step spends its time ({precision}): train.py --profile, steps 3-5",
                  "", "```", table or "(no profile table in the log)", "```"]
    return "\n".join(lines)


def chart(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.8), 4.5))
    labels = [f"{r['name']}\n({r['precision']})" for r in rows]
    colors = ["#d62728" if r["side"] == "trainer" else "#1f77b4" for r in rows]
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"train.py (blue) vs transformers Trainer (red): {result['size']}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), default="mini")
    parser.add_argument("--precisions", default="no,bf16", help="comma-separated: no, bf16 (and fp16 on GPUs)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", help="comma-separated words: run only the rows whose name contains one")
    parser.add_argument("--rows", help="|-separated row names: run only these rows")
    parser.add_argument("--classify-steps", type=int, help="fine-tuning steps per run (default: one epoch)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offload", action="store_true", help="also ZeRO-2 offload: DeepSpeed CPU Adam vs torch AdamW")
    parser.add_argument("--accuracy", action="store_true",
                        help="also fine-tune the sample task with and without data.group_by_length: eval accuracy")
    parser.add_argument("--accuracy-seeds", type=int, default=3)
    parser.add_argument("--accuracy-steps", type=int, default=256, help="fine-tuning steps (tiny-classify: 4 epochs)")
    parser.add_argument("--accuracy-pretrain-steps", type=int, default=600, help="tiny-mlm steps (as make demo)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile train.py's MLM step at each precision (torch.profiler top 10)")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--sample-dir", default="data/sample")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = measure(args)
    if args.accuracy:
        result["accuracy"] = accuracy_check(args)
    if args.profile:
        result["profiles"] = profile_ours(args, prepare_workloads(SIZES[args.size], Path(args.out) / f"data-{args.size}",
                                                                  Path(args.sample_dir)))
    text = render(result)
    Path(args.out, "bench.md").write_text(text + "\n")
    Path(args.out, "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    chart(result, Path(args.out, "bench.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
