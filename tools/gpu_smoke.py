"""One-GPU smoke test of the paths only a GPU takes: each backend row that fits one GPU, in fp32, bf16
and fp16, through evaluation, a checkpoint, a resume and an export; then a table of peak memory
(the planner's prediction against torch.cuda.max_memory_allocated), tokens/s and MFU. Exits non-zero
when any row fails.

    python tools/gpu_smoke.py                          # make gpu-smoke: BERT-base, seq 128, one GPU
    python tools/gpu_smoke.py --rows ddp,zero3 --precisions bf16 --out gpu_smoke.md
    python tools/gpu_smoke.py --cpu --size tiny        # the same logic on 2 CPU processes (no fp16, no FSDP)

Each row runs twice: to the middle (eval and a checkpoint there), then `--resume auto` to the end, with
the export. A launch costs about 40 s on an H200 (measured 2026-11-30, 5 s of it training). The matrices are
rules over the rows of accelerate_configs/backends.tsv (each row's kind, ZeRO stage and offload, read from its
launch files), so a new row joins them: `default` runs every one-node row but the NVMe-offload ones (they need an
nvme_path) and the pipeline (two GPUs), DDP in fp32, bf16 and fp16 and the rest in bf16 (18 launches with the
shipped rows, about 12 minutes); `full` adds fp32 and fp16 for the ZeRO rows without offload, and the pipeline
in bf16 when two GPUs are present; `session` (tools/gpu_session.py) runs the DDP and FSDP rows. `--rows` takes
any row by name; a name that is no row is one line.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import REPO, add_run_arguments, failure, launch_train, report, rows   # noqa: E402  (same launcher)

from bert_recipes.backends.plan import chosen_rows   # noqa: E402
from bert_recipes.config import ConfigError   # noqa: E402

PRECISIONS = {"ddp": "no,bf16,fp16"}   # each kind's default precisions (the autocast path has the most): else bf16


def precisions_of(row) -> str:
    return PRECISIONS.get(row.plan.kind, "bf16")


def matrix(name: str) -> list[tuple]:
    """(row, precisions) of a matrix, in the table's order: rules over the rows' launch files, never their names."""
    out = []
    for row in rows():
        plan = row.plan
        if row.nodes > 1 or plan.offload == "nvme":
            continue
        if name == "session":   # what changed since the H200 ran the rows (2026-11-30): DDP's device-side skip in
            # bf16 and, folded into the loss scaler's found_inf, in fp16 (never run on CUDA), and FSDP2's
            if plan.kind in ("ddp", "fsdp"):
                out.append((row, "bf16,fp16" if plan.kind == "ddp" else "bf16"))
        elif name == "full":
            zero_on_device = plan.kind == "deepspeed" and plan.offload == "none" and plan.zero_stage >= 2
            out.append((row, "no,bf16,fp16" if zero_on_device else precisions_of(row)))
        elif not plan.pipeline:
            out.append((row, precisions_of(row)))
    return out


MATRICES = ("default", "full", "session")


def smoke(row, precision: str, args, nproc: int, work: Path) -> dict:
    """Halt in the middle after an evaluation and a checkpoint, resume to the end, export; check each."""
    name = f"{row.name}/{precision}"
    out = work / f"{row.name}-{precision}"
    args.precision = precision
    half = max(1, args.steps // 2)
    common = [f"--train.max_steps={args.steps}", "--logging.log_every=1", f"--train.eval_every={half}",
              f"--checkpoint.save_every={half}"]
    ok, log = launch_train(row, args, nproc, out, common + [f"--train.halt_at_step={half}"], work / f"{out.name}.1.log")
    if not ok:
        return {"row": name, "status": "first half " + failure(log)}
    ok, log = launch_train(row, args, nproc, out, common + ["--checkpoint.resume=auto"], work / f"{out.name}.2.log")
    if not ok:
        return {"row": name, "status": "resume " + failure(log)}
    m = json.loads((out / "metrics.json").read_text())
    final, train = m["final"], m["history"]["train"]
    problems = []
    if f"[resume] from {out}/checkpoints/step_{half:08d}" not in log:
        problems.append("did not resume")
    if final.get("steps") != args.steps or not math.isfinite(final.get("eval_loss", float("nan"))):
        problems.append("no final evaluation")
    if not (out / "model/model.safetensors").exists():
        problems.append("no export")
    if [r["step"] for r in m["history"]["eval"]][:1] != [half]:
        problems.append("no evaluation at the checkpoint")
    peak = final.get("peak_memory_gb_per_rank")
    return {"row": name, "status": "ok" if not problems else "FAILED (" + ", ".join(problems) + ")",
            "processes": final["num_processes"], "tokens_per_s": train[-1]["padded_tokens_per_sec"],
            "mfu": train[-1]["mfu"], "peak_gb": max(peak) if peak else None,
            "predicted_gb": final.get("predicted_peak_memory_gb"), "loss": (train[0]["loss"], train[-1]["loss"])}


def table(results: list[dict]) -> str:
    lines = ["| row / precision | processes | tokens/s | MFU | peak GB (max_memory_allocated) | predicted GB "
             "| loss first -> last | status |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "processes" not in r:
            lines.append(f"| {r['row']} | | | | | | | {r['status']} |")
            continue
        peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "n/a (CPU)"
        predicted = f"{r['predicted_gb']:.2f}" if r["predicted_gb"] is not None else "not modelled"
        lines.append(f"| {r['row']} | {r['processes']} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {peak} | "
                     f"{predicted} | {r['loss'][0]:.3f} -> {r['loss'][1]:.3f} | {r['status']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated rows of accelerate_configs/backends.tsv (default: the matrix's)")
    parser.add_argument("--matrix", choices=MATRICES, default="default",
                        help="default: 18 launches with the shipped rows; full: 28; session: 6 (tools/gpu_session.py)")
    parser.add_argument("--precisions", help="comma-separated, of no,bf16,fp16 (default: per row, as above)")
    add_run_arguments(parser, work="runs/gpu_smoke", cpu_help="2 CPU processes instead of a GPU (fp16 and the GPU-only rows of backends.tsv skipped)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.set_defaults(steps=6)
    args = parser.parse_args()
    import torch
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no GPU visible: run on a GPU machine, or use --cpu to try the smoke test on CPU processes")
    gpus = 0 if args.cpu else torch.cuda.device_count()
    try:   # a name that is no row: one line, never skipped in silence
        chosen = [(row, precisions_of(row)) for row in chosen_rows(args.rows)] if args.rows else matrix(args.matrix)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    work = REPO / args.work
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for row, precisions in chosen:
        plan = row.plan
        stages = plan.ds_config.get("pipeline", {}).get("stages", 2) if plan.pipeline else 1
        for precision in (args.precisions or precisions).split(","):
            label = f"{row.name}/{precision}"
            if args.cpu and (precision == "fp16" or row.gpu_only):   # gpu-only: accelerate_configs/backends.tsv
                results.append({"row": label, "status": "skipped: GPU only"})
                report(text_of(args, results), args.out, results, final=False)
                continue
            if not args.cpu and gpus < stages:
                results.append({"row": label, "status": f"skipped: {stages} stages need {stages} GPUs"})
                continue
            nproc = 2 if args.cpu else stages
            print(f"[gpu-smoke] {label} on {nproc} process(es) ...", flush=True)
            results.append(smoke(row, precision, args, nproc, work))
            report(text_of(args, results), args.out, results, final=False)   # each row kept as it finishes
    report(text_of(args, results), args.out, results)


def text_of(args, results: list[dict]) -> str:
    import torch
    device = "2 CPU processes" if args.cpu else torch.cuda.get_device_name(0)
    return (f"gpu-smoke: BERT-{args.size}, seq {args.seq}, micro batch {args.micro}, {args.steps} steps "
            f"(halt, resume, export), {device}\n\n" + table(results))


if __name__ == "__main__":
    main()
