"""The whole GLUE benchmark for one model: fine-tune the nine tasks with recipes/bert-base-glue-*.yaml,
then write the dev-set table with the GLUE average, and the test-set predictions as GLUE's submission
files.

    python tools/glue.py --model bert-base-uncased                         # make glue MODEL=bert-base-uncased
    python tools/glue.py --model runs/bert-base-mlm-phase2/model --config accelerate_configs/4gpu.yaml
    python tools/glue.py --model <dir> --data <local GLUE-shaped dataset dir> --cpu -- --train.epochs=1

Writes <out>/glue_results.md and .json (one row per task, MNLI matched and mismatched, the GLUE score
and the published bert-base-uncased dev numbers beside), <out>/submission/{CoLA,SST-2,...}.tsv (zip
that folder for gluebenchmark.com; the AX diagnostic file is not produced), and each task's run in
<out>/<task>/. Arguments after `--` are overrides for every task.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# task: (GLUE's name, [(column label, metrics key)], score entries: each a list of keys averaged,
#        {test split: submission file})
TASKS = {
    "cola": ("CoLA", [("Matthews corr.", "matthews_correlation")], [["matthews_correlation"]], {"test": "CoLA"}),
    "sst2": ("SST-2", [("accuracy", "accuracy")], [["accuracy"]], {"test": "SST-2"}),
    "mrpc": ("MRPC", [("F1", "f1"), ("accuracy", "accuracy")], [["f1", "accuracy"]], {"test": "MRPC"}),
    "stsb": ("STS-B", [("Pearson", "pearsonr"), ("Spearman", "spearmanr")], [["pearsonr", "spearmanr"]],
             {"test": "STS-B"}),
    "qqp": ("QQP", [("accuracy", "accuracy"), ("F1", "f1")], [["accuracy", "f1"]], {"test": "QQP"}),
    "mnli": ("MNLI", [("matched acc.", "accuracy"), ("mismatched acc.", "validation_mismatched/accuracy")],
             [["accuracy"], ["validation_mismatched/accuracy"]], {"test_matched": "MNLI-m", "test_mismatched": "MNLI-mm"}),
    "qnli": ("QNLI", [("accuracy", "accuracy")], [["accuracy"]], {"test": "QNLI"}),
    "rte": ("RTE", [("accuracy", "accuracy")], [["accuracy"]], {"test": "RTE"}),
    "wnli": ("WNLI", [("accuracy", "accuracy")], [["accuracy"]], {"test": "WNLI"}),
}
# Published dev-set results of bert-base-uncased, NOT measured here: the Hugging Face transformers
# examples README for run_glue.py (median of 5 runs on single V100s, batch 16-64), in the columns above.
PUBLISHED = {"cola": [49.23], "sst2": [91.97], "mrpc": [89.47, 85.29], "stsb": [83.95, 83.70], "qqp": [88.40, 84.31],
             "mnli": [80.61, 81.08], "qnli": [87.46], "rte": [61.73], "wnli": [45.07]}


def score_entries(task: str, final: dict) -> list[float]:
    """GLUE's per-task scores, x100: a task with two metrics counts as their mean; MNLI matched and
    mismatched count as two entries, as the leaderboard lists them."""
    return [100 * sum(final[k] for k in keys) / len(keys) for keys in TASKS[task][2]]


def glue_score(entries: dict[str, list[float]], without_wnli: bool = False) -> float | None:
    values = [v for task, vs in entries.items() if not (without_wnli and task == "wnli") for v in vs]
    expected = sum(len(TASKS[t][2]) for t in TASKS if not (without_wnli and t == "wnli"))
    return sum(values) / len(values) if len(values) == expected else None


def run_task(task: str, args, overrides: list[str]) -> tuple[bool, Path]:
    out = Path(args.out) / task
    train = [str(REPO / "train.py"), "--recipe", str(REPO / f"recipes/bert-base-glue-{task}.yaml"),
             f"--model.name_or_path={args.model}", f"--run.output_dir={out}"]
    if args.data:
        train.append(f"--data.dataset_name={args.data}")
    env = dict(os.environ)
    if args.launcher == "python":
        cmd = [sys.executable] + train
    else:
        config = args.config or "accelerate_configs/1gpu.yaml"
        if args.cpu:
            from bert_recipes.backends.plan import backend_rows, first_row
            row = backend_rows()[first_row("ddp")]   # the table's DDP row: its CPU launch
            env, config = row.cpu_launch_env(env), args.config or row.cpu_config
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(REPO / config)]
        cmd += ["--num_processes", str(args.nproc)] if args.nproc else []
        cmd += train
    print(f"[glue] {task}: {' '.join(cmd[-4:])} ...", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / f"{task}.log", "w") as log:
        ok = subprocess.run(cmd + overrides, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode == 0
    return ok, out


def collect(args, done: dict[str, Path | None]) -> dict:
    """The table, the scores and the submission folder from the tasks' metrics.json and predictions."""
    rows, entries = [], {}
    submission = Path(args.out) / "submission"
    submission.mkdir(parents=True, exist_ok=True)
    for task, out in done.items():
        name, columns, _, files = TASKS[task]
        if out is None:
            rows.append({"task": name, "status": f"FAILED (see {Path(args.out) / task}.log)"})
            continue
        final = json.loads((out / "metrics.json").read_text())["final"]
        entries[task] = score_entries(task, final)
        rows.append({"task": name, "metrics": {label: 100 * final[key] for label, key in columns},
                     "published": dict(zip([c for c, _ in columns], PUBLISHED[task])), "step": final.get("steps"),
                     "status": "ok"})
        for split, glue_name in files.items():
            predicted = out / "predictions" / f"{split}.tsv"
            if predicted.exists():
                lines = predicted.read_text().splitlines()
                if task == "stsb":   # GLUE scores similarities in [0, 5]
                    lines = lines[:1] + [f"{i}\t{min(5.0, max(0.0, float(p))):.3f}" for i, p in
                                         (line.split("\t") for line in lines[1:])]
                (submission / f"{glue_name}.tsv").write_text("\n".join(lines) + "\n")
    published = {t: score_entries(t, {k: v / 100 for (_, k), v in zip(TASKS[t][1], PUBLISHED[t])}) for t in TASKS}
    return {"model": args.model, "data": args.data or "nyu-mll/glue (Hub)", "tasks": rows,
            "glue_score": glue_score(entries), "glue_score_without_wnli": glue_score(entries, without_wnli=True),
            "published_glue_score": glue_score(published),
            "published_glue_score_without_wnli": glue_score(published, without_wnli=True),
            "submission": sorted(p.name for p in submission.glob("*.tsv"))}


def render(result: dict) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"   # noqa: E731
    lines = [f"# GLUE dev results: {result['model']}", "", f"Data: {result['data']}. Every number x 100.", "",
             "| task | metric | this run | published (bert-base-uncased) | steps |", "|---|---|---|---|---|"]
    for row in result["tasks"]:
        if row["status"] != "ok":
            lines.append(f"| {row['task']} | | {row['status']} | | |")
            continue
        for label, value in row["metrics"].items():
            lines.append(f"| {row['task']} | {label} | {value:.2f} | {fmt(row['published'].get(label))} | {row['step']} |")
    lines += ["", f"**GLUE score {fmt(result['glue_score'])}** (published: {fmt(result['published_glue_score'])}); "
              f"without WNLI, as the BERT paper averages: {fmt(result['glue_score_without_wnli'])} "
              f"(published: {fmt(result['published_glue_score_without_wnli'])}).", "",
              "The score is the mean of ten entries: CoLA, SST-2, MRPC (mean of F1 and accuracy), STS-B (mean of "
              "Pearson and Spearman), QQP (mean of accuracy and F1), MNLI matched, MNLI mismatched, QNLI, RTE and "
              "WNLI. Published numbers: the Hugging Face transformers run_glue.py README, bert-base-uncased, median "
              "of 5 runs; not measured here.", "",
              f"Test-set predictions for gluebenchmark.com: {', '.join(result['submission']) or 'none'} in "
              "submission/ (no AX.tsv)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hub name or a directory (an export's model/)")
    parser.add_argument("--data", help="GLUE itself by default (nyu-mll/glue); or a dataset name or directory of "
                        "the same shape")
    parser.add_argument("--config", help="accelerate config (default: 1gpu.yaml; cpu.yaml with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="2 CPU processes (the table's CPU launch rule)")
    parser.add_argument("--nproc", type=int, help="processes per task (default: the config's)")
    parser.add_argument("--launcher", choices=["accelerate", "python"], default="accelerate")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset")
    parser.add_argument("--out", default="runs/glue")
    args, overrides = parser.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        print(f"config error: --tasks {unknown} are not GLUE tasks ({', '.join(TASKS)})", file=sys.stderr)
        return 2
    shutil.rmtree(Path(args.out) / "submission", ignore_errors=True)
    done = {}
    for task in tasks:
        ok, out = run_task(task, args, overrides)
        done[task] = out if ok else None
    result = collect(args, done)
    text = render(result)
    Path(args.out, "glue_results.md").write_text(text + "\n")
    Path(args.out, "glue_results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    return 0 if all(v is not None for v in done.values()) else 1


if __name__ == "__main__":
    from bert_recipes.cli import quick_exit   # without the interpreter's teardown (about 1 s)
    quick_exit(main())
