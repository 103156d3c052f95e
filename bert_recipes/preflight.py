"""What a plain process can check before any rank starts: the recipe and its overrides, the launch
config against the recipe, the output directory and the paths the run will read.

train.main calls `preflight` first, in every rank; the Make targets call it once more before
`accelerate launch`, through this module's command line, with the launch's own environment:

    python -m bert_recipes.preflight <accelerate config> [--num_processes N] -- <train.py arguments>

so a user's mistake is one `config error:` line and exit code 2, before a launcher starts (and
before it can add its own traceback). What only a rank can see (the data's columns and labels, a
prepared-data signature, an output directory shared across nodes) is checked there.
Cheap by design: no model, no data, no process group; about the cost of importing torch.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .backend import (LaunchPlan, _true, check_consistency, check_trackers, decide_on_gpu, local_capability,
                      pipeline_replicas, plan_from_config_file)
from .checkpoint import check_output_dir, check_resume_path
from .config import Config, ConfigError, grad_accum_steps, parse_train_args, resolve, to_yaml, validate
from .data import check_data_files, check_prepared_dir


def looks_local(name: str) -> bool:
    """A model or tokenizer name that can only be a directory: a Hub id is `name` or `org/name`."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def check_paths(cfg: Config) -> None:
    """The local paths the run reads: model and tokenizer directories, data files, prepared data."""
    for key, name in (("model.name_or_path", cfg.model.name_or_path), ("tokenizer.name_or_path", cfg.tokenizer.name_or_path)):
        if name and looks_local(name) and not Path(name).expanduser().is_dir():
            raise ConfigError(f"{key}={name}: cannot load it: no such directory (give a Hugging Face model directory, "
                              "such as an export's model/, or a Hub name)")
    if cfg.data.source == "files":
        check_data_files(cfg.data)
    if cfg.data.source == "prepared":
        check_prepared_dir(cfg.data)
    check_resume_path(cfg.checkpoint.resume)


def preflight(cfg: Config, plan: LaunchPlan, world_size: int, env=os.environ) -> list[str]:
    """Every check that needs no data, model or process group; raises ConfigError naming the field.
    Fills the settings `resolve` derives. -> the notes to print once the run starts."""
    validate(cfg)
    notes = resolve(cfg)
    # an output_dir holding another run's checkpoints is refused (run.overwrite replaces it)
    notes += check_output_dir(Path(cfg.run.output_dir), to_yaml(cfg), cfg.checkpoint.resume, cfg.run.overwrite)
    check_paths(cfg)
    check_trackers(cfg.logging.trackers)
    on_gpu = decide_on_gpu(plan, env)
    replicas = pipeline_replicas(plan, world_size)
    check_consistency(cfg, plan, replicas, grad_accum_steps(cfg.train, replicas), on_gpu,
                      local_capability() if on_gpu else None)
    return notes


def launch_plan(config_file: str, env=os.environ) -> LaunchPlan:
    """The plan `accelerate launch --config_file` would give the ranks, in this environment
    (a CPU launch's ACCELERATE_USE_CPU=1 included)."""
    plan = plan_from_config_file(config_file)
    plan.cpu = plan.cpu or _true(env.get("ACCELERATE_USE_CPU"))
    return plan


def main(argv: list[str]) -> int:
    if "--" not in argv or not argv:
        print("usage: python -m bert_recipes.preflight <accelerate config> [--num_processes N] -- <train.py arguments>",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    ours, train_args = argv[:split], argv[split + 1:]
    try:
        plan = launch_plan(ours[0])
        world = plan.num_processes
        if "--num_processes" in ours:
            world = int(ours[ours.index("--num_processes") + 1])
        cfg, _ = parse_train_args(train_args)
        preflight(cfg, plan, world)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
