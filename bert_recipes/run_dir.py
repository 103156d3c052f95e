"""A run's output directory (run.output_dir): never two runs mixed in it (a new run where checkpoints exist is
refused, a resume with a changed config says what changed), shared by every rank, and started (the resolved
config, the tokenizer) only once every check has passed. Checkpoints inside it: bert_recipes/checkpoint.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .checkpoint import CONFIG_FILE, complete_checkpoints
from .config import ConfigError
from .disk import disk_full
from .places import check_writable_dir, creating
from .ranks import all_max, barrier, broadcast, written_by_all


_NOT_THE_RUN = {"checkpoint.resume", "run.overwrite", "run.output_dir", "train.halt_at_step", "logging.progress_bar"}


def config_differences(old_yaml: str, new_yaml: str) -> list[str]:
    """'section.key: old -> new' for every setting that differs (ignoring those that only steer
    this invocation: resume, overwrite, where the directory is, halt_at_step, the progress bar); a rule
    the old config predates is one line in words, first (predated_rules)."""
    rules, changes = _differences(old_yaml, new_yaml)
    return rules + changes


def _differences(old_yaml: str, new_yaml: str) -> tuple[list[str], list[str]]:
    import yaml
    old, new = yaml.safe_load(old_yaml) or {}, yaml.safe_load(new_yaml) or {}
    flat = lambda d: {f"{s}.{k}": v for s, section in d.items() if isinstance(section, dict)   # noqa: E731
                      for k, v in section.items()}
    a, b = flat(old), flat(new)
    rules, explained = predated_rules(a, b)
    return rules, [f"{k}: {_shown(a.get(k))} -> {_shown(b.get(k))}" for k in sorted(set(a) | set(b))
                   if k not in _NOT_THE_RUN | explained and a.get(k) != b.get(k)]


def predated_rules(old: dict, new: dict) -> tuple[list[str], set[str]]:
    """A saved config (flat 'section.key' dicts, as config_differences reads them) from before a
    key existed followed the rule of its time: -> (a line for each rule that changes from here on, the keys
    those lines account for). A key it lacks that changes nothing is no difference either."""
    key = "optim.lamb_trust_ratio"
    if key in old or key not in new:
        return [], set()
    if "lamb" not in (old.get("optim.name"), new.get("optim.name")) or new[key] == "all":
        return [], {key}   # AdamW has no trust ratio; "all" is the old rule
    return [f"LAMB's trust ratio changed: the checkpoint was trained with it on every tensor (the rule before "
            f"{key} existed, = all); from here on only where weight decay applies ({key}={new[key]}, apex "
            f"FusedLAMB's and NVIDIA BERT's); --{key}=all keeps the old rule"], {key}


def _shown(value) -> str:
    """A setting as a change names it; a long list (data files resolved from a pattern: hundreds of shards) by
    its length and its ends."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{len(value)} items: {value[0]!r}, ..., {value[-1]!r}]"
    return repr(value)


def check_output_dir(output_dir: Path, config_yaml: str, resume: str | None, overwrite: bool) -> list[str]:
    """Never mix two runs in one directory: a new run where checkpoints exist is refused unless
    run.overwrite; a resume with a changed config is allowed with a note naming the changes. The
    directory must be creatable: not a file, not below a file, on a writable filesystem."""
    check_writable_dir(output_dir, "run.output_dir")
    found = complete_checkpoints(output_dir)
    if not found:
        return []
    latest = found[-1]
    saved = latest / CONFIG_FILE
    changes = config_differences(saved.read_text(), config_yaml) if saved.exists() else []
    if resume is None and not overwrite:
        if changes:
            shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
            raise ConfigError(f"run.output_dir={output_dir} holds checkpoints (up to {latest.name}) of a different "
                              f"run ({shown}): pick another run.output_dir, continue that run with --resume auto, "
                              "or replace it with --run.overwrite=true")
        raise ConfigError(f"run.output_dir={output_dir} already holds checkpoints of this run (up to {latest.name}): "
                          "continue it with --resume auto, or start over with --run.overwrite=true")
    if resume is not None and changes:
        rules, rest = _differences(saved.read_text(), config_yaml)
        return [f"[resume] {rule}" for rule in rules] + (
            ["[resume] the config differs from the checkpoint's: " + "; ".join(rest)] if rest else [])
    return []


def check_shared_output_dir(output_dir: Path, engine) -> None:
    """Rank 0 creates each checkpoint directory and every rank writes its own files into it, so all
    ranks must see one output_dir. Rank 0 leaves a marker beside it; a rank that cannot see it is on
    a node whose disk is not shared: refused, on every rank, before anything else is written."""
    if engine.num_processes == 1:
        return
    import secrets

    marker = output_dir.parent / f".{output_dir.name}.shared-check-{broadcast(secrets.token_hex(8))}"
    if engine.is_main:
        with creating("run.output_dir", output_dir):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    barrier()
    blind = int(all_max([float(not marker.exists())], engine.control)[0])
    barrier()
    if engine.is_main:
        marker.unlink()
    if blind:
        raise ConfigError(f"run.output_dir={output_dir} is not shared by every rank: some cannot see a file rank 0 "
                          "wrote beside it (a node-local disk). Checkpoints are written by all ranks into "
                          "directories rank 0 creates, so put run.output_dir on a filesystem every node mounts "
                          "(NFS, Lustre, GPFS); the data and tokenizer caches may stay node-local")


def start_output_dir(output_dir: Path, config_yaml: str, overwrite: bool, resume: str | None) -> None:
    """Rank 0, once the run is known to start: clear an old run when run.overwrite asks for it
    (never on a resume), then write the resolved config."""
    if overwrite and resume is None:
        for name in ("checkpoints", "model", "logs", "tokenizer", "metrics.json", "curves.png"):
            target = output_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / CONFIG_FILE).write_text(config_yaml)


def start_writing(output_dir: Path, config_yaml: str, tokenizer, overwrite: bool, resume: str | None, engine,
                  train_state: dict) -> None:
    """A run's first write, once every check has passed: rank 0 starts the output directory (the resolved config)
    and copies the tokenizer in; every rank agrees on it (ranks.written_by_all): a full disk is one line, on every
    rank exit code 5."""
    def write():
        with creating("run.output_dir", output_dir):   # an OSError the checks could not foresee: one line
            start_output_dir(output_dir, config_yaml, overwrite, resume)
            tokenizer.save_pretrained(output_dir / "tokenizer")
    written_by_all(write if engine.is_main else lambda: None, engine.control, engine.is_main, lambda: None,
                   lambda err: disk_full(err, output_dir, "the run's config and tokenizer", train_state["step"], None,
                                         "nothing was trained: free space there, then run again"))
