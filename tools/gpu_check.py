"""Run every row of the backend matrix for a few steps on the GPUs present and print a table:
backend, processes, steps/s, tokens/s, peak memory per GPU, first and last loss.

    python tools/gpu_check.py                     # all rows, all visible GPUs, BERT-base at seq 128
    python tools/gpu_check.py --rows ddp,zero2 --steps 30 --out gpu_check.md
    python tools/gpu_check.py --cpu --rows ddp,zero2 --size tiny   # the same table on 2 CPU processes

The rows and their launch configs come from accelerate_configs/backends.tsv (the Makefile and the
tests read the same table). Data is the embedded sample, so the check needs no network.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bert_recipes.backends.plan import backend_rows, chosen_rows  # noqa: E402
from bert_recipes.config import ConfigError  # noqa: E402
SIZES = {   # model overrides; the recipe is tiny-mlm (embedded sample) resized
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def rows() -> list:
    """The rows of accelerate_configs/backends.tsv (bert_recipes.backends.plan.BackendRow)."""
    return list(backend_rows().values())


def launch_train(row, args, nproc: int, out_dir: Path, overrides: list[str], log_path: Path) -> tuple[bool, str]:
    """train.py under one row of the matrix on the devices present (or, with --cpu, the table's CPU
    launch): the recipe tiny-mlm resized to --size, the given overrides last. -> (exit code 0?, output)"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    config = row.config
    if args.cpu:   # the CPU launch rule of the table: its variables and its config
        env, config = row.cpu_launch_env(env), row.cpu_config
    base = [f"--run.output_dir={out_dir}", "--logging.progress_bar=false", "--logging.trackers=[]",
            "--logging.plot=false", f"--train.mixed_precision={args.precision}",
            f"--data.max_seq_length={args.seq}", f"--model.max_position_embeddings={max(512, args.seq)}",
            f"--train.micro_batch_size={args.micro}", f"--train.global_batch_size={args.micro * nproc}"]
    base += [f"--model.{k}={v}" for k, v in SIZES[args.size].items()]
    if getattr(args, "sample_dir", None):
        base.append(f"--data.sample_dir={args.sample_dir}")
    if getattr(args, "tokenizer", None):   # every row after the first: the same vocabulary, no retraining
        base.append(f"--tokenizer.name_or_path={args.tokenizer}")
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(REPO / config),
           "--num_processes", str(nproc)]
    if row.plan.num_machines > 1:   # one node here: the same config as a single machine
        cmd += ["--num_machines", "1", "--machine_rank", "0"]
    cmd += ["train.py", "--recipe", "recipes/tiny-mlm.yaml"] + base + overrides
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:   # cut: what it printed so far is the record
        text = "".join(x.decode() if isinstance(x, bytes) else x for x in (err.stdout or "", err.stderr or ""))
        log_path.write_text(text)
        return False, text + f"\ncut at its limit of {args.timeout} s (--timeout)"
    log_path.write_text(proc.stdout + proc.stderr)
    if proc.returncode == 0 and not getattr(args, "tokenizer", None):
        args.tokenizer = str(out_dir / "tokenizer")
    return proc.returncode == 0, proc.stdout + proc.stderr


def failure(log: str) -> str:
    last = [line for line in log.splitlines() if line.strip()][-1:]
    return f"FAILED ({last[0][:80] if last else 'no output'})"


def run_row(row, args, nproc: int, work: Path) -> dict:
    out_dir = work / row.name
    t0 = time.perf_counter()
    ok, log = launch_train(row, args, nproc, out_dir, [
        f"--train.max_steps={args.steps}", f"--logging.log_every={max(1, args.steps // 2)}", "--train.eval_every=null",
        "--checkpoint.save_every=null", "--checkpoint.export=false"], work / f"{row.name}.log")
    if not ok:
        return {"backend": row.name, "status": failure(log)}
    m = json.loads((out_dir / "metrics.json").read_text())
    final, train = m["final"], m["history"]["train"]
    last = train[-1]
    peak = final.get("peak_memory_gb_per_rank")
    return {"backend": row.name, "status": "ok", "processes": final["num_processes"],
            "steps_per_s": 1.0 / last["step_time_s"], "tokens_per_s": last.get("padded_tokens_per_sec", float("nan")),
            "peak_gb": "/".join(f"{p:.1f}" for p in peak) if peak else "n/a (CPU)",
            "predicted_gb": final.get("predicted_peak_memory_gb") or float("nan"),
            "first_loss": train[0]["loss"], "last_loss": last["loss"], "wall_s": time.perf_counter() - t0}


def report(text: str, out: str | None, results: list[dict], final: bool = True) -> None:
    """Print the table and also write it to `out`; at the end (final), exit 1 if any row failed (not
    skipped, not ok). Called after every row too (final=False), so a time limit keeps the rows done."""
    if out:
        Path(out).write_text(text + "\n")
    if not final:
        return
    print(text)
    if any(not (r["status"] == "ok" or r["status"].startswith("skipped")) for r in results):
        sys.exit(1)


def table(results: list[dict]) -> str:
    head = ("| backend | processes | steps/s | tokens/s | peak GB per rank | predicted GB (planner) "
            "| loss first -> last | status |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['backend']} | | | | | | | {r['status']} |")
            continue
        lines.append(f"| {r['backend']} | {r['processes']} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_gb']} | {r['predicted_gb']:.1f} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | ok |")
    return "\n".join(lines)


def add_run_arguments(parser, work: str, cpu_help: str) -> None:
    """The arguments run_row reads (shared with tools/scaling.py)."""
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--precision", default=None, help="default: bf16 on GPU, no on CPU")
    parser.add_argument("--cpu", action="store_true", help=cpu_help)
    parser.add_argument("--work", default=work)
    parser.add_argument("--sample-dir", help="the embedded sample's directory (default: the recipe's, data/sample; "
                                             "built there when missing)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a launch may take")
    parser.add_argument("--tokenizer", help="a tokenizer directory for every row (default: the first row trains one "
                                            "on the sample, the others reuse it)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated rows of accelerate_configs/backends.tsv (default: all)")
    add_run_arguments(parser, work="runs/gpu_check", cpu_help="run on 2 CPU processes (GPU-only rows of backends.tsv are skipped)")
    parser.add_argument("--nproc", type=int, help="default: all GPUs (2 with --cpu)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args()
    import torch
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no GPU visible: run on a GPU machine, or use --cpu to try the table on CPU processes")
    args.precision = args.precision or ("no" if args.cpu else "bf16")
    nproc = args.nproc or (2 if args.cpu else torch.cuda.device_count())
    try:
        chosen = chosen_rows(args.rows)   # an unknown name: one line, never skipped in silence
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    work = REPO / args.work
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for row in chosen:
        plan = row.plan
        if args.cpu and row.gpu_only:   # accelerate_configs/backends.tsv says so
            results.append({"backend": row.name, "status": "skipped: a GPU-only row (backends.tsv)"})
            continue
        if plan.offload == "nvme":
            results.append({"backend": row.name, "status": f"skipped: set nvme_path in {plan.ds_config_path}"})
            continue
        stages = plan.ds_config.get("pipeline", {}).get("stages", 2) if plan.pipeline else 1
        if nproc % stages:
            results.append({"backend": row.name, "status": f"skipped: {stages} stages need a multiple of {stages} processes"})
            continue
        print(f"[gpu-check] {row.name} on {nproc} processes ...", flush=True)
        results.append(run_row(row, args, nproc, work))
    device = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    text = (f"gpu-check: BERT-{args.size}, seq {args.seq}, micro batch {args.micro}, {args.precision}, "
            f"{args.steps} steps, {nproc} x {device}\n\n" + table(results))
    report(text, args.out, results)


if __name__ == "__main__":
    main()
