"""DeepSpeed on another number of processes: a ZeRO checkpoint re-partitioned through DeepSpeed's universal
checkpoint (0.19.8). Rank 0 converts it once with DeepSpeed's own converter (universal_checkpoint), then every
rank loads its new partition (loading_universal). layout.resume_layout decides which layouts may change
and says so in the [resume] line; docs/checkpoints.md has the table.

No torch or deepspeed at import time."""
from __future__ import annotations

import contextlib
from pathlib import Path

from ..config import ConfigError

# What the scheduler moves (the same in every group: one schedule for all); every other hyperparameter of a
# param group is the recipe's (optim.py: weight decay per group), kept through the universal load.
SCHEDULED = ("params", "lr", "initial_lr")


def universal_checkpoint(checkpoint: Path, tag: str = "pytorch_model") -> Path:
    """A ZeRO checkpoint saved by another number of processes, as DeepSpeed's universal checkpoint, made once
    next to it (<checkpoint>/universal, written as .partial and renamed) with DeepSpeed's own converter
    (deepspeed.checkpoint.ds_to_universal; --inject_missing_state: Accelerate's checkpoints lack the
    metadata Megatron-DeepSpeed writes). Rank 0's work (the engine runs it through ranks.on_rank0, which
    raises its error on every rank). tag: the DeepSpeed checkpoint's folder (Accelerate's pytorch_model, the
    pipeline's engine). -> the directory to load (the same tag, the RNG files beside it). A failed conversion
    is one line."""
    import argparse
    import io
    import shutil
    target = checkpoint / "universal"
    if target.exists():
        return target
    from deepspeed.checkpoint.ds_to_universal import main as to_universal
    partial = checkpoint / "universal.partial"
    shutil.rmtree(partial, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(checkpoint / tag), output_folder=str(partial / tag),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # its progress lines
            to_universal(args)
    except Exception as err:   # noqa: BLE001 (any failure of the converter is the user's one line)
        shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(f"checkpoint.resume: {checkpoint} could not be converted to DeepSpeed's universal "
                          f"checkpoint ({type(err).__name__}: {str(err)[:160]}); resume on the process count "
                          "it was saved with") from None
    for rng in checkpoint.glob("random_states_*.pkl"):
        shutil.copy2(rng, partial / rng.name)
    partial.rename(target)
    return target


@contextlib.contextmanager
def resharded(checkpoint: Path, processes: int, ds_engine, is_main: bool, broadcast, tag: str = "pytorch_model"):
    """The directory a DeepSpeed engine loads from: the checkpoint itself, or, saved by another number of
    processes, its universal conversion (rank 0 makes it once, ranks.on_rank0), with DeepSpeed's universal
    load on for as long as the block runs. Both engines load through here (engine.py, pipeline.py)."""
    from ..layout import saved_layout
    from ..ranks import on_rank0
    saved = saved_layout(checkpoint)
    if not saved or saved.get("world") == processes:
        yield checkpoint
        return
    universal = on_rank0(is_main, broadcast, lambda: universal_checkpoint(checkpoint, tag))
    with loading_universal(ds_engine):
        yield universal


@contextlib.contextmanager
def loading_universal(engine):
    """DeepSpeed reads its config's load_universal_checkpoint inside load_checkpoint (engine.py): on for this
    load. Two slips of ZeRO-3's universal load are mended after it (stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3):
    - every param group gets group 0's saved hyperparameters, so the no-decay group would decay: each group
      gets its own back (all but SCHEDULED, which the one schedule sets alike in every group);
    - every group's state gets the same `step` tensor, which torch's Adam increments in place once per group:
      the second group's bias correction would run a step ahead. Each state gets its own copy.
    Measured 2026-12-02 (tests/test_backends.py, ZeRO-3 2 -> 1): 1.5e-4 off the uninterrupted run without these,
    within 1e-5 with them."""
    stage3 = engine.zero_optimization_stage() == 3   # ZeRO-1/2's load (the pipeline's too) restores each group's own
    own = [{k: v for k, v in group.items() if k not in SCHEDULED} for group in engine.optimizer.param_groups]
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False
    if stage3:
        for group, kept in zip(engine.optimizer.param_groups, own):
            group.update(kept)
        for state in engine.optimizer.optimizer.state.values():
            if hasattr(state.get("step"), "clone"):   # a tensor (torch's Adam); DeepSpeed's CPU Adam keeps an int
                state["step"] = state["step"].clone()
