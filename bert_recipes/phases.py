"""A run that starts from another run's checkpoint (checkpoint.init_from: the next phase of a pretraining, such as a
context extension or a decay): which checkpoint, what carries over (the weights; the optimizer's state with
checkpoint.init_optimizer) and what starts anew (the step, this recipe's lr schedule, the data position, the random
generators). A resume of the run itself (checkpoint.resume) comes first: a preempted phase continues itself."""
from __future__ import annotations

from pathlib import Path

from .config import ConfigError, path_kind

KEY = "checkpoint.init_from"


def resolve_init(init_from: str) -> Path:
    """checkpoint.init_from -> the checkpoint it names: a checkpoint directory (complete and intact), or a run's
    output_dir (its latest complete checkpoint that is intact). Anything else is one line."""
    from .checkpoint import STATE_FILE, complete_checkpoints, damage
    path = Path(init_from).expanduser()
    kind = path_kind(path, KEY)
    where = "give a run's output_dir or one of its checkpoints (<output_dir>/checkpoints/step_XXXXXXXX)"
    if kind != "dir":
        raise ConfigError(f"{KEY}={init_from} "
                          f"{'is no such directory' if kind == 'missing' else 'is a file, not a directory'}: {where}")
    own = path_kind(path / STATE_FILE, KEY) == "file"   # (a directory this user cannot look into: one line)
    candidates = [path] if own else list(reversed(complete_checkpoints(path)))
    if not candidates:
        raise ConfigError(f"{KEY}={init_from} holds no complete checkpoint; {where}")
    problems = []
    for candidate in candidates:
        problem = damage(candidate)
        if problem is None:
            return candidate
        problems.append(f"{candidate.name}: {problem}")
    raise ConfigError(f"{KEY}={init_from}: no intact checkpoint ({'; '.join(problems)}); {where}")


def source_run(checkpoint: Path) -> Path:
    """The output_dir of the run that wrote a checkpoint (<output_dir>/checkpoints/<name>)."""
    return checkpoint.parent.parent


def its_tokenizer(checkpoint: Path) -> Path | None:
    """The tokenizer the source run saved (its output_dir/tokenizer), which a phase reads when the recipe names none:
    the checkpoint's token ids mean its words. None where the source run saved none."""
    saved = source_run(checkpoint) / "tokenizer"
    return saved if (saved / "tokenizer.json").is_file() or (saved / "vocab.txt").is_file() else None


def carry_over(load, optimizer, scheduler, on_gpu: bool) -> None:
    """checkpoint.init_optimizer: load a checkpoint through the engine (`load`: its resume path, which re-cuts a
    checkpoint of another process count) and keep what this run starts anew: every optimizer group's settings (lr,
    betas, weight decay: this recipe's), the schedule at this run's step 0, the random generators as this run has
    them (on_gpu: the plan's, the CUDA ones too). (The weights alone are read before the engine is built:
    backends/saved_weights.py.)"""
    import random

    import numpy as np
    import torch
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    schedule = scheduler.state_dict()
    generators = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                  torch.cuda.get_rng_state_all() if on_gpu else None)
    load()
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)
    scheduler.load_state_dict(schedule)
    random.setstate(generators[0])
    np.random.set_state(generators[1])
    torch.set_rng_state(generators[2])
    if generators[3] is not None:
        torch.cuda.set_rng_state_all(generators[3])


def init_line(checkpoint: Path, optimizer_state: bool) -> str:
    """The [init] line: what the run carried over from which checkpoint, and what starts anew."""
    from .checkpoint import read_train_state
    step = read_train_state(checkpoint).get("step")
    carried = "the weights and the optimizer's state (checkpoint.init_optimizer)" if optimizer_state else (
        "the weights (a new optimizer state: checkpoint.init_optimizer=false)")
    return (f"[init] from {checkpoint} (step {step} of {source_run(checkpoint)}): {carried}; the step, this recipe's "
            "lr schedule, the data position and the random generators start anew")
