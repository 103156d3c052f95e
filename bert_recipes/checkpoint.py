"""Checkpoints that survive a crash, and the Hugging Face export.

A checkpoint is written to `step_XXXXXXXX.partial/` and renamed once every rank has
finished, so a crash mid-save never leaves something `--resume auto` would pick up.
Old checkpoints are pruned only after the new one is complete.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "train_state.json"
CONFIG_FILE = "config.yaml"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """None -> None; 'auto' -> latest complete checkpoint or None; a path -> that checkpoint."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(f"checkpoint.resume={resume}: not a complete checkpoint (no {STATE_FILE})")
    return path


def save_checkpoint(output_dir: str | Path, step: int, train_state: dict, config_yaml: str, keep_last: int,
                    save_state, is_main: bool, barrier) -> Path:
    """save_state(dir) on every rank (accelerator.save_state: model, optimizer, registered scheduler,
    RNG of every rank; or the pipeline engine's save_checkpoint), plus the loop's own state and the
    resolved config; then atomically publish and prune."""
    root = checkpoint_root(output_dir)
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    if is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    save_state(str(partial))
    barrier()
    if is_main:
        (partial / CONFIG_FILE).write_text(config_yaml)
        (partial / STATE_FILE).write_text(json.dumps(train_state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_train_state(path: Path) -> dict:
    """The loop's own state saved with a checkpoint: step and history."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def full_state_dict(accelerator, model) -> dict:
    """The full, consolidated weights on the main process. Every rank must call this: under
    sharded backends (ZeRO-3, FSDP) it is a collective that gathers the shards."""
    return accelerator.get_state_dict(model)


def export_model(accelerator, model, tokenizer, out_dir: str | Path, config_yaml: str) -> Path:
    """Hugging Face format (config.json + model.safetensors + tokenizer + recipe), loadable
    with plain from_pretrained."""
    out = Path(out_dir)
    state_dict = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        unwrapped = accelerator.unwrap_model(model)
        tied = getattr(unwrapped, "_tied_weights_keys", None)
        if isinstance(tied, dict) and getattr(unwrapped.config, "tie_word_embeddings", True):
            for key in tied:   # gathered state dicts (ZeRO-3, FSDP) repeat tied weights under both names
                state_dict.pop(key, None)
        unwrapped.save_pretrained(
            out, state_dict=state_dict, safe_serialization=True, save_function=accelerator.save)
        tokenizer.save_pretrained(out)
        (out / "recipe.yaml").write_text(config_yaml)
    accelerator.wait_for_everyone()
    return out
