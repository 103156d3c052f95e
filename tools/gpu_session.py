"""The GPU session: what a lent GPU is for, in parts that each fit one command on the GPU machine
(at most 300 s, start-ups included) and return their results however they end.

    bash tools/gpu_session.sh must           # part 1, the must-have: bench at the automatic micro batch, host waits
    bash tools/gpu_session.sh rest           # part 2: fine-tuning step times, gpu-smoke, the fixed-micro trio
    bash tools/gpu_session.sh docs           # part 3, when time remains: documents apart at 128 and 1,024 tokens
    bash tools/gpu_session.sh --rehearse all # all three, the same steps at tiny size on CPU processes (the suite runs it)
    python tools/gpu_session.py prepare      # on a CPU machine, once: BERT-base's prepared data into .gpu_data/

must: the versions in effect; make bench's gpu-must rows (train.py at train.micro_batch_size=auto, eager
and compiled, against the Trainer, eager and compiled, at the same micro batch; the memory planner's
prediction against the measured peak; a profile of the eager row's warmup steps); then 12 steps of
BERT-base with logging.sync_audit, whose windows between log steps count torch's sync warnings
(set_sync_debug_mode("warn"), every warning shown). rest: the versions; a bf16 fine-tuning row with
per-step times; gpu-smoke's session matrix (DDP bf16 and fp16, FSDP2 bf16: eval, checkpoint, resume,
export); the fixed-micro-32 trio (train.py, train.py doing the Trainer's work, the Trainer). docs: packed rows
with their documents apart through varlen against the block mask, a document a row padded against unpadded
(varlen), at 128 and 1,024 tokens (bench-base.md, bench-base-1k.md and their .json).

Every step has a limit: launches x LAUNCH_S (what one process costs to start and stop once the final
evaluation, checkpoint and export are dropped) plus its own work. The plan is printed with its sum and
refused when a part's sum exceeds PART_S. Scratch (checkpoints, caches, prepared data) goes to a
temporary directory; OUT gets at most 8 files and no folder, each written as its step ends:
session.md (versions, the plan, every figure and every failure line), session.json (the same as
data), bench.jsonl, bench.md, profile.md, sync_debug.log, doctor.json (must: make doctor's verdicts
and NVML readings under its burn), smoke.md (rest).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

PART_S = 300          # one part, one command on the GPU machine (which allows 600): two parts and a start fit 15 min
LAUNCH_S = 20         # one launch on the H200, no final eval/checkpoint/export: an estimate (40 s with them,
                      # 2026-11-30, incl. 6 steps, a 1.3 GB checkpoint and the export); each session measures it
CARRIED = REPO / ".gpu_data"   # BERT-base's prepared workloads (python tools/gpu_session.py prepare), carried along
PREP_S = 40           # preparing them on the GPU machine instead (not measured there: a guess from this CPU's time)
MODULES = ("torch", "transformers", "accelerate", "datasets", "evaluate", "deepspeed", "tokenizers", "safetensors",
           "pyarrow", "yaml", "psutil", "numpy")
OPTIONAL = ("pynvml",)   # nvidia-ml-py, for the node doctor: reported, not required
GOALS = {"sequences/s at the automatic micro batch (BERT-base, 128, bf16)": (">=", 4600),
         "train.py / eager Trainer, same micro batch": (">=", 2.0),
         "data-wait at the automatic micro batch": ("<=", 0.02),
         "fine-tuning step max / median after warmup": ("<=", 2.0),
         "sync warnings per window between log steps": ("<=", 0),
         "planner's peak / measured peak at the automatic micro batch": ("within", 0.10)}


@dataclass
class Step:
    name: str
    launches: int           # processes it starts
    work_s: int             # on top of their start-up: training steps, compiles, data preparation
    run: object             # Session -> None (figures go to session.figures)
    rows: list = field(default_factory=list)   # the bench rows it runs (their limits make its own)
    size: str | None = None  # the bench's size for this step (None: the session's)
    rehearsed: bool = True   # False: the rehearsal skips it (the same rows as a step before it, at the same tiny size)

    @property
    def limit_s(self) -> int:
        return self.launches * LAUNCH_S + self.work_s


class Session:
    """One part: its steps, its scratch, what it found; session.md / session.json rewritten after each step."""

    def __init__(self, part: str, out: Path, rehearse: bool, scratch: Path, shared: Path):
        self.part, self.out, self.rehearse, self.scratch = part, out, rehearse, scratch
        self.shared = shared   # what both parts of one call use: the sample, prepared data not carried
        self.size = "tiny" if rehearse else "base"
        self.scale = 6 if rehearse else 1   # a CPU rehearsal's limits: a slow CI host must not cut it
        self.results: list[dict] = []
        self.figures: dict = {}
        self.versions: dict = {}

    def python(self) -> str:
        return sys.executable

    def run(self, step: Step) -> None:
        print(f"[gpu-session] {self.part}: {step.name} (limit {step.limit_s} s) ...", flush=True)
        t0 = time.time()
        try:
            if self.rehearse and not step.rehearsed:
                status = "skipped in the rehearsal (the step before ran the same rows at tiny size)"
            else:
                step.run(self, step)
                status = "ok"
        except StepFailed as err:
            status = f"FAILED: {err}"
        self.results.append({"step": step.name, "limit_s": step.limit_s, "seconds": round(time.time() - t0, 1),
                             "status": status})
        self.write()

    def call(self, cmd: list[str], limit_s: int, log: Path | None = None, env: dict | None = None) -> str:
        """Run a command under its limit (times the rehearsal's scale); its output to `log` as it comes.
        -> the output; raises StepFailed with its last line on a failure or a cut."""
        log = log or self.scratch / f"step-{len(self.results)}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
            try:
                code = proc.wait(timeout=limit_s * self.scale)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                code = None
        text = log.read_text()
        last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")[:200]
        if code is None:
            raise StepFailed(f"cut at its limit of {limit_s * self.scale} s; last line: {last}")
        if code:
            raise StepFailed(f"exit code {code}; last line: {last}")
        return text

    def write(self) -> None:
        (self.out / "session.json").write_text(json.dumps(
            {"part": self.part, "rehearsal": self.rehearse, "date": time.strftime("%Y-%m-%d %H:%M"),
             "versions": self.versions, "plan": plan_rows(self.part, self.size), "limit_sum_s": limit_sum(self.part),
             "steps": self.results, "figures": self.figures, "goals": goals_met(self.figures, self.rehearse)},
            indent=1, default=str))
        (self.out / "session.md").write_text(render(self) + "\n")


class StepFailed(RuntimeError):
    """A step that failed or was cut: its one line goes into session.md; the next step runs."""


# ----------------------------------------------------------------------------- the steps
def versions(session: Session, step: Step) -> None:
    """Import every module the steps need, so that a missing one fails in seconds; record the versions in
    effect (the GPU image's, or the carried wheels'), the GPU and its state."""
    probe = ("import importlib, json\nout = {}\nfor name in %r:\n    m = importlib.import_module(name)\n"
             "    out[name] = getattr(m, '__version__', 'present')\nfor name in %r:\n    try:\n"
             "        m = importlib.import_module(name)\n        out[name] = getattr(m, '__version__', 'present')\n"
             "    except ImportError:\n        out[name] = 'absent'\nimport torch\nout['cuda'] = torch.version.cuda\n"
             "print(json.dumps(out))" % (MODULES, OPTIONAL))
    text = session.call([session.python(), "-c", probe], step.limit_s)
    session.versions = json.loads(text.strip().splitlines()[-1])
    session.versions["python"] = sys.version.split()[0]
    if shutil.which("nvidia-smi") and not session.rehearse:
        query = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,pcie.link.gen.current,pcie.link.width.current"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        session.versions["gpu"] = smi.stdout.strip() or smi.stderr.strip()[:200]


DOCTOR_S = 15   # the node doctor: torch and NVML up, a 5 s bf16 burn on the GPU, the readings


def doctor(session: Session, step: Step) -> None:
    """make doctor with its burn (tools/doctor.py --json): every verdict and the NVML readings into OUT's
    doctor.json (on CPU processes: the one no-GPU line and the host). A failing check is a finding, not a
    failed step: its lines go to the session's figures."""
    cmd = [session.python(), "tools/doctor.py", "--json", "--burn", "0" if session.rehearse else "5"]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=step.limit_s * session.scale)
    except subprocess.TimeoutExpired:
        raise StepFailed(f"the node doctor ran past {step.limit_s * session.scale} s")
    if done.returncode not in (0, 1):
        raise StepFailed("the node doctor: " + (done.stderr.strip().splitlines() or ["no output"])[-1])
    result = json.loads(done.stdout)
    (session.out / "doctor.json").write_text(json.dumps(result, indent=1) + "\n")
    session.figures["doctor"] = {"exit_code": result["exit_code"],
                                 "not_ok": [f"{c['status']} {c['name']}: {c['measured']}" for c in result["checks"]
                                            if c["status"] != "ok"]}


def bench(session: Session, step: Step) -> None:
    """make bench's rows of this part (tools/bench.py --set gpu-<part>), results straight into OUT; a step at a size of
    its own (the documents part's two sequence lengths) writes bench-<size>.md and .json instead."""
    steps = "20" if session.rehearse else "30"   # the rehearsal: one timed window after the warmup (the flow, not a figure)
    size = session.size if session.rehearse else (step.size or session.size)
    results = session.out if step.size is None else session.scratch / f"results-{size}"
    results.mkdir(parents=True, exist_ok=True)
    cmd = [session.python(), "tools/bench.py", "--size", size, "--set", f"gpu-{session.part}", "--repeats", "1",
           "--steps", steps, "--warmup", "10", "--classify-steps", steps, "--out", str(session.scratch / "bench"),
           "--results", str(results), "--append", "--limit-scale", str(session.scale),
           "--data-dir", str(workload_dir(session, size)), "--sample-dir", str(session.shared / "sample"),
           "--quality-seeds", "0"]   # make bench's quality check (6+ runs) is not this session's: it would eat the part
    if session.rehearse:
        cmd += ["--compile-backend", "eager", "--collate-repeats", "10"]
    limit = step.limit_s
    if not (workload_dir(session, size) / "mlm/store.json").exists():
        if not session.rehearse:   # not carried: BERT-base's data is prepared here first
            limit += PREP_S
            session.figures["note"] = (f"the prepared data was not carried (python tools/gpu_session.py prepare): "
                                       f"+{PREP_S} s to prepare it here")
        from bert_recipes.data.sample import build_sample
        build_sample(session.shared / "sample")
    try:
        session.call(cmd, limit, session.scratch / f"bench-{size}.log")
    finally:   # whatever finished is in bench.json
        found = results / "bench.json"
        if found.exists():
            figures = bench_figures(json.loads(found.read_text()))
            if step.size is None:
                session.figures.update(figures)
            else:   # the documents part: each size's figures apart, its tables beside session.md
                session.figures.setdefault("by_size", {})[size] = figures
                for suffix in ("md", "json"):
                    shutil.copy(results / f"bench.{suffix}", session.out / f"bench-{size}.{suffix}")


def workload_dir(session: Session, size: str | None = None) -> Path:
    """The prepared workloads: carried (.gpu_data, prepared on a CPU machine), else made in scratch."""
    size = size or session.size
    carried = CARRIED / f"data-{size}"
    return carried if (carried / "mlm/store.json").exists() else session.shared / f"data-{size}"


def sync_debug(session: Session, step: Step) -> None:
    """12 steps with logging.sync_audit (log every 4): per window, the host waits the audit counts and,
    on a GPU, torch's sync warnings. On CPU processes (the rehearsal): 2 ranks under DDP."""
    data = workload_dir(session)
    size = {"tiny": (64, 2, 2, 256, 16), "base": (768, 12, 12, 3072, 32)}[session.size]
    args = ["--recipe", "recipes/tiny-mlm.yaml", f"--run.output_dir={session.scratch / 'sync'}", "--run.overwrite=true",
            "--data.source=store", f"--data.store_dir={data / 'mlm'}", "--data.max_seq_length=" +
            ("64" if session.size == "tiny" else "128"), "--model.max_position_embeddings=512",
            f"--model.hidden_size={size[0]}", f"--model.num_hidden_layers={size[1]}",
            f"--model.num_attention_heads={size[2]}", f"--model.intermediate_size={size[3]}",
            f"--train.micro_batch_size={size[4]}", f"--train.global_batch_size={size[4] * (2 if session.rehearse else 1)}",
            "--tokenizer.vocab_size=" + ("1000" if session.size == "tiny" else "30522"),
            "--train.mixed_precision=" + ("no" if session.rehearse else "bf16"), "--train.max_steps=12",
            "--logging.log_every=4", "--logging.sync_audit=true", "--train.eval_every=null", "--train.eval_final=false",
            "--checkpoint.save_every=null", "--checkpoint.save_final=false", "--checkpoint.export=false",
            "--logging.progress_bar=false", "--logging.trackers=[]", "--logging.plot=false"]
    if session.rehearse:
        accelerate = str(Path(session.python()).parent / "accelerate")
        cmd = [accelerate, "launch", "--config_file", "accelerate_configs/cpu.yaml", "--num_processes", "2",
               "train.py"] + args
        env = {"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    else:
        cmd, env = [session.python(), "train.py"] + args, {}
    session.call(cmd, step.limit_s, session.out / "sync_debug.log", env)
    metrics = json.loads((session.scratch / "sync/metrics.json").read_text())
    rows = metrics["history"]["train"]
    session.figures["sync"] = {"processes": metrics["final"]["num_processes"],
                               "host_waits_per_window": [r.get("host_syncs") for r in rows],
                               "sync_warnings_per_window": [r.get("sync_warnings", "not measured (CPU)") for r in rows],
                               "sites": metrics["final"].get("sync_audit", {})}


def smoke(session: Session, step: Step) -> None:
    """gpu-smoke's session matrix: DDP bf16 and fp16, FSDP2 bf16 (on CPU processes: fp16 and FSDP2 are
    reported as GPU-only), each halted after an eval and a checkpoint, resumed, exported."""
    # a launch may take twice its share (the step's own limit still holds): the first one also tokenizes the sample
    cmd = [session.python(), "tools/gpu_smoke.py", "--matrix", "session", "--out", str(session.out / "smoke.md"),
           "--work", str(session.scratch / "smoke"), "--sample-dir", str(session.shared / "sample"),
           "--timeout", str(2 * (LAUNCH_S + SMOKE_WORK_S) * session.scale)]
    cmd += (["--cpu", "--size", "tiny", "--seq", "32", "--micro", "4", "--steps", "4"] if session.rehearse
            else ["--size", "base", "--steps", "4", "--tokenizer", str(workload_dir(session) / "mlm/tokenizer")])
    try:
        session.call(cmd, step.limit_s, session.scratch / "smoke.log")
    finally:
        table = session.out / "smoke.md"
        if table.exists():
            session.figures["smoke"] = [line for line in table.read_text().splitlines()
                                        if line.startswith("| ") and not line.startswith("| row /")]


SMOKE_WORK_S = 6   # a smoke launch's own work: 2-4 steps, an eval, a 1.3 GB checkpoint (or the resume), the export


def parts() -> dict[str, list[Step]]:
    """The two parts, in order. The bench steps' limits are their rows' (tools/bench.py gpu_rows) plus the
    matmul probe's launch and the check of the carried data."""
    from bench_rows import docs_rows, gpu_rows, modern_rows
    must, rest, docs = gpu_rows("gpu-must", True, {}), gpu_rows("gpu-rest", True, {}), docs_rows(True)
    modern = modern_rows(True)
    # +5: reading the carried data; without it (no .gpu_data) preparing it here takes PREP_S more
    bench_work = lambda rows: sum(r["limit_s"] for r in rows) + 5   # noqa: E731
    return {"must": [Step("versions, imports, GPU", 0, 15, versions),
                     Step("the node doctor (its own step: a failed check is a finding, never a failed step)", 0,
                          DOCTOR_S, doctor),
                     Step("bench: auto micro batch, eager and compiled, against the Trainer", 1, bench_work(must), bench,
                          must),
                     Step("host waits: 12 steps with logging.sync_audit and torch's sync debug mode", 1, 15, sync_debug)],
            "rest": [Step("versions, imports, GPU", 0, 15, versions),
                     Step("bench: fine-tuning step times; the fixed-micro trio", 1, bench_work(rest), bench, rest),
                     Step("gpu-smoke: DDP bf16 and fp16, FSDP2 bf16", 6, 6 * SMOKE_WORK_S, smoke)],
            # documents apart (data.document_mask, data.unpad): varlen against the block mask against padding; the
            # part to run when time remains after must and rest
            "docs": [Step("versions, imports, GPU", 0, 15, versions),
                     Step("bench at 128 tokens: varlen, the block mask, padded, unpadded", 1, bench_work(docs), bench,
                          docs, size="base"),
                     Step("bench at 1,024 tokens: the same rows", 1, bench_work(docs), bench, docs, size="base-1k",
                          rehearsed=False)],
            # ModernBERT-base as recipes/modernbert-base-mlm.yaml trains it, at 1,024 tokens, beside BERT-base
            "modern": [Step("versions, imports, GPU", 0, 15, versions),
                       Step("bench at 1,024 tokens: ModernBERT-base (StableAdamW, documents apart) and BERT-base", 1,
                            bench_work(modern), bench, modern, size="base-1k")]}


def plan_rows(part: str, size: str) -> list[dict]:
    return [{"step": s.name, "launches": s.launches, "limit_s": s.limit_s,
             "rows": [{"row": r["name"], "limit_s": r["limit_s"]} for r in s.rows]} for s in parts()[part]]


def limit_sum(part: str) -> int:
    return sum(s.limit_s for s in parts()[part])


# ----------------------------------------------------------------------------- the figures
def bench_figures(result: dict) -> dict:
    """What the goals read, from bench.json: each row's figures, the ratios, the planner's check."""
    rows = {r["name"]: r for r in result["rows"] if "cut" not in r}
    out = {"bench_rows": {name: {k: r.get(k) for k in (
        "micro_batch", "tokens_per_s", "sequences_per_s", "mfu_anchors", "mfu_ours", "data_wait", "peak_memory_mb",
        "predicted_peak_mb", "padding", "shapes", "launch_s", "step_ms_median", "step_ms_max", "step_max_over_median")}
        for name, r in rows.items()}, "bench_cut": [r["name"] for r in result["rows"] if "cut" in r],
        "ratios": {r["what"]: round(r["sequences_ratio"], 3) for r in result["ratios"]}, "device": result["device"]}
    eager, compiled = rows.get("mlm: train.py, auto micro batch"), rows.get("mlm: train.py + compile, auto micro batch")
    trainer = rows.get("mlm: Trainer, same micro batch")
    if eager and trainer:
        best = max((r for r in (eager, compiled) if r), key=lambda r: r["sequences_per_s"])
        out["auto"] = {"best": best["name"], "sequences_per_s": best["sequences_per_s"], "data_wait": best["data_wait"],
                       "over_eager_trainer": best["sequences_per_s"] / trainer["sequences_per_s"],
                       # on a GPU, torch.cuda.max_memory_allocated; a CPU's resident memory is not the planner's figure
                       "planner_over_measured": (eager["predicted_peak_mb"] / eager["peak_memory_mb"]
                                                 if eager.get("predicted_peak_mb") and not result["device"].startswith("CPU")
                                                 else None)}
    tuned = rows.get("classify: train.py, step times")
    if tuned:
        out["finetune_step_max_over_median"] = tuned["step_max_over_median"]
    launches = [r["launch_s"] for r in rows.values() if r.get("launch_s")]
    if launches:
        out["launch_s_median"] = statistics.median(launches)
    return out


def goals_met(figures: dict, rehearse: bool = False) -> dict:
    """Each goal: measured, or "not measured" (a part that did not run it, a CPU rehearsal's GPU-only one).
    A rehearsal's figures are a CPU's at tiny size: shown, never judged against the H200's goals."""
    auto, sync = figures.get("auto") or {}, figures.get("sync") or {}
    warnings = [w for w in sync.get("sync_warnings_per_window", []) if isinstance(w, int)]
    measured = dict(zip(GOALS, (auto.get("sequences_per_s"), auto.get("over_eager_trainer"), auto.get("data_wait"),
                                figures.get("finetune_step_max_over_median"), max(warnings) if warnings else None,
                                auto.get("planner_over_measured"))))
    out = {}
    for name, (how, goal) in GOALS.items():
        value = measured[name]
        if value is None:
            out[name] = {"goal": f"{how} {goal}", "measured": "not measured"}
            continue
        if rehearse:
            out[name] = {"goal": f"{how} {goal}", "measured": f"{round(value, 4)} (a CPU rehearsal, not judged)"}
            continue
        met = value >= goal if how == ">=" else value <= goal if how == "<=" else abs(value - 1) <= goal
        out[name] = {"goal": f"{how} {goal}", "measured": round(value, 4), "met": met}
    return out


def render(session: Session) -> str:
    lines = [f"# GPU session, part {session.part}" + (" (a CPU rehearsal: tiny size, CPU processes)" if session.rehearse
                                                      else ""), "", f"{time.strftime('%Y-%m-%d %H:%M')}; versions in effect: "
             + ", ".join(f"{k} {v}" for k, v in session.versions.items()), "",
             f"Plan (limits: launches x {LAUNCH_S} s + work; sum {limit_sum(session.part)} s of {PART_S}"
             + (f"; this rehearsal runs them x{session.scale}" if session.rehearse else "") + "):", "",
             "| step | launches | limit s | took s | status |", "|---|---|---|---|---|"]
    done = {r["step"]: r for r in session.results}
    for s in parts()[session.part]:
        r = done.get(s.name, {})
        lines.append(f"| {s.name} | {s.launches} | {s.limit_s} | {r.get('seconds', '')} | {r.get('status', 'not run')} |")
    lines += ["", "| goal (one H200) | goal | measured |", "|---|---|---|"]
    for name, g in goals_met(session.figures, session.rehearse).items():
        lines.append(f"| {name} | {g['goal']} | {g['measured']}" + ("" if "met" not in g else
                                                                       " (met)" if g["met"] else " (NOT met)") + " |")
    lines += ["", "Figures:", "", "```", json.dumps(session.figures, indent=1, default=str), "```"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- prepare (CPU machine)
def prepare_carried(sizes=("base", "base-1k")) -> Path:
    """BERT-base's workloads at 128 and 1,024 tokens, prepared here once (tokenizer and token ids: CPU work), into
    .gpu_data/ for the GPU machine (name it in the run call's carry), so no GPU time goes to tokenizing."""
    from bench_rows import SIZES
    from bench_runs import MORE_WORKLOADS, prepare_workloads
    from bert_recipes.data.sample import build_sample
    sample = CARRIED / "sample"
    build_sample(sample)
    for size in sizes:
        root = CARRIED / f"data-{size}"
        prepare_workloads(SIZES[size], root, sample, needed=tuple(MORE_WORKLOADS))
        shutil.rmtree(root / "cache", ignore_errors=True)   # datasets' cache: not needed to read prepared data or a store
    shutil.rmtree(sample, ignore_errors=True)
    return CARRIED


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["must", "rest", "docs", "modern", "all", "prepare", "plan"])
    parser.add_argument("--rehearse", action="store_true", help="tiny size on CPU processes: the suite's rehearsal")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-session",
                        help="where the files that come back go (default $OUT)")
    args = parser.parse_args(argv)
    if args.part == "prepare":
        print(f"[gpu-session] prepared: {prepare_carried()}")
        return 0
    names = ["must", "rest", "docs", "modern"] if args.part in ("all", "plan") else [args.part]
    for name in names:
        print(f"[gpu-session] {name}: {len(parts()[name])} steps, limits sum {limit_sum(name)} s (of {PART_S})")
        for row_ in plan_rows(name, "base"):
            print(f"  {row_['limit_s']:>4} s  {row_['launches']} launches  {row_['step']}")
        if limit_sum(name) > PART_S:
            print(f"config error: part {name}'s limits sum to {limit_sum(name)} s, over {PART_S} s: shorten its steps",
                  file=sys.stderr)
            return 2
    if args.part == "plan":
        return 0
    import torch
    if not args.rehearse and not torch.cuda.is_available():
        print("config error: no GPU visible: run on the GPU machine, or --rehearse for the CPU rehearsal", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpu-session-") as shared:   # scratch, outside OUT
        for name in names:
            part_out = out / name if len(names) > 1 else out
            part_out.mkdir(parents=True, exist_ok=True)
            scratch = Path(shared) / name
            scratch.mkdir()
            session = Session(name, part_out, args.rehearse, scratch, Path(shared))
            for step in parts()[name]:
                session.run(step)
                if step.run is versions and session.results[-1]["status"] != "ok":
                    break   # a missing module: nothing else can run; say so in seconds, not after every step fails
            failed |= any(not r["status"].startswith(("ok", "skipped")) for r in session.results)
            print((part_out / "session.md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    from bert_recipes.cli import quick_exit   # without the interpreter's teardown (about 1 s)
    quick_exit(main())
