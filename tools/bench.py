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

The parts, by role: the rows (tools/bench_rows.py), train.py's runs and the workloads (tools/bench_runs.py), the
Trainer's side (tools/bench_trainer.py), the report (tools/bench_report.py: summary, tables, chart) and the checks
beside the speed (tools/bench_checks.py); this file runs them in order.
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
sys.path.insert(0, str(REPO / "tools"))

from bench_checks import accuracy_check, collate_cost, fetch_cost, quality_check  # noqa: E402
from bench_report import summarize, write_outputs  # noqa: E402
from bench_rows import AUTO_GLOBAL, MODEL_KEYS, SIZES, WINDOW, offload_row, row_nproc, variants  # noqa: E402
from bench_runs import prepare_workloads, profile_ours, run_ours  # noqa: E402
from bench_trainer import run_trainers  # noqa: E402

from bert_recipes.config import ConfigError  # noqa: E402


PROBE = """
import json, sys, torch
from bert_recipes.throughput import measured_matmul_peak, peak_flops
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
        from bert_recipes.throughput import measured_cpu_peak
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
    precisions = args.precisions.split(",") if not args.set.startswith("gpu-") else ["bf16"]
    rows = select(variants(precisions, offload_row(args.offload), args.set, size), args)
    data = prepare_workloads(size, Path(args.data_dir) if args.data_dir else out / f"data-{args.size}",
                             Path(args.sample_dir), needed={"classify"} | {r["workload"] for r in rows})
    vocab = len(json.loads((data["mlm"] / "tokenizer/tokenizer.json").read_text())["model"]["vocab"])
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

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="mini")
    parser.add_argument("--precisions", default="no,bf16", help="comma-separated: no, bf16 (and fp16 on GPUs)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", help="comma-separated words: run only the rows whose name contains one")
    parser.add_argument("--rows", help="|-separated row names: run only these rows")
    parser.add_argument("--set", choices=["all", "gpu-must", "gpu-rest", "gpu-docs", "gpu-modern"], default="all",
                        help="gpu-must / gpu-rest: the GPU session's two parts (bf16; tools/gpu_session.py)")
    parser.add_argument("--classify-steps", type=int, help="fine-tuning steps per run (default: one epoch)")
    parser.add_argument("--warmup", type=int, default=WINDOW, help=f"untimed steps, a multiple of {WINDOW}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offload", nargs="?", const="", metavar="ROW",
                        help="also ZeRO offload: DeepSpeed CPU Adam vs torch AdamW, under ROW (a row of "
                             "accelerate_configs/backends.tsv that offloads the optimizer to the host; default: the "
                             "table's first ZeRO-2 CPU-offload row)")
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
    if args.warmup % WINDOW or args.steps <= args.warmup:
        parser.error(f"--warmup must be a multiple of {WINDOW} (train.py's log window) and below --steps")
    try:
        offload_row(args.offload)   # a row that is no row, or does not offload: one line, before anything runs
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
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
