"""make bench: train.py against transformers' Trainer on the identical workload, side by side.

    python tools/bench.py --size mini                          # make bench: MLM + fine-tuning, fp32 and bf16
    python tools/bench.py --size base --set gpu-must           # one GPU: the GPU session's first part
    python tools/bench.py --size tiny --steps 20 --repeats 1   # the smoke test's size

Both sides get the same model config (BERT, sdpa attention), the same prepared token ids (tools/prepare.py:
packed MLM blocks; the sample's classification task), micro batch, sequence length, optimizer settings,
precision and number of steps; the Trainer gets the settings a user passes (bf16=True where we use bf16,
sdpa, the fused AdamW, train_sampling_strategy="group_by_length" for fine-tuning), in eager mode, and a
second Trainer row with torch_compile=True. train.py runs as users run it: it logs every 10 steps (a log
step reads the device), writes no checkpoint and no export, and only whole log windows after the warmup
are timed. Each train.py run is a fresh process; the Trainer runs in a worker (the rows that share a
`process` key in one worker, one after the other: the GPU sets, where a launch costs tens of seconds).
The sides alternate, repeat after repeat. Every run's result goes to bench.jsonl the moment it is known,
and bench.md / bench.json are rewritten from the finished runs after each one, so a time limit keeps them;
a row over its own limit (`limit_s`) is stopped, recorded as cut with its last lines, and the next runs.

The table gives, per row: tokens/s (real tokens), sequences/s, MFU in two conventions (the anchors': 6N +
12 L d s FLOPs a token with the dense MLM head, over the datasheet peak on GPUs and the measured matmul
peak on CPUs; ours: the head on the predicted positions only), the data-wait share, peak memory, the
padding share and the number of batch shapes; the ratios of paired rows; the cost of collating and of
fetching one packed MLM batch of 32 and of 256 sequences on one core.

Quality beside speed (--quality-seeds, 3 by default; 0 skips): tools/quality.py, paired seeds: for each
seed train.py and the Trainer start from the same saved initial weights and take the same micro batches in
the same order with the same maths; one evaluator scores every model (MLM eval loss and accuracy over the
same masks, fine-tuning accuracy on the sample task), with the positive controls (train.py with a
quartered lr, and with half its MLM labels) that must fall outside the band; the table sits beside the MLM
speed ratio: a faster loop that learns less is not faster.

Absolute numbers on a shared machine are noise; the ratios from one run are the result.
"""
from __future__ import annotations

import argparse
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

SIZES = {   # model, vocabulary, sequence, micro batch
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256, vocab=1000,
                 seq=64, batch=16, auto_global=32),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab=8192,
                 seq=128, batch=16),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab=30522,
                 seq=128, batch=32),
}
MODEL_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
LR, SEED = 1e-4, 7
WINDOW = 10          # train.py rows log every WINDOW steps, as a user's run does (logging.log_every's default)
# The global batch of the automatic-micro-batch rows: BERT's phase-1 per-GPU share; a size may set its own
# (tiny, the CPU rehearsal's: 2 micro batches, the same accumulation path at an eighth of the work).
AUTO_GLOBAL = 256
EQUAL_WORK = ["data.max_predictions_per_seq=null", "model.sparse_mlm_head=false"]   # the Trainer's head and masking


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


# ----------------------------------------------------------------------------- the rows
def row(name: str, workload: str, side: str, precision: str, **more) -> dict:
    """One row: a fresh process each run. pair: the row it is compared with (a Trainer row, or the row a
    feature's 'off' is); extra: train.py overrides; micro_from: the Trainer takes the micro batch (and the
    accumulation to AUTO_GLOBAL) that this train.py row picked; process: Trainer rows with the same key
    share one worker; limit_s: the run is stopped (and recorded as cut) past this many seconds."""
    return {"name": name, "workload": workload, "side": side, "precision": precision, **more}


def auto_micro(cuda: bool, size: dict) -> list[str]:
    """train.py's automatic micro batch (GPUs); on CPU processes, which have no free-memory figure, the
    size's micro batch stands in (a rehearsal runs the same rows)."""
    return [f"train.global_batch_size={size.get('auto_global', AUTO_GLOBAL)}", "train.micro_batch_size=" + ("auto" if cuda else str(size["batch"]))]


def gpu_rows(part: str, cuda: bool, size: dict) -> list[dict]:
    """The GPU session's rows (tools/gpu_session.py), bf16, in the order to run them; the limits are the
    session's, sized for an H200 (docs/speed.md: "The GPU session")."""
    auto = auto_micro(cuda, size)
    if part == "gpu-must":   # the automatic micro batch, eager and compiled, against the Trainer at the same micro
        return [row("mlm: train.py, auto micro batch", "mlm", "ours", "bf16", extra=auto + ["logging.profile=true"],
                    pair="mlm: Trainer, same micro batch", limit_s=40),
                row("mlm: train.py + compile, auto micro batch", "mlm", "ours", "bf16", extra=auto + ["train.compile=true"],
                    pair="mlm: Trainer + compile, same micro batch", limit_s=75),
                row("mlm: Trainer, same micro batch", "mlm", "trainer", "bf16", micro_from="mlm: train.py, auto micro batch",
                    process="trainer-auto", limit_s=40),
                row("mlm: Trainer + compile, same micro batch", "mlm", "trainer", "bf16", compile=True,
                    micro_from="mlm: train.py, auto micro batch", process="trainer-auto", limit_s=50)]
    return [row("classify: train.py, step times", "classify", "ours", "bf16",
                extra=["data.group_by_length=true", "logging.step_times=true"], limit_s=35),
            # the fixed micro batch, last: ours, ours doing the Trainer's work (dense head, per-token masking)
            row("mlm: train.py", "mlm", "ours", "bf16", pair="mlm: Trainer", limit_s=20),
            row("mlm: train.py, dense head (equal work)", "mlm", "ours", "bf16", extra=EQUAL_WORK, pair="mlm: Trainer",
                limit_s=20),
            row("mlm: Trainer", "mlm", "trainer", "bf16", limit_s=20)]


def variants(precisions: list[str], offload: bool, which: str = "all", size: dict | None = None) -> list[dict]:
    """What is run, in order. all: train.py and the Trainer at each precision, and each speed feature on
    and off; gpu-must / gpu-rest: the GPU session's two parts (gpu_rows; bf16)."""
    import torch
    cuda = torch.cuda.is_available()
    if which.startswith("gpu-"):
        return gpu_rows(which, cuda, size or SIZES["base"])
    rows = []
    for p in precisions:
        rows += [row("mlm: train.py", "mlm", "ours", p, pair="mlm: Trainer"), row("mlm: Trainer", "mlm", "trainer", p)]
    if cuda and "bf16" in precisions:   # the automatic micro batch; the Trainer runs at the one train.py picked
        rows += [row("mlm: train.py, auto micro batch", "mlm", "ours", "bf16", extra=auto_micro(True, {}),
                     pair="mlm: Trainer, same micro batch"),
                 row("mlm: Trainer, same micro batch", "mlm", "trainer", "bf16",
                     micro_from="mlm: train.py, auto micro batch")]
    for p in precisions:
        rows += [
            row("mlm: Trainer + compile", "mlm", "trainer", p, compile=True, pair="mlm: Trainer"),
            row("mlm: train.py + compile", "mlm", "ours", p, extra=["train.compile=true"], pair="mlm: train.py"),
            row("mlm: train.py, dense head (equal work)", "mlm", "ours", p, extra=EQUAL_WORK, pair="mlm: Trainer"),
            row("mlm: train.py, foreach AdamW", "mlm", "ours", p, extra=["optim.fused=false"], pair="mlm: train.py"),
            row("mlm: train.py, per-token masking", "mlm", "ours", p, extra=["data.max_predictions_per_seq=null"],
                pair="mlm: train.py"),
            row("classify: train.py", "classify", "ours", p, extra=["data.group_by_length=true"],
                pair="classify: Trainer"),
            row("classify: Trainer", "classify", "trainer", p),
            row("classify: train.py, no grouping", "classify", "ours", p, extra=["data.group_by_length=false"],
                pair="classify: train.py"),
        ]
        if not cuda:   # model.dropout_impl=packed is a CPU opt-in (refused on GPUs)
            rows.append(row("mlm: train.py, packed dropout", "mlm", "ours", p, extra=["model.dropout_impl=packed"],
                            pair="mlm: train.py"))
    if offload:
        rows += [row("zero2-offload: DeepSpeed CPU Adam", "mlm", "ours", "no", backend="zero2-offload",
                     extra=["optim.cpu_adam=true"], pair="zero2-offload: torch AdamW"),
                 row("zero2-offload: torch AdamW", "mlm", "ours", "no", backend="zero2-offload",
                     extra=["optim.cpu_adam=false"])]
    return rows


# ----------------------------------------------------------------------------- one run of train.py
def ours_command(spec: dict) -> tuple[list[str], dict]:
    """train.py as a user runs it on the prepared data (python train.py, or accelerate launch for a
    backend row), logging every WINDOW steps, with no final checkpoint, evaluation or export."""
    size, data = SIZES[spec["size"]], Path(spec["data"][spec["workload"]])
    recipe = "tiny-mlm.yaml" if spec["workload"] == "mlm" else "tiny-classify.yaml"
    overrides = [f"--run.output_dir={spec['dir']}", "--run.overwrite=true", f"--run.seed={SEED}",
                 "--data.source=prepared", f"--data.prepared_dir={data}", f"--data.max_seq_length={size['seq']}",
                 f"--model.max_position_embeddings={max(512, size['seq'])}", f"--train.max_steps={spec['steps']}",
                 f"--train.global_batch_size={size['batch'] * spec.get('nproc', 1)}",
                 f"--train.micro_batch_size={size['batch']}", "--train.eval_every=null", "--train.eval_final=false",
                 f"--optim.lr={LR}", "--optim.warmup_steps=0", f"--train.mixed_precision={spec['precision']}",
                 f"--logging.log_every={WINDOW}", "--logging.trackers=[]", "--logging.plot=false",
                 "--logging.progress_bar=false", "--checkpoint.export=false", "--checkpoint.save_every=null",
                 "--checkpoint.save_final=false"]
    overrides += [f"--model.{k}={size[k]}" for k in MODEL_KEYS]
    if spec["workload"] == "classify":   # the settings it was prepared with (tools/prepare.py checks them)
        overrides += ["--model.name_or_path=null", f"--tokenizer.name_or_path={Path(spec['data']['mlm']) / 'tokenizer'}"]
    else:
        overrides.append(f"--tokenizer.vocab_size={size['vocab']}")
    if spec.get("compile_backend") and "train.compile=true" in spec.get("extra", []):
        overrides.append(f"--train.compile_backend={spec['compile_backend']}")
    overrides += [f"--{e}" for e in spec.get("extra", [])]
    script = [str(REPO / "train.py"), "--recipe", str(REPO / "recipes" / recipe)]
    if not spec.get("backend"):   # one process: python train.py, as a user runs it
        return [sys.executable] + script + overrides, dict(os.environ)
    import torch

    from bert_recipes.backends.plan import backend_rows
    row_, cuda = backend_rows()[spec["backend"]], torch.cuda.is_available()   # launched as make <mode> does
    env = dict(os.environ) if cuda else row_.cpu_launch_env({**os.environ, "OMP_NUM_THREADS": "1"})
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / (row_.config if cuda else row_.cpu_config)), "--num_processes", str(spec["nproc"])] + script
    return cmd + overrides, env


def run_ours(spec: dict) -> dict:
    """One train.py run; timing from its own log windows after the warmup (whole windows only)."""
    cmd, env = ours_command(spec)
    code, stdout, peak_rss, wall_s = _run_watched(cmd, env, spec.get("limit_s"))
    if code is None:
        return cut(spec, stdout, wall_s)
    if code:
        raise RuntimeError(f"train.py exited {code}:\n{stdout[-4000:]}")
    metrics = json.loads((Path(spec["dir"]) / "metrics.json").read_text())
    final, history = metrics["final"], metrics["history"]["train"]
    rows = [r for r in history if r["step"] > spec["warmup"]]
    seconds = sum(r["window_s"] for r in rows)
    gpu_peaks = final.get("peak_memory_gb_per_rank")   # torch.cuda.max_memory_allocated, per rank
    times = [t for r in rows for t in r.get("step_times_ms", [])]
    return {"seconds": seconds, "steps": sum(r["window_steps"] for r in rows), "profile": _profile_block(stdout),
            "micro_batch": metrics["config"]["train/micro_batch_size"],
            "sequences": sum(r["samples_per_sec"] * r["window_s"] for r in rows),
            "data_wait_s": sum(r["data_wait_share"] * r["window_s"] for r in rows),
            "peak_memory_mb": max(gpu_peaks) * 1e9 / 2 ** 20 if gpu_peaks else peak_rss / 2 ** 20,
            "predicted_peak_mb": (final.get("predicted_peak_memory_gb") or float("nan")) * 1e9 / 2 ** 20,
            "padded_tokens": sum(r["padded_tokens_per_sec"] * r["window_s"] for r in rows),
            "real_tokens": sum(r["tokens_per_sec"] * r["window_s"] for r in rows),
            "shapes": final.get("batch_shapes"), "wall_s": wall_s,
            "train_s": sum(r["window_s"] for r in history),   # wall_s - train_s: the launch's cost (start-up, exit)
            "step_times_ms": times, "log_tail": stdout[-1500:]}


def cut(spec: dict, stdout: str, wall_s: float) -> dict:
    """A run stopped at its limit: what it printed last, for the record."""
    lines = [line for line in stdout.splitlines() if line.strip()][-8:]
    return {"cut": True, "limit_s": spec.get("limit_s"), "wall_s": wall_s, "last_lines": lines}


def _run_watched(cmd: list[str], env: dict, limit_s: float | None = None) -> tuple[int | None, str, int, float]:
    """Run a command, its output merged; -> (exit code, or None when stopped at `limit_s`; output; the
    largest resident memory of its process tree, sampled every 50 ms: the CPU figure of peak memory;
    wall seconds)."""
    import tempfile

    import psutil
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        peak, stopped = 0, False
        while proc.poll() is None:
            try:
                tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            if limit_s and time.time() - t0 > limit_s:
                os.killpg(proc.pid, 9)   # the whole tree: a launcher's ranks and a loader's workers too
                proc.wait()
                stopped = True
                break
            time.sleep(0.05)
        log.seek(0)
        return (None if stopped else proc.returncode), log.read(), peak, time.time() - t0


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


# ----------------------------------------------------------------------------- one run of the Trainer
def trainer_inputs(spec: dict):
    """The Trainer's model (the same config as ours, sdpa), its training split and its collator."""
    import torch
    from datasets import DatasetDict
    from transformers import (AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification,
                              DataCollatorForLanguageModeling, DataCollatorWithPadding)

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
    return model, train_set, base


def run_trainer(spec: dict) -> dict:
    """transformers' Trainer on the same token ids, model config and settings; its steps timed by a
    callback from one step's end to the next (data loading included, as on our side), and its data
    wait from a step's end to the next step's beginning (the Trainer fetches the step's batches there)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    model, train_set, base = trainer_inputs(spec)
    counts = {"padded": [], "real": [], "shapes": set()}

    def collate(features):
        batch = base(features)
        counts["padded"].append(batch["input_ids"].numel())
        counts["real"].append(int(batch["attention_mask"].sum()))
        counts["shapes"].add(tuple(batch["input_ids"].shape))
        return batch
    marks, waits = [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            marks.append(time.perf_counter())

        def on_step_begin(self, *args, **kwargs):
            waits.append(time.perf_counter() - marks[-1])

        def on_step_end(self, *args, **kwargs):
            marks.append(time.perf_counter())
    cuda, mlm = torch.cuda.is_available(), spec["workload"] == "mlm"
    micro = spec.get("micro") or SIZES[spec["size"]]["batch"]
    args = TrainingArguments(
        output_dir=spec["dir"], per_device_train_batch_size=micro, max_steps=spec["steps"], learning_rate=LR,
        gradient_accumulation_steps=spec.get("accum", 1), torch_compile=bool(spec.get("compile")),
        torch_compile_backend=spec.get("compile_backend") if spec.get("compile") else None,
        weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, warmup_steps=0,
        lr_scheduler_type="linear", max_grad_norm=1.0, bf16=spec["precision"] == "bf16", logging_steps=10 ** 9,
        save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=not cuda, seed=SEED, disable_tqdm=True,
        tf32=(cuda and spec["precision"] == "no" and torch.cuda.get_device_capability()[0] >= 8) or None,  # as ours
        train_sampling_strategy="group_by_length" if not mlm else "random",
        optim="adamw_torch_fused")                         # torch's fused AdamW: CUDA and CPU kernels
    Trainer(model=model, args=args, train_dataset=train_set, data_collator=collate, callbacks=[Clock()]).train()
    w, per_step = spec["warmup"], spec.get("accum", 1)   # collated micro batches per optimizer step
    batches = slice(w * per_step, (len(marks) - 1) * per_step)
    steps = len(marks) - 1 - w
    return {"seconds": marks[-1] - marks[w], "steps": steps, "micro_batch": micro,
            "sequences": steps * micro * per_step, "data_wait_s": sum(waits[w:]), "shapes": len(counts["shapes"]),
            "padded_tokens": sum(counts["padded"][batches]), "real_tokens": sum(counts["real"][batches])}


def worker(spec_path: str) -> None:
    """Trainer rows in a process of their own (a list of specs: run one after the other, each result
    appended to the results file as it finishes, the GPU's memory freed between them)."""
    import gc

    import torch
    specs = json.loads(Path(spec_path).read_text())
    for spec in specs:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        result = run_trainer(spec)
        result["peak_memory_mb"] = (torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available()
                                    else __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss / 1024)
        result["wall_s"] = time.time() - t0
        with open(spec["result"], "a") as f:
            f.write(json.dumps(result) + "\n")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_trainers(specs: list[dict], out: Path) -> list[dict]:
    """Trainer rows in one worker (one start-up for all); -> a result for each spec, in order (cut:
    the rows the worker did not finish within the sum of their limits)."""
    results_file = out / f"trainer-{os.getpid()}-{time.time_ns()}.jsonl"
    for spec in specs:
        spec["result"] = str(results_file)
    (out / "spec.json").write_text(json.dumps(specs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    limits = [s.get("limit_s") for s in specs]
    code, stdout, _, wall_s = _run_watched([sys.executable, __file__, "--worker", str(out / "spec.json")], env,
                                           sum(limits) if all(limits) else None)
    done = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.exists() else []
    if code not in (0, None):
        raise RuntimeError(f"{specs[len(done)]['name']} failed:\n{stdout[-3000:]}")
    return done + [cut(spec, stdout, wall_s) for spec in specs[len(done):]]


# ----------------------------------------------------------------------------- the comparison
def head_fraction(row_: dict, size: dict) -> float | None:
    """The share of positions the MLM head runs on: ours K = round(0.15 x seq) a sequence (0.15 on average
    with the per-token choice; all with the dense head); the Trainer's head is dense. None: no MLM head."""
    if row_["workload"] != "mlm":
        return None
    extra = row_.get("extra", [])
    if row_["side"] == "trainer" or "model.sparse_mlm_head=false" in extra:
        return 1.0
    return 0.15 if "data.max_predictions_per_seq=null" in extra else round(0.15 * size["seq"]) / size["seq"]


def mfu_of(row_: dict, size: dict, vocab: int, tokens_per_s: float, peak: float, head: float | None) -> float:
    """Model FLOPs per token (bert_recipes.perf.flops_per_token with the given MLM head share) x tokens/s
    over one device's peak, per process."""
    from types import SimpleNamespace

    from bert_recipes.perf import flops_per_token
    config = SimpleNamespace(hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
                             num_hidden_layers=size["num_hidden_layers"], vocab_size=vocab)
    return flops_per_token(config, size["seq"], head) * tokens_per_s / (peak * row_nproc(row_))


def row_nproc(row_: dict) -> int:
    """Backend rows: 2 CPU processes, or 1 GPU; the rest one process."""
    import torch
    return 2 if row_.get("backend") and not torch.cuda.is_available() else 1


PROBE = """
import json, sys, torch
from bert_recipes.perf import measured_matmul_peak, peak_flops
device = torch.device("cuda")
out = {p: (peak_flops(device, p)[0], measured_matmul_peak(device, torch.bfloat16 if p in ("bf16", "fp16") else
           torch.float32)) for p in sys.argv[1].split(",")}
print(json.dumps({"peaks": out, "device": torch.cuda.get_device_name(0)}))
"""


def probe(precisions: list[str]) -> tuple[dict, str]:
    """({precision: (datasheet peak or nan, matmul peak measured now)} of one device, its name). On a GPU
    in a process of its own: this process then holds no CUDA context and no probe buffers, which would
    take from the free memory that the automatic micro batch is sized from."""
    import torch
    if not torch.cuda.is_available():
        from bert_recipes.perf import measured_cpu_peak
        peaks = {p: (float("nan"), measured_cpu_peak(torch.bfloat16 if p == "bf16" else torch.float32, repeats=10,
                                                     fresh=True)) for p in precisions}   # this run's peak
        return peaks, f"CPU, {os.cpu_count()} cores"
    proc = subprocess.run([sys.executable, "-c", PROBE, ",".join(precisions)], cwd=REPO, capture_output=True,
                          text=True, check=True)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return {p: tuple(v) for p, v in found["peaks"].items()}, found["device"]


def spec_of(row_: dict, args, data: dict, out: Path, state: dict) -> dict:
    """What one run of `row_` needs: its steps, warmup, directory, and the micro batch it borrows."""
    size = SIZES[args.size]
    key = row_["name"] + "|" + row_["precision"]
    spec = {**row_, "size": args.size, "data": {k: str(v) for k, v in data.items()},
            "steps": state["classify_steps"] if row_["workload"] == "classify" else args.steps,
            "warmup": args.warmup, "nproc": row_nproc(row_), "compile_backend": args.compile_backend,
            "limit_s": row_["limit_s"] * args.limit_scale if row_.get("limit_s") else None,
            "dir": str(out / "runs" / key.replace(" ", "_").replace(":", "").replace("|", "-").replace(",", ""))}
    if row_.get("micro_from"):   # the micro batch (and accumulation to AUTO_GLOBAL) that train.py's auto picked
        picked = state["runs"].get(row_["micro_from"] + "|" + row_["precision"]) or [{}]
        spec["micro"] = picked[-1].get("micro_batch") or size["batch"]
        spec["accum"] = max(1, size.get("auto_global", AUTO_GLOBAL) // spec["micro"])
    return spec


def record(state: dict, row_: dict, result: dict, repeat: int, journal: Path, results: Path) -> None:
    """A finished (or cut) run: into bench.jsonl at once, then bench.md / bench.json from all so far."""
    result.update(name=row_["name"], precision=row_["precision"], repeat=repeat)
    result.setdefault("wall_s", None)
    with journal.open("a") as f:
        f.write(json.dumps({k: v for k, v in result.items() if k not in ("profile", "log_tail")}) + "\n")
    state["runs"][row_["name"] + "|" + row_["precision"]].append(result)
    if result.get("cut"):
        what = "FAILED" if result.get("failed") else f"CUT at its limit of {result['limit_s']} s"
        print(f"[bench]   {what}; last lines: {result['last_lines'][-2:]}", flush=True)
    else:
        print(f"[bench]   {result['real_tokens'] / result['seconds']:.0f} tokens/s, "
              f"{result['sequences'] / result['seconds']:.1f} sequences/s", flush=True)
    write_outputs(summarize(state), results, chart_too=False)


def measure(args) -> dict:
    """Every row, alternating repeat after repeat; Trainer rows that share a `process` run in one worker."""
    size, out, results = SIZES[args.size], Path(args.out), Path(args.results or args.out)
    data = prepare_workloads(size, Path(args.data_dir) if args.data_dir else out / f"data-{args.size}",
                             Path(args.sample_dir))
    vocab = len(json.loads((data["mlm"] / "tokenizer/tokenizer.json").read_text())["model"]["vocab"])
    precisions = args.precisions.split(",") if not args.set.startswith("gpu-") else ["bf16"]
    rows = select(variants(precisions, args.offload, args.set, size), args)
    epoch_steps = (args.classify_steps or   # fine-tuning: one epoch, so both sides see the same sequences
                   json.loads((data["classify"] / "prepared.json").read_text())["splits"]["train"] // size["batch"])
    peaks, device = probe(precisions)
    state = {"size": args.size, "model": {k: size[k] for k in MODEL_KEYS}, "vocab": vocab, "seq": size["seq"],
             "batch": size["batch"], "steps": args.steps, "classify_steps": epoch_steps, "warmup": args.warmup,
             "repeats": args.repeats, "device": device, "date": time.strftime("%Y-%m-%d"), "peaks": peaks,
             "collate_ms": collate_cost(data, size["seq"], repeats=args.collate_repeats), "fetch_ms": fetch_cost(data),
             "rows": rows,
             "runs": {r["name"] + "|" + r["precision"]: [] for r in rows}}
    journal = results / "bench.jsonl"
    if not args.append or not journal.exists():
        journal.write_text("")
    total, done = args.repeats * len(rows), 0
    for repeat in range(args.repeats):
        order, ran = (rows if repeat % 2 == 0 else list(reversed(rows))), set()   # alternate who goes first
        for row_ in order:
            if id(row_) in ran:
                continue
            group = [r for r in order if row_.get("process") and r.get("process") == row_["process"]] or [row_]
            ran.update(id(r) for r in group)
            done += len(group)
            print(f"[bench] {done}/{total}: {' + '.join(r['name'] for r in group)} ({row_['precision']}), "
                  f"repeat {repeat + 1} ...", flush=True)
            try:
                found = (run_trainers([spec_of(r, args, data, out, state) for r in group], out) if row_["side"] == "trainer"
                         else [run_ours(spec_of(row_, args, data, out, state))])
            except RuntimeError as err:   # recorded like a cut run, with its last lines; the next rows still run
                lines = [line for line in str(err).splitlines() if line.strip()]
                found = [{"cut": True, "failed": True, "limit_s": None, "last_lines": lines[-8:]} for _ in group]
                state["failed"] = True
                print(f"[bench] {lines[0] if lines else 'failed'}", flush=True)
            for r, result in zip(group, found):
                record(state, r, result, repeat, journal, results)
    return summarize(state)


def select(rows: list[dict], args) -> list[dict]:
    if args.only:   # a subset of the rows, e.g. --only classify
        rows = [r for r in rows if any(word in r["name"] for word in args.only.split(","))]
    if args.rows:   # these rows by name, e.g. --rows "mlm: train.py|mlm: Trainer"
        rows = [r for r in rows if r["name"] in args.rows.split("|")]
    return rows


def summarize(state: dict) -> dict:
    """The table and the ratios of the runs finished so far (a cut run is listed apart)."""
    size, table = SIZES[state["size"]], []
    for r in state["rows"]:
        all_runs = state["runs"][r["name"] + "|" + r["precision"]]
        runs = [x for x in all_runs if not x.get("cut")]
        if not runs:
            if all_runs:
                table.append({**r, "cut": all_runs[-1]})
            continue
        table.append(summarize_row(r, runs, state, size))
    ratios = []
    for r in table:
        other = next((o for o in table if r.get("pair") and o["name"] == r["pair"] and o["precision"] == r["precision"]
                      and "cut" not in o), None)
        if other and "cut" not in r:
            ratios.append({"what": f"{r['name']} / {other['name']}", "precision": r["precision"],
                           "ratio": r["tokens_per_s"] / other["tokens_per_s"],
                           "sequences_ratio": r["sequences_per_s"] / other["sequences_per_s"]})
    return {k: v for k, v in state.items() if k != "rows"} | {"rows": table, "ratios": ratios}


def summarize_row(r: dict, runs: list[dict], state: dict, size: dict) -> dict:
    rates = [x["real_tokens"] / x["seconds"] for x in runs]   # useful tokens: padding does not count
    tokens_per_s = statistics.median(rates)
    sheet, measured = state["peaks"][r["precision"]]
    peak = sheet if sheet == sheet else measured   # the datasheet on GPUs; a CPU has none: the measured one
    last = runs[-1]
    times = last.get("step_times_ms") or []
    median_step = statistics.median(times) if times else None
    return {**{k: r.get(k) for k in ("name", "workload", "side", "precision", "pair")},
            "tokens_per_s": tokens_per_s, "rates": rates, "micro_batch": last.get("micro_batch"),
            "sequences_per_s": statistics.median(x["sequences"] * row_nproc(r) / x["seconds"] for x in runs),
            "mfu_anchors": mfu_of(r, size, state["vocab"], tokens_per_s, peak, 1.0 if r["workload"] == "mlm" else None),
            "mfu_ours": mfu_of(r, size, state["vocab"], tokens_per_s, peak, head_fraction(r, size)),
            "mfu_measured_peak": mfu_of(r, size, state["vocab"], tokens_per_s, measured, head_fraction(r, size)),
            "data_wait": statistics.median(x["data_wait_s"] / x["seconds"] for x in runs),
            "peak_memory_mb": max(x["peak_memory_mb"] for x in runs), "predicted_peak_mb": last.get("predicted_peak_mb"),
            "padding": 1 - last["real_tokens"] / last["padded_tokens"], "shapes": last.get("shapes"),
            "step_ms_median": median_step, "step_ms_max": max(times) if times else None,
            "step_max_over_median": max(times) / median_step if times else None,
            "matmul_peak": measured, "datasheet_peak": sheet, "wall_s": last.get("wall_s"),
            "launch_s": last["wall_s"] - last["train_s"] if last.get("train_s") and last.get("wall_s") else None}


def write_outputs(result: dict, out: Path, chart_too: bool = True) -> str:
    text = render(result)
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    profiles = [(r["name"], runs[-1]["profile"]) for r in result["rows"] if "cut" not in r
                for runs in [result["runs"][r["name"] + "|" + r["precision"]]] if runs[-1].get("profile")]
    if profiles:   # train.py --profile's table of a row that profiled its warmup steps (logging.profile)
        (out / "profile.md").write_text("".join(f"## {name}\n\n```\n{table}\n```\n\n" for name, table in profiles))
    if chart_too and any("cut" not in r for r in result["rows"]):
        chart(result, out / "bench.png")
    return text


# ----------------------------------------------------------------------------- collation and fetching
def collate_cost(data: dict, seq: int, batches: tuple = (32, 256), repeats: int = 100) -> dict[str, dict]:
    """Milliseconds to collate one packed MLM micro batch (`batch` blocks of `seq` tokens) on one CPU core,
    median of `repeats` (each with another epoch, so other masks): the default (K predictions a sequence),
    whole-word masking, and the per-token choice (data.max_predictions_per_seq=null). The rows are fetched
    beforehand: this is the collate_fn alone. -> {masking: {batch: ms}}"""
    import torch
    from datasets import DatasetDict
    from transformers import AutoTokenizer

    from bert_recipes.batching import Indexed
    from bert_recipes.collate import MLMCollator
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(data["mlm"] / "tokenizer")
        train = Indexed(DatasetDict.load_from_disk(str(data["mlm"] / "data"))["train"])
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
    """Milliseconds to read one micro batch of `batch` packed rows from the memory-mapped Arrow data, as
    the DataLoader's fetcher does: row by row (__getitem__) against one Arrow call (data.Indexed.__getitems__)."""
    from datasets import DatasetDict

    from bert_recipes.batching import Indexed
    train = Indexed(DatasetDict.load_from_disk(str(data["mlm"] / "data"))["train"])
    out = {}
    for name, fetch in (("row by row", lambda ids: [train[i] for i in ids]), ("one Arrow call", train.__getitems__)):
        times = []
        for r in range(repeats):
            ids = [(r * 7919 + i * 104729) % len(train) for i in range(batch)]
            t0 = time.perf_counter()
            fetch(ids)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1000
    return out


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



# ----------------------------------------------------------------------------- quality against the Trainer
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


def render_quality(report: dict | None, ratios: list[dict]) -> list[str]:
    """The quality table (tools/quality.py) beside the speed ratio: a faster loop that learns less is not faster."""
    if not report:
        return []
    from quality import render
    speed = next((r for r in ratios if r["what"] == "mlm: train.py / mlm: Trainer"), None)
    lines = ["", f"## Quality against the Trainer: seeds {report['seeds']}, {report['mlm']['steps']} MLM steps "
             f"from the same initial weights on the same micro batches, then {report['classify']['steps']} "
             "fine-tuning steps from make demo's model (tools/quality.py)", ""]
    if speed:
        lines += [f"MLM tokens/s ratio (train.py / Trainer) in this run: **{speed['ratio']:.2f}x** ({speed['precision']})", ""]
    return lines + render(report)


def _pct(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.1%}"


def render(result: dict) -> str:
    m = result["model"]
    lines = [f"# make bench: {result['size']} (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab "
             f"{result['vocab']}, sequence {result['seq']}, micro batch {result['batch']} unless the row says), "
             f"{result['device']}, {result['date']}", "",
             f"{result['steps']} steps per MLM run and {result['classify_steps']} per fine-tuning run; train.py logs every "
             f"{WINDOW} steps and the first {result['warmup']} are not timed; median of {result['repeats']} alternating "
             "runs per row.", "",
             "| row | precision | micro batch | tokens/s | sequences/s | MFU, anchors' convention | MFU, ours | "
             "data-wait | peak memory MB (planner) | padding | shapes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "cut" in r:
            what = "failed" if r["cut"].get("failed") else f"cut at its limit of {r['cut']['limit_s']} s"
            lines.append(f"| {r['name']} | {r['precision']} | | | | | | | | | | {what}: "
                         f"{' / '.join(r['cut']['last_lines'][-2:])[:160]} |")
            continue
        planned = r.get("predicted_peak_mb")
        planned = f" ({planned:.0f})" if planned is not None and planned == planned else ""
        lines.append(f"| {r['name']} | {r['precision']} | {r['micro_batch']} | {r['tokens_per_s']:.0f} | "
                     f"{r['sequences_per_s']:.1f} | {_pct(r['mfu_anchors'])} | {_pct(r['mfu_ours'])} | "
                     f"{r['data_wait']:.1%} | {r['peak_memory_mb']:.0f}{planned} | {r['padding']:.0%} | "
                     f"{r['shapes'] if r['shapes'] is not None else 'n/a'} |")
    lines += ["", "| ratio | precision | tokens/s | sequences/s |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['precision']} | **{r['ratio']:.2f}x** | {r['sequences_ratio']:.2f}x |"
              for r in result["ratios"]]
    steps = [r for r in result["rows"] if "cut" not in r and r.get("step_ms_median")]
    if steps:
        lines += ["", "| per-step times after the warmup (logging.step_times) | median ms | max ms | max / median |",
                  "|---|---|---|---|"]
        lines += [f"| {r['name']} ({r['precision']}) | {r['step_ms_median']:.1f} | {r['step_ms_max']:.1f} | "
                  f"{r['step_max_over_median']:.2f} |" for r in steps]
    peaks_line = "; ".join(f"{p}: {m / 1e12:.2f} TFLOP/s measured" + (f", {d / 1e12:.0f} datasheet" if d == d else "")
                           for p, (d, m) in result["peaks"].items())
    lines += ["", "tokens/s counts the real tokens (`padding` is the share of the positions fed to the model that "
              "were padding; `shapes`, the distinct batch shapes). MFU is model FLOPs per token x tokens/s over one "
              "device's peak: the datasheet's on GPUs, the matmul peak measured in this run on CPUs. The anchors' "
              "convention counts 6N + 12 L d s FLOPs a token with the dense MLM head (BERT's papers, NVIDIA's and "
              "MosaicML's figures) whatever the code runs; ours counts what the row computes: the head on the "
              f"K = round(0.15 x sequence) predicted positions for train.py's default. Peaks: {peaks_line}. "
              "data-wait: the share of the timed steps spent waiting for batches (the Trainer: from a step's end to "
              "the next step's beginning). Peak memory: torch.cuda.max_memory_allocated on GPUs (and the memory "
              "planner's prediction for train.py), the process tree's resident memory on CPUs.", "",
              "One packed MLM micro batch of the sequence length on one CPU core (median): collating it (the "
              "collate_fn alone), and fetching its rows from the memory-mapped data:", "",
              "| work | " + " | ".join(f"{b} sequences, ms" for b in next(iter(result["collate_ms"].values()))) + " |",
              "|---|" + "---|" * len(next(iter(result["collate_ms"].values())))]
    lines += [f"| collate: {name} | " + " | ".join(f"{ms:.2f}" for ms in by_batch.values()) + " |"
              for name, by_batch in result["collate_ms"].items()]
    lines += [f"| fetch 256 rows: {name} | {ms:.2f} | |" for name, ms in result.get("fetch_ms", {}).items()]
    lines += render_quality(result.get("quality"), result["ratios"])
    lines += render_accuracy(result.get("accuracy"))
    for precision, table in (result.get("profiles") or {}).items():
        lines += ["", f"## Where train.py's MLM step spends its time ({precision}): train.py --profile, steps 3-5",
                  "", "```", table or "(no profile table in the log)", "```"]
    return "\n".join(lines)


def render_accuracy(acc: dict | None) -> list[str]:
    if not acc:
        return []
    lines = ["", f"## Fine-tuning with and without data.group_by_length: the sample task, {acc['steps']} steps "
             f"from a tiny model pretrained {acc['pretrain_steps']} steps", "",
             "| batches | eval accuracy per seed | mean | padding | wall s (mean) |", "|---|---|---|---|---|"]
    for name, runs in acc["runs"].items():
        values = [r["accuracy"] for r in runs]
        lines.append(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.mean(values):.3f} | "
                     f"{statistics.mean(r['padding'] for r in runs):.0%} | "
                     f"{statistics.mean(r['wall_s'] for r in runs):.0f} |")
    base = acc["runs"]["grouped"][0]["baseline"]
    return lines + (["", f"Majority-class baseline: {base:.3f}."] if base else [])


def chart(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if "cut" not in r]
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
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", help="comma-separated words: run only the rows whose name contains one")
    parser.add_argument("--rows", help="|-separated row names: run only these rows")
    parser.add_argument("--set", choices=["all", "gpu-must", "gpu-rest"], default="all",
                        help="gpu-must / gpu-rest: the GPU session's two parts (bf16; tools/gpu_session.py)")
    parser.add_argument("--classify-steps", type=int, help="fine-tuning steps per run (default: one epoch)")
    parser.add_argument("--warmup", type=int, default=WINDOW, help=f"untimed steps, a multiple of {WINDOW}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offload", action="store_true", help="also ZeRO-2 offload: DeepSpeed CPU Adam vs torch AdamW")
    parser.add_argument("--compile-backend", default="inductor", choices=["inductor", "eager", "aot_eager"],
                        help="the compile rows' backend (eager: dynamo's tracing without kernels, a rehearsal's)")
    parser.add_argument("--accuracy", action="store_true",
                        help="also fine-tune the sample task with and without data.group_by_length: eval accuracy")
    parser.add_argument("--accuracy-seeds", type=int, default=3)
    parser.add_argument("--accuracy-steps", type=int, default=256, help="fine-tuning steps (tiny-classify: 4 epochs)")
    parser.add_argument("--accuracy-pretrain-steps", type=int, default=600, help="tiny-mlm steps (as make demo)")
    parser.add_argument("--quality-seeds", type=int, default=3,
                        help="train.py against the Trainer on quality (tools/quality.py): MLM eval loss and accuracy, "
                             "fine-tuning accuracy, paired over these many seeds, with its positive controls (0 skips)")
    parser.add_argument("--quality-steps", type=int, default=500, help="MLM steps per quality run")
    parser.add_argument("--quality-classify-steps", type=int, default=256,
                        help="fine-tuning steps per quality run, from make demo's model (none without it)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile train.py's MLM step at each precision (torch.profiler top 10)")
    parser.add_argument("--out", default="runs/bench", help="runs, prepared data and (unless --results) the results")
    parser.add_argument("--results", help="write bench.jsonl, bench.md, bench.json and profile.md here instead")
    parser.add_argument("--append", action="store_true", help="append to an existing bench.jsonl")
    parser.add_argument("--data-dir", help="the prepared workloads (default: OUT/data-SIZE, prepared when missing)")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="multiply the rows' limits (a slow host)")
    parser.add_argument("--collate-repeats", type=int, default=100, help="collations timed per batch size")
    parser.add_argument("--sample-dir", default="data/sample")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.warmup % WINDOW or args.steps <= args.warmup:
        parser.error(f"--warmup must be a multiple of {WINDOW} (train.py's log window) and below --steps")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.results or args.out).mkdir(parents=True, exist_ok=True)
    result = measure(args)
    if args.quality_seeds:
        result["quality"] = quality_check(args)
        write_outputs(result, Path(args.results or args.out), chart_too=False)
    if args.accuracy:
        result["accuracy"] = accuracy_check(args)
    if args.profile:
        result["profiles"] = profile_ours(args, prepare_workloads(SIZES[args.size], Path(args.out) / f"data-{args.size}",
                                                                  Path(args.sample_dir)))
    print(write_outputs(result, Path(args.results or args.out), chart_too=not args.set.startswith("gpu-")))
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    from bert_recipes.cli import quick_exit   # without the interpreter's teardown (about 1 s)
    quick_exit(main())
