"""make bench's runs of train.py: the workloads prepared once (tools/prepare.py: a token store, prepared data), one run of train.py as a user runs
it (python train.py, or accelerate launch under a row of the backend table), watched with a time limit, and its
figures read back from its own log windows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_rows import LR, MODEL_KEYS, SEED, SIZES, WINDOW  # noqa: E402,F401


# The workloads beside the packed MLM corpus: (recipe, its settings), each with the MLM corpus's tokenizer. A
# packed one reads the corpus's token store, its settings applied as it reads; the others are prepared on their own.
MORE_WORKLOADS = {"classify": ("tiny-classify.yaml", ["model.name_or_path=null"]),
                  "mlm-docs": ("tiny-mlm.yaml", ["data.document_mask=true"]),       # documents apart in a packed row
                  "mlm-unpacked": ("tiny-mlm.yaml", ["data.packing=false"])}        # a document a row, padded
STORED = ("mlm", "mlm-docs")   # the workloads that read the token store


def workload_settings(workload: str) -> list[str]:
    """The data settings of a workload, which a run on it repeats (prepared data checks them)."""
    return MORE_WORKLOADS[workload][1] if workload in MORE_WORKLOADS and workload != "classify" else []


def prepare_workloads(size: dict, root: Path, sample_dir: Path, needed=("mlm", "classify")) -> dict[str, Path]:
    """The MLM corpus (the sample's pretraining text) as a token store (tools/prepare.py --store), with a WordPiece
    tokenizer of the size's vocabulary trained on it, which the packed workloads read; and, where rows need them
    (`needed`), the classification task and the corpus a document a row, tokenized once with that tokenizer."""
    from prepare import prepare, prepare_store

    from bert_recipes.config import load_config, validate
    from bert_recipes.data.sample import build_sample
    build_sample(sample_dir)
    out = {name: root / ("mlm" if name in STORED else name) for name in ("mlm", *MORE_WORKLOADS)}
    common = [f"data.max_seq_length={size['seq']}", f"data.sample_dir={sample_dir}", f"data.cache_dir={root / 'cache'}",
              f"model.max_position_embeddings={max(512, size['seq'])}"]
    if not (out["mlm"] / "store.json").exists():
        tokenizer = workload_tokenizer(root / "tokenizer", size["vocab"], sample_dir)
        cfg = load_config(REPO / "recipes/tiny-mlm.yaml", common + [
            "data.source=files", f"data.train_files=[{sample_dir / 'pretrain/train.txt'}]",
            f"tokenizer.name_or_path={tokenizer}"])
        validate(cfg)
        prepare_store(cfg, out["mlm"], workers=1)
    for name, (recipe, settings) in MORE_WORKLOADS.items():
        if name in needed and name not in STORED and not (out[name] / "prepared.json").exists():
            cfg = load_config(REPO / "recipes" / recipe, common + settings + [
                f"tokenizer.name_or_path={out['mlm'] / 'tokenizer'}"])
            validate(cfg)
            prepare(cfg, out[name])
    return out


def workload_tokenizer(where: Path, vocab: int, sample_dir: Path) -> Path:
    """A WordPiece tokenizer of `vocab` ids trained on the sample's pretraining text (as tiny-mlm trains its own)."""
    if not (where / "tokenizer.json").exists():
        from bert_recipes.data.tokenizer import train_wordpiece
        lines = [line for line in (sample_dir / "pretrain/train.txt").read_text().splitlines() if line.strip()]
        train_wordpiece((lines[i:i + 1000] for i in range(0, len(lines), 1000)), vocab, True).save_pretrained(where)
    return where

def ours_command(spec: dict) -> tuple[list[str], dict]:
    """train.py as a user runs it on the prepared data (python train.py, or accelerate launch for a
    backend row), logging every WINDOW steps, with no final checkpoint, evaluation or export."""
    size, data = SIZES[spec["size"]], Path(spec["data"][spec["workload"]])
    recipe = "tiny-mlm.yaml" if spec["workload"].startswith("mlm") else "tiny-classify.yaml"
    overrides = [f"--run.output_dir={spec['dir']}", "--run.overwrite=true", f"--run.seed={SEED}",
                 *([f"--data.source=store", f"--data.store_dir={data}"] if spec["workload"] in STORED else
                   ["--data.source=prepared", f"--data.prepared_dir={data}"]), f"--data.max_seq_length={size['seq']}",
                 f"--model.max_position_embeddings={max(512, size['seq'])}", f"--train.max_steps={spec['steps']}",
                 f"--train.global_batch_size={size['batch'] * spec.get('nproc', 1)}",
                 f"--train.micro_batch_size={size['batch']}", "--train.eval_every=null", "--train.eval_final=false",
                 f"--optim.lr={LR}", "--optim.warmup_steps=0", f"--train.mixed_precision={spec['precision']}",
                 f"--logging.log_every={WINDOW}", "--logging.trackers=[]", "--logging.plot=false",
                 "--logging.progress_bar=false", "--checkpoint.export=false", "--checkpoint.save_every=null",
                 "--checkpoint.save_final=false"]
    overrides += [f"--model.{k}={size[k]}" for k in MODEL_KEYS]
    if spec["workload"] != "mlm":   # the settings it was prepared with (tools/prepare.py checks them)
        overrides += ["--model.name_or_path=null", f"--tokenizer.name_or_path={Path(spec['data']['mlm']) / 'tokenizer'}"]
        overrides += [f"--{setting}" for setting in workload_settings(spec["workload"])]
    else:
        overrides.append(f"--tokenizer.vocab_size={size['vocab']}")
    if spec.get("compile_backend") and "train.compile=true" in spec.get("extra", []):
        overrides.append(f"--train.compile_backend={spec['compile_backend']}")
    overrides += [f"--{e}" for e in spec.get("extra", [])]
    script = [str(REPO / "train.py"), "--recipe", str(REPO / "recipes" / recipe)]
    if not spec.get("backend"):   # one process: python train.py, as a user runs it
        return [sys.executable] + script + overrides, dict(os.environ)
    import torch

    from bert_recipes.backends.plan import chosen_rows
    row_, cuda = chosen_rows(spec["backend"], "a bench row's backend")[0], torch.cuda.is_available()   # as make <row> does
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
