"""make bench: train.py against transformers' Trainer on the identical workload, side by side.

    python tools/bench.py --size mini                          # make bench: MLM + fine-tuning, fp32 and bf16
    python tools/bench.py --size base --set essential --precisions bf16,no --repeats 1   # on a GPU, <= 6 launches
    python tools/bench.py --size tiny --steps 6 --repeats 1    # the smoke test's size

Both sides get the same model config (BERT, sdpa attention), the same prepared token ids (tools/prepare.py:
packed MLM blocks; the sample's classification task), micro batch, sequence length, optimizer settings,
precision and number of steps; the Trainer gets the settings a user passes (bf16=True where we use bf16,
sdpa, the fused AdamW, train_sampling_strategy="group_by_length" for fine-tuning), in eager mode, and a
second Trainer row with torch_compile=True. On a GPU, train.py also runs at its automatic micro batch
(train.micro_batch_size=auto, global batch 256) and the Trainer at the micro batch it picked. Each run is a
fresh process (train.py as a user runs it; the Trainer in a worker); the sides alternate, repeat after
repeat, and the first --warmup steps of every run are not timed. Every run's result goes to bench.jsonl the
moment it is known, and bench.md / bench.json are rewritten from the finished runs after each one, so a time
limit keeps them. The table gives the median tokens/s of each side and their ratio, MFU against a matmul peak
measured in the same run and against the datasheet (GPUs), peak memory, the share of positions that were
padding, and the cost of collating one packed MLM batch; and our speed features on and off: torch.compile,
fused against foreach AdamW, K predictions against per-token masking, packed dropout masks (CPU),
length-grouped batches, and under ZeRO-2 offload DeepSpeed's CPU Adam against torch's AdamW (--offload).

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


def variants(precisions: list[str], offload: bool, essential: bool = False) -> list[dict]:
    """What is run: each dict a fresh process. `pair` names the Trainer row a train.py row is compared
    with, or the row a feature's 'off' is compared with. essential: train.py and the Trainer at each
    precision, and on a GPU both at train.py's automatic micro batch (bf16): at most 6 launches."""
    import torch
    cuda = torch.cuda.is_available()
    rows = []
    for p in precisions:
        rows += [
            {"name": "mlm: train.py", "workload": "mlm", "side": "ours", "precision": p, "pair": "mlm: Trainer"},
            {"name": "mlm: Trainer", "workload": "mlm", "side": "trainer", "precision": p},
        ]
    if cuda and "bf16" in precisions:   # the automatic micro batch; the Trainer runs at the one train.py picked
        rows += [{"name": "mlm: train.py, auto micro batch", "workload": "mlm", "side": "ours", "precision": "bf16",
                  "extra": ["train.global_batch_size=256", "train.micro_batch_size=auto"],
                  "pair": "mlm: Trainer, same micro batch"},
                 {"name": "mlm: Trainer, same micro batch", "workload": "mlm", "side": "trainer", "precision": "bf16",
                  "micro_from": "mlm: train.py, auto micro batch"}]
    if essential:
        return rows
    for p in precisions:
        rows += [
            {"name": "mlm: Trainer + compile", "workload": "mlm", "side": "trainer", "precision": p, "compile": True,
             "pair": "mlm: Trainer"},
            {"name": "mlm: train.py + compile", "workload": "mlm", "side": "ours", "precision": p,
             "extra": ["train.compile=true"], "pair": "mlm: train.py"},
            {"name": "mlm: train.py, foreach AdamW", "workload": "mlm", "side": "ours", "precision": p,
             "extra": ["optim.fused=false"], "pair": "mlm: train.py"},
            {"name": "mlm: train.py, per-token masking", "workload": "mlm", "side": "ours", "precision": p,
             "extra": ["data.max_predictions_per_seq=null"], "pair": "mlm: train.py"},
            {"name": "classify: train.py", "workload": "classify", "side": "ours", "precision": p,
             "extra": ["data.group_by_length=true"], "pair": "classify: Trainer"},
            {"name": "classify: Trainer", "workload": "classify", "side": "trainer", "precision": p},
            {"name": "classify: train.py, no grouping", "workload": "classify", "side": "ours", "precision": p,
             "extra": ["data.group_by_length=false"], "pair": "classify: train.py"},
        ]
        if not cuda:   # model.dropout_impl=packed is a CPU opt-in (refused on GPUs)
            rows.append({"name": "mlm: train.py, packed dropout", "workload": "mlm", "side": "ours", "precision": p,
                         "extra": ["model.dropout_impl=packed"], "pair": "mlm: train.py"})
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
    code, stdout, peak_rss = _run_watched(cmd + overrides, env)
    if code:
        raise RuntimeError(f"train.py exited {code}:\n{stdout[-4000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    rows = metrics["history"]["train"][spec["warmup"]:]
    seconds = sum(r["window_s"] for r in rows)
    gpu_peaks = metrics["final"].get("peak_memory_gb_per_rank")   # torch.cuda.max_memory_allocated, per rank
    return {"seconds": seconds, "steps": len(rows), "profile": _profile_block(stdout),
            "micro_batch": metrics["config"]["train/micro_batch_size"],
            "sequences": sum(r["samples_per_sec"] * r["window_s"] for r in rows),
            "peak_memory_mb": max(gpu_peaks) * 1e9 / 2 ** 20 if gpu_peaks else peak_rss / 2 ** 20,
            "padded_tokens": sum(r["padded_tokens_per_sec"] * r["window_s"] for r in rows),
            "real_tokens": sum(r["tokens_per_sec"] * r["window_s"] for r in rows)}


def _run_watched(cmd: list[str], env: dict) -> tuple[int, str, int]:
    """Run a command, its output merged; -> (exit code, output, the largest resident memory of its
    process tree, sampled every 50 ms: the CPU figure of peak memory)."""
    import tempfile

    import psutil
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak = 0
        while proc.poll() is None:
            try:
                tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.05)
        log.seek(0)
        return proc.returncode, log.read(), peak


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
    micro = spec.get("micro") or size["batch"]
    args = TrainingArguments(
        output_dir=spec["dir"], per_device_train_batch_size=micro, max_steps=spec["steps"], learning_rate=LR,
        gradient_accumulation_steps=spec.get("accum", 1), torch_compile=bool(spec.get("compile")),
        weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, warmup_steps=0,
        lr_scheduler_type="linear", max_grad_norm=1.0, bf16=spec["precision"] == "bf16", logging_steps=10 ** 9,
        save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=not cuda, seed=SEED, disable_tqdm=True,
        tf32=(cuda and spec["precision"] == "no" and torch.cuda.get_device_capability()[0] >= 8) or None,  # as ours
        train_sampling_strategy="group_by_length" if not mlm else "random",
        optim="adamw_torch_fused")                         # torch's fused AdamW: CUDA and CPU kernels
    Trainer(model=model, args=args, train_dataset=train_set, data_collator=collate, callbacks=[Clock()]).train()
    w, per_step = spec["warmup"], spec.get("accum", 1)   # collated micro batches per optimizer step
    batches = slice(w * per_step, (len(marks) - 1) * per_step)
    return {"seconds": marks[-1] - marks[w], "steps": len(marks) - 1 - w, "micro_batch": micro,
            "sequences": (len(marks) - 1 - w) * micro * per_step,
            "padded_tokens": sum(counts["padded"][batches]), "real_tokens": sum(counts["real"][batches])}


def worker(spec_path: str) -> None:
    """A Trainer row in a process of its own."""
    import torch
    spec = json.loads(Path(spec_path).read_text())
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = run_trainer(spec)
    result["peak_memory_mb"] = (torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available()
                                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    Path(spec["result"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the comparison
def mfu_of(row: dict, size: dict, vocab: int, tokens_per_s: float, peak: float) -> float:
    from types import SimpleNamespace

    from bert_recipes.perf import flops_per_token
    config = SimpleNamespace(hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
                             num_hidden_layers=size["num_hidden_layers"], vocab_size=vocab)
    # ours: the MLM head on the K = round(0.15 x seq) predicted tokens; the Trainer's head is dense
    head = (round(0.15 * size["seq"]) / size["seq"] if row["side"] == "ours" else 1.0) if row["workload"] == "mlm" else None
    return flops_per_token(config, size["seq"], head) * tokens_per_s / (peak * row_nproc(row))


def row_nproc(row: dict) -> int:
    """Backend rows: 2 CPU processes, or 1 GPU; the rest one process."""
    import torch
    return 2 if row.get("backend") and not torch.cuda.is_available() else 1


def peaks(precisions: list[str]) -> dict:
    """{precision: (datasheet peak or nan, matmul peak measured now)} of one device."""
    import torch

    from bert_recipes.perf import measured_matmul_peak, peak_flops
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for p in precisions:
        sheet = peak_flops(device, p)[0] if device.type == "cuda" else float("nan")
        out[p] = (sheet, measured_matmul_peak(device, torch.bfloat16 if p in ("bf16", "fp16") else torch.float32))
    return out


def run_row(row: dict, spec: dict, out: Path) -> dict:
    """One run of a row: train.py directly (one process, as a user runs it), the Trainer in a worker."""
    if row["side"] == "ours":
        return run_ours(spec)
    spec["result"] = str(out / "result.json")
    (out / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(out / "spec.json")], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                               "HF_DATASETS_OFFLINE": "1"})
    if proc.returncode:
        raise RuntimeError(f"{row['name']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def measure(args) -> dict:
    """Every row, alternating repeat after repeat. Each run's result is appended to bench.jsonl the moment
    it is known, and bench.md / bench.json are rewritten from what has finished: a time limit keeps
    every finished run."""
    size, out = SIZES[args.size], Path(args.out)
    data = prepare_workloads(size, out / f"data-{args.size}", Path(args.sample_dir))
    vocab = len(json.loads((data["mlm"] / "tokenizer/tokenizer.json").read_text())["model"]["vocab"])
    precisions = args.precisions.split(",")
    rows = variants(precisions, args.offload, essential=args.set == "essential")
    if args.only:   # a subset of the rows, e.g. --only classify
        rows = [r for r in rows if any(word in r["name"] for word in args.only.split(","))]
    if args.rows:   # these rows by name, e.g. --rows "mlm: train.py|mlm: Trainer"
        rows = [r for r in rows if r["name"] in args.rows.split("|")]
    # fine-tuning: one epoch, so both sides see the same sequences (their length mix decides tokens/s)
    epoch_steps = (args.classify_steps or
                   json.loads((data["classify"] / "prepared.json").read_text())["splits"]["train"] // size["batch"])
    state = {"size": args.size, "model": {k: size[k] for k in MODEL_KEYS}, "vocab": vocab, "seq": size["seq"],
             "batch": size["batch"], "steps": args.steps, "classify_steps": epoch_steps, "warmup": args.warmup,
             "repeats": args.repeats, "device": device_name(), "date": time.strftime("%Y-%m-%d"),
             "peaks": peaks(precisions), "collate_ms": collate_cost(data, size["seq"]), "rows": rows,
             "runs": {r["name"] + "|" + r["precision"]: [] for r in rows}}
    journal = out / "bench.jsonl"
    journal.write_text("")
    total, done = args.repeats * len(rows), 0
    for repeat in range(args.repeats):
        order = rows if repeat % 2 == 0 else list(reversed(rows))   # alternate who goes first
        for row in order:
            key = row["name"] + "|" + row["precision"]
            spec = {**row, "size": args.size, "data": {k: str(v) for k, v in data.items()},
                    "steps": epoch_steps if row["workload"] == "classify" else args.steps,
                    "warmup": args.warmup, "nproc": row_nproc(row),
                    "dir": str(out / "runs" / key.replace(" ", "_").replace(":", "").replace("|", "-").replace(",", ""))}
            if row.get("micro_from"):   # the micro batch (and accumulation to 256) that train.py's auto picked
                picked = state["runs"].get(row["micro_from"] + "|" + row["precision"]) or [{}]
                spec["micro"] = picked[-1].get("micro_batch") or size["batch"]
                spec["accum"] = max(1, 256 // spec["micro"])
            done += 1
            print(f"[bench] {done}/{total}: {row['name']} ({row['precision']}), repeat {repeat + 1} ...", flush=True)
            t0 = time.time()
            try:
                result = run_row(row, spec, out)
            except RuntimeError as err:
                raise SystemExit(f"[bench] {err}") from None
            result.update(name=row["name"], precision=row["precision"], repeat=repeat, wall_s=time.time() - t0)
            with journal.open("a") as f:
                f.write(json.dumps(result) + "\n")
            state["runs"][key].append(result)
            print(f"[bench]   {result['real_tokens'] / result['seconds']:.0f} tokens/s, {result['wall_s']:.0f} s",
                  flush=True)
            write_outputs(summarize(state), out, chart_too=False)
    return summarize(state)


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"


def summarize(state: dict) -> dict:
    """The table and the ratios of the runs finished so far."""
    size, table = SIZES[state["size"]], []
    for row in state["rows"]:
        runs = state["runs"][row["name"] + "|" + row["precision"]]
        if not runs:
            continue
        rates = [r["real_tokens"] / r["seconds"] for r in runs]   # useful tokens: padding does not count
        tokens_per_s = statistics.median(rates)
        sheet, measured = state["peaks"][row["precision"]]
        last = runs[-1]
        table.append({**{k: row[k] for k in ("name", "workload", "side", "precision")}, "pair": row.get("pair"),
                      "tokens_per_s": tokens_per_s, "rates": rates, "micro_batch": last.get("micro_batch"),
                      "sequences_per_s": statistics.median(r["sequences"] * row_nproc(row) / r["seconds"] for r in runs),
                      "mfu": mfu_of(row, size, state["vocab"], tokens_per_s, measured),
                      "mfu_datasheet": mfu_of(row, size, state["vocab"], tokens_per_s, sheet),
                      "peak_memory_mb": max(r["peak_memory_mb"] for r in runs),
                      "padding": 1 - last["real_tokens"] / last["padded_tokens"], "matmul_peak": measured,
                      "datasheet_peak": sheet})
    ratios = []
    for row in table:
        other = next((o for o in table if row["pair"] and o["name"] == row["pair"] and o["precision"] == row["precision"]),
                     None)
        if other:
            ratios.append({"what": f"{row['name']} / {other['name']}", "precision": row["precision"],
                           "ratio": row["tokens_per_s"] / other["tokens_per_s"]})
    return {k: v for k, v in state.items() if k != "rows"} | {"rows": table, "ratios": ratios}


def write_outputs(result: dict, out: Path, chart_too: bool = True) -> str:
    text = render(result)
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if chart_too and result["rows"]:
        chart(result, out / "bench.png")
    return text


# ----------------------------------------------------------------------------- collation
def collate_cost(data: dict, seq: int, batch: int = 32, repeats: int = 300) -> dict[str, float]:
    """Milliseconds to collate one packed MLM micro batch (`batch` blocks of `seq` tokens) on one CPU core,
    median of `repeats` (each with another epoch, so other masks): the default (K predictions a
    sequence), whole-word masking, and the per-token choice (data.max_predictions_per_seq=null). The
    rows are fetched beforehand: this is the collate_fn alone, which runs on the training thread with
    data.num_workers=0."""
    import torch
    from datasets import DatasetDict
    from transformers import AutoTokenizer

    from bert_recipes.data import Indexed, MLMCollator
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(data["mlm"] / "tokenizer")
        train = Indexed(DatasetDict.load_from_disk(str(data["mlm"] / "data"))["train"])
        examples = [train[i] for i in range(batch)]
        k, out = round(0.15 * seq), {}
        for name, kwargs in (("K predictions (default)", {"max_predictions": k}),
                             ("whole-word masking, K", {"max_predictions": k, "whole_word": True}),
                             ("per-token choice", {})):
            collate = MLMCollator(tokenizer, 0.15, SEED, pad_to_multiple_of=None, **kwargs)
            times = []
            for epoch in range(repeats):
                collate.epoch = epoch
                t0 = time.perf_counter()
                collate(examples)
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times) * 1000
        return out
    finally:
        torch.set_num_threads(threads)


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
             "| row | precision | micro batch | tokens/s | sequences/s | MFU (measured matmul peak) | MFU (datasheet) | "
             "peak memory MB | padding |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        sheet = "n/a" if r["mfu_datasheet"] != r["mfu_datasheet"] else f"{r['mfu_datasheet']:.1%}"
        lines.append(f"| {r['name']} | {r['precision']} | {r['micro_batch']} | {r['tokens_per_s']:.0f} | "
                     f"{r['sequences_per_s']:.1f} | {r['mfu']:.1%} | {sheet} | {r['peak_memory_mb']:.0f} | "
                     f"{r['padding']:.0%} |")
    lines += ["", "| ratio (tokens/s) | precision | |", "|---|---|---|"]
    lines += [f"| {r['what']} | {r['precision']} | **{r['ratio']:.2f}x** |" for r in result["ratios"]]
    peaks_line = "; ".join(f"{p}: {m / 1e12:.2f} TFLOP/s measured" + (f", {d / 1e12:.0f} datasheet" if d == d else "")
                           for p, (d, m) in result["peaks"].items())
    lines += ["", "tokens/s counts the real tokens (padding is not counted; `padding` is its share of the positions fed "
              "to the model). MFU: model FLOPs per token (ours: the MLM head on the K = round(0.15 x sequence) "
              "predicted tokens; the Trainer's head is dense) x tokens/s over a device's peak: the matmul peak "
              f"measured in this run, and the datasheet's (GPUs). Peaks: {peaks_line}.", "",
              "Collation of one packed MLM micro batch (32 blocks of the sequence length) on one CPU core, the "
              "collate_fn alone (median of 300):", "", "| masking | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in result["collate_ms"].items()]
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
    parser.add_argument("--set", choices=["all", "essential"], default="all",
                        help="essential: train.py and the Trainer at each precision, and on a GPU at the automatic "
                             "micro batch (at most 6 launches)")
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
    print(write_outputs(result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
