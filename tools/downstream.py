"""The downstream score of every checkpoint of a pretraining run (checkpoint.downstream; bert_recipes/downstream.py):
each step's export, fine-tuned with the run's downstream recipe as a run of its own (its own process, or processes
under --config), scored by that recipe's metric; the scores go into the run's metrics.json, curves.png and
trackers (TensorBoard, MLflow, W&B: logging.trackers).

    make downstream RUN=runs/tiny-mlm CPU=1            # python tools/downstream.py runs/tiny-mlm --cpu
    python tools/downstream.py runs/<name> --config accelerate_configs/1gpu.yaml
    python tools/downstream.py runs/<name> --recipe recipes/bert-base-glue-sst2.yaml -- --train.epochs=1

A step already scored (its score.json) is not fine-tuned again: run it while the pretraining runs, and again later.
The fine-tunes write into <run>/downstream/step_XXXXXXXX/finetune; the run's own files are written only while no
run holds <run> (its run.lock): a live run's scores wait in their score.json for the next call. Arguments after
`--` are overrides for every fine-tune. Exit code 2 with one line for a mistake, 1 when a fine-tune failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def fine_tune(model: Path, out: Path, recipe: str, args, overrides: list[str]) -> bool:
    """One fine-tune of `model` into `out` (its log beside it), as train.py runs it: one process, or the launch
    config's (--config; --cpu: the backend table's DDP row on CPU processes)."""
    train = [str(REPO / "train.py"), "--recipe", str(recipe), f"--model.name_or_path={model}",
             f"--run.output_dir={out}", "--run.overwrite=true", "--logging.progress_bar=false"]
    env = dict(os.environ)
    if args.config is None and not args.cpu:
        cmd = [sys.executable] + train
    else:
        config = args.config
        if args.cpu:
            from bert_recipes.backends.plan import backend_rows, first_row
            row = backend_rows()[first_row("ddp")]
            env, config = row.cpu_launch_env(env), args.config or row.cpu_config
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(REPO / config)]
        cmd += ["--num_processes", str(args.nproc)] if args.nproc else []
        cmd += train
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "finetune.log", "w") as log:
        return subprocess.run(cmd + overrides, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode == 0


def main(argv: list[str] | None = None) -> int:
    from bert_recipes.config import ConfigError, load_config
    from bert_recipes.downstream import exported_steps, into_run, record_score, score_metric, scores, step_dir
    from bert_recipes.run_dir import OutputDirLock
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a pretraining run's output_dir")
    parser.add_argument("--recipe", help="the fine-tuning recipe (default: the run's checkpoint.downstream)")
    parser.add_argument("--config", help="an accelerate config for the fine-tunes (default: one plain process)")
    parser.add_argument("--cpu", action="store_true", help="the fine-tunes on CPU processes (the DDP row's launch)")
    parser.add_argument("--nproc", type=int, help="processes per fine-tune under --config/--cpu")
    args = parser.parse_args(argv)
    run = Path(args.run)
    try:
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{run} holds no run (no config.yaml): give a pretraining run's run.output_dir")
        saved = load_config(run / "config.yaml", [])
        recipe = args.recipe or saved.checkpoint.downstream
        if recipe is None:
            raise ConfigError(f"{run} names no checkpoint.downstream recipe: give one with --recipe (and pretrain with "
                              "--checkpoint.downstream=<recipe> so each save exports its model)")
        steps = exported_steps(run)
        if not steps:
            raise ConfigError(f"{run} has no downstream exports (<run>/downstream/step_*/model): pretrain with "
                              f"--checkpoint.downstream={recipe}; each save then exports its model")
        metric = score_metric(load_config(recipe, overrides))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    done = {row["step"] for row in scores(run)}
    new, failed = [], []
    for step in steps:
        if step in done:
            continue
        out = step_dir(run, step) / "finetune"
        print(f"[downstream] step {step}: fine-tuning {step_dir(run, step) / 'model'} with {recipe} ...", flush=True)
        if not fine_tune(step_dir(run, step) / "model", out, recipe, args, overrides):
            failed.append(step)
            print(f"[downstream] step {step}: the fine-tune failed (its log: {out.parent / 'finetune.log'})")
            continue
        row = record_score(run, step, metric, json.loads((out / "metrics.json").read_text())["final"])
        new.append(row)
        print(f"[downstream] step {step}: {metric} {row['value']:.4f}")
    rows = scores(run)
    lock = OutputDirLock(run, saved.run.lock_stale_s)
    try:
        lock.acquire(0, say=lambda line: None)
    except ConfigError:
        print(f"[downstream] {run} is held by a live run (run.lock): the scores wait in "
              f"{run / 'downstream'}/step_*/score.json; run this again after it ends to add them to its metrics.json "
              "and curves.png")
        return 1 if failed else 0
    try:
        if (run / "metrics.json").is_file():
            into_run(run, rows, new, saved)
            print(f"[downstream] {len(rows)} scores ({metric} by pretraining step: "
                  + ", ".join(f"{r['step']}: {r['value']:.4f}" for r in rows)
                  + f") in {run / 'metrics.json'} and {run / 'curves.png'}")
    finally:
        lock.release()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
