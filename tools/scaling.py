"""Scaling check: the same recipe for a fixed number of steps at 1, 2, 4 ... processes under one
backend, with the micro batch per process fixed (weak scaling: the global batch grows with the
process count, as when adding GPUs). Writes a table and a PNG chart.

    python tools/scaling.py --backend ddp                 # 1, 2, 4, ... up to the GPUs present
    python tools/scaling.py --backend zero2 --counts 1,2,4,8
    python tools/scaling.py --cpu --size tiny             # 1 and 2 CPU processes
    make scaling ARGS="--backend zero2"

efficiency(n) = tokens/s(n) / (n x tokens/s(1)). overhead share(n) = 1 - step_time(1) / step_time(n):
with the same work per process, the extra time per step is communication and synchronisation.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import REPO, add_run_arguments, run_row   # noqa: E402  (same launcher as gpu-check)

from bert_recipes.backends.plan import chosen_rows, first_row   # noqa: E402
from bert_recipes.config import ConfigError   # noqa: E402


def yardsticks(results: list[dict]) -> list[str]:
    """Each count's efficiency against the guides' figure for the link the doctor finds (bert_recipes/doctor)."""
    from bert_recipes.doctor.gpu import gpu_checks, link_of, scaling_verdict
    from bert_recipes.doctor.host import nccl_checks
    from bert_recipes.doctor.nvml import read_gpus
    gpu, _ = read_gpus(0)
    readings = {"gpu": gpu, "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    suspects = [c.line() for c in gpu_checks(readings) + nccl_checks(readings) if c.status != "ok"
                and c.name.split()[0] in ("pcie", "topology", "clocks", "env", "gpu")]
    return ["yardstick: " + scaling_verdict(r["n"], r["efficiency"], link_of(gpu), suspects) for r in results]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="a row of accelerate_configs/backends.tsv (default: its first DDP row)")
    parser.add_argument("--counts", help="process counts, e.g. 1,2,4,8 (default: powers of 2 up to the devices)")
    add_run_arguments(parser, work="runs/scaling", cpu_help="CPU processes (one core each)")
    args = parser.parse_args()
    import torch
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no GPU visible: use --cpu to measure CPU processes")
    args.precision = args.precision or ("no" if args.cpu else "bf16")
    devices = (os.cpu_count() or 1) if args.cpu else torch.cuda.device_count()
    counts = [int(c) for c in args.counts.split(",")] if args.counts else \
        [2 ** k for k in range(8) if 2 ** k <= devices]
    args.backend = args.backend or first_row("ddp")
    try:
        chosen = chosen_rows(args.backend, "--backend")   # a name that is no row: one line
        if len(chosen) != 1:
            raise ConfigError(f"--backend takes one row, got {args.backend}")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    row = chosen[0]
    work = REPO / args.work / args.backend
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for n in counts:
        print(f"[scaling] {args.backend} on {n} process(es) ...", flush=True)
        r = run_row(row, args, n, work / f"n{n}")
        if r["status"] != "ok":
            sys.exit(f"{args.backend} on {n} processes failed: {r['status']} (log in {work / f'n{n}'})")
        results.append({"n": n, **r})
    base = results[0]
    lines = [f"scaling: {args.backend}, BERT-{args.size}, seq {args.seq}, micro {args.micro} per process, "
             f"{args.precision}, {args.steps} steps, {'CPU' if args.cpu else torch.cuda.get_device_name(0)}", "",
             "| processes | steps/s | tokens/s | speedup | efficiency | overhead share (comm + sync) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["efficiency"] = r["speedup"] / (r["n"] / base["n"])
        r["overhead"] = max(0.0, 1 - r["steps_per_s"] / base["steps_per_s"])   # same work per process
        lines.append(f"| {r['n']} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['efficiency']:.0%} | {r['overhead']:.0%} |")
    if not args.cpu:
        lines += ["", *yardsticks(results)]
    text = "\n".join(lines)
    print(text)
    (work / "scaling.md").write_text(text + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    ns = [r["n"] for r in results]
    a1.plot(ns, [r["speedup"] for r in results], "o-", label="measured")
    a1.plot(ns, [n / base["n"] for n in ns], "--", label="ideal")
    a1.set_xlabel("processes"), a1.set_ylabel("tokens/s speedup"), a1.legend(), a1.grid(alpha=0.3)
    a2.bar([str(n) for n in ns], [r["efficiency"] * 100 for r in results])
    a2.set_xlabel("processes"), a2.set_ylabel("scaling efficiency (%)"), a2.grid(alpha=0.3, axis="y")
    fig.suptitle(lines[0])
    fig.tight_layout()
    fig.savefig(work / "scaling.png", dpi=100)
    print(f"table: {work / 'scaling.md'}  chart: {work / 'scaling.png'}")


if __name__ == "__main__":
    main()
