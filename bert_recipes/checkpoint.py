"""Checkpoints that survive a crash (their directories, manifests and resume; what a rank writes into
one is its engine's, plus bert_recipes/rng.py; the Hugging Face export: bert_recipes/export.py).

A checkpoint is written to `step_XXXXXXXX.partial/` and renamed once every rank has
finished, so a crash mid-save never leaves something `--resume auto` would pick up.
Old checkpoints are pruned only after the new one is complete. Each checkpoint carries a
manifest (size and CRC-32 of every file): `--resume auto` skips a damaged one (a truncated or
overwritten file) for the previous complete checkpoint and says so; an explicit resume path that
does not verify is refused with the file named.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

from .config import ConfigError, nearest_existing, path_kind
from .ranks import barrier, broadcast

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "train_state.json"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"


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


# ---------------------------------------------------------------------------- integrity
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path) -> None:
    """Size and CRC-32 of every file below `directory` (read back from the page cache: ~1 GB/s)."""
    files = {str(p.relative_to(directory)): [p.stat().st_size, _crc32(p)]
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    (directory / MANIFEST_FILE).write_text(json.dumps(files, indent=0))


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint, or None when every file matches its manifest (checkpoints
    written before manifests existed are taken as they are)."""
    manifest = checkpoint / MANIFEST_FILE
    if not manifest.exists():
        return None
    try:
        files = json.loads(manifest.read_text())
    except ValueError:
        return f"{manifest} is not valid JSON"
    for name, (size, crc) in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} were written"
        if _crc32(path) != crc:
            return f"{path} does not match the checksum written with it (corrupted)"
    return None


def resolve_resume(resume: str | None, output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """-> (checkpoint to resume from, notes to print). None -> nothing; 'auto' -> the latest complete
    checkpoint that verifies (skipping damaged ones, with a note each); a path -> that checkpoint."""
    if resume is None:
        return None, []
    if resume == "auto":
        notes = []
        for candidate in reversed(complete_checkpoints(output_dir)):
            problem = damage(candidate)
            if problem is None:
                return candidate, notes
            notes.append(f"[resume] skipping damaged checkpoint {candidate.name}: {problem}")
        if notes:
            notes.append("[resume] no intact checkpoint left: starting from scratch")
        return None, notes
    path = check_resume_path(resume)
    problem = damage(path)
    if problem is not None:
        raise ConfigError(f"checkpoint.resume={resume} is damaged: {problem}; pick an earlier checkpoint or "
                          "use --resume auto, which skips damaged ones")
    return path, []


def check_resume_path(resume: str | None) -> Path | None:
    """An explicit checkpoint.resume must be a complete checkpoint (its files are verified later,
    on rank 0). -> its path (None for no resume or 'auto')."""
    if resume in (None, "auto"):
        return None
    path = Path(resume)
    kind = path_kind(path, "checkpoint.resume")
    if kind == "dir":
        path_kind(path / STATE_FILE, "checkpoint.resume")   # a directory this user cannot look into
    if kind == "file":
        raise ConfigError(f"checkpoint.resume={resume} is a file, not a checkpoint directory: use --resume auto or a "
                          "step_XXXXXXXX directory under <output_dir>/checkpoints")
    if not (path / STATE_FILE).exists():
        raise ConfigError(f"checkpoint.resume={resume}: not a complete checkpoint (no {STATE_FILE}); "
                          f"use --resume auto or a step_XXXXXXXX directory under <output_dir>/checkpoints")
    return path


def save_checkpoint(output_dir: str | Path, step: int, train_state: dict, config_yaml: str, keep_last: int,
                    engine, name: str | None = None) -> Path:
    """engine.save(dir) on every rank (the engine's: model, optimizer, schedule, RNG of every rank; or the
    pipeline engine's checkpoint), plus the loop's own state, the resolved config and the manifest; then
    atomically publish and prune. name: another directory than step_XXXXXXXX (checkpoints/best), which the
    rotation and --resume auto leave alone. Each of the three writes is agreed on by every rank
    (guard.written_by_all): a full disk on any rank removes the .partial, keeps the previous checkpoint
    and raises guard.DiskFull everywhere, with no rank left in a barrier."""
    from .guard import disk_full, written_by_all
    root = checkpoint_root(output_dir)
    final = root / (name or f"step_{step:08d}")
    partial = root / f"{final.name}.partial"
    previous = complete_checkpoints(output_dir)[-1:]
    needed = ((tree_bytes(previous[0]), f"an estimate: the size of {previous[0].name}") if previous else None)

    kept = f"{previous[0].name} stays the latest checkpoint" if previous else "there is no earlier checkpoint"
    then = (f"the partial checkpoint was removed and {kept}: free space there (or give run.output_dir a larger "
            "disk), then continue with --resume auto")

    def full_error(err):
        return disk_full(err, partial, "the checkpoint", step, needed or (tree_bytes(partial) + 1, "more than the "
                         "bytes written before the disk filled; no earlier checkpoint to estimate from"), then)

    def agreed(write):
        written_by_all(write, engine.control, engine.is_main, lambda: shutil.rmtree(partial, ignore_errors=True),
                       full_error)

    def start():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def publish():
        (partial / CONFIG_FILE).write_text(config_yaml)
        write_manifest(partial)
        (partial / STATE_FILE).write_text(json.dumps(train_state))   # last: marks the checkpoint complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    agreed(start if engine.is_main else lambda: None)
    agreed(lambda: engine.save(str(partial)))
    agreed(publish if engine.is_main else lambda: None)
    return final


def tree_bytes(path: Path) -> int:
    """The bytes of the files below `path` (0 where it does not exist)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).exists() else 0


def read_train_state(path: Path) -> dict:
    """The loop's own state saved with a checkpoint: step and history."""
    return json.loads((Path(path) / STATE_FILE).read_text())


# ---------------------------------------------------------------------------- the output directory
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


# What gives a model's tensors their shapes: a checkpoint written under other values cannot be loaded into this
# run's model (torch's size mismatch, after the data was prepared). The vocabulary size counts only for a
# tokenizer trained here; the dropouts, the attention implementation and the rest do not change a shape.
# Not tokenizer.name_or_path: a resume may name the run's own saved tokenizer (<output_dir>/tokenizer) where the
# first run trained it, the same vocabulary under another path (tools/gpu_smoke.py's resume does).
SHAPE_KEYS = ("model.name_or_path", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
              "model.intermediate_size", "model.max_position_embeddings", "tokenizer.vocab_size", "task.kind",
              "task.num_labels")


def check_checkpoint_fits(checkpoint: Path | None, config_yaml: str) -> None:
    """The checkpoint a run resumes against this run's model shape (SHAPE_KEYS, from the resolved config
    saved beside it), before any tensor is loaded: one line naming every differing field with both values,
    and the two ways out. Warm-starting from an export (model.name_or_path) is not a resume: not checked."""
    import yaml
    if checkpoint is None or not (Path(checkpoint) / CONFIG_FILE).is_file():
        return
    old, new = (yaml.safe_load(text) or {} for text in ((Path(checkpoint) / CONFIG_FILE).read_text(), config_yaml))
    value = lambda d, key: (d.get(key.split(".")[0]) or {}).get(key.split(".")[1])   # noqa: E731
    trained_here = lambda d: (value(d, "tokenizer.name_or_path") is None   # noqa: E731
                              and value(d, "model.name_or_path") is None)
    keys = [k for k in SHAPE_KEYS if k != "tokenizer.vocab_size" or trained_here(old) and trained_here(new)]
    differ = [f"{k}: {value(old, k)!r} in the checkpoint, {value(new, k)!r} now" for k in keys
              if value(old, k) != value(new, k)]
    if differ:
        raise ConfigError(f"checkpoint.resume: {checkpoint} holds a model of another shape than this run's ("
                          f"{'; '.join(differ)}): resume it with the config it was saved with "
                          f"({Path(checkpoint) / CONFIG_FILE}), or start a new run in another run.output_dir "
                          "(or this one, without --resume, with --run.overwrite=true)")


def resumed_checkpoint(output_dir: str | Path, resume: str | None) -> Path | None:
    """The checkpoint a resume would start from, as preflight sees it (auto: the latest complete one)."""
    if resume == "auto":
        return (complete_checkpoints(output_dir)[-1:] or [None])[0]
    return Path(resume) if resume else None


def check_writable_dir(path: Path, key: str) -> None:
    """`path` is a directory, or can be made one: its nearest existing ancestor is a writable directory."""
    path = Path(path)
    if path_kind(path, key) == "file":
        raise ConfigError(f"{key}={path} is a file, not a directory: give a directory path (it is created if missing)")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, so the directory cannot be created there; "
                          "give another path")
    problem = cannot_create_in(existing)
    if problem:
        raise ConfigError(f"{key}={path}: nothing can be created in {existing} ({problem}); give a writable path")


def unwritable_default(path: Path) -> str | None:
    """Why a directory the user never named (a library's default cache) cannot be written: None when it can."""
    try:
        check_writable_dir(path, "")
    except ConfigError as err:
        return str(err).lstrip("=")
    return None


def cannot_create_in(directory: Path) -> str | None:
    """Why no file can be created in `directory`, or None when one can: a probe file is created and removed
    (the only thing a check writes), and the directory's times are set back, so the check leaves no trace.
    os.access cannot tell: root passes it everywhere, yet a read-only mount or a pseudo-filesystem (/proc,
    /sys) refuses the write itself."""
    import tempfile
    try:
        before = os.stat(directory)
        fd, probe = tempfile.mkstemp(prefix=".bert-recipes-probe-", dir=directory)
    except OSError as err:
        fs_type, options = filesystem_of(directory)
        why = ("it is mounted read-only" if "ro" in options else f"it is on a {fs_type} filesystem"
               if fs_type in PSEUDO_FILESYSTEMS else "this user may not write there")
        return f"{why}: {err.strerror or type(err).__name__}"
    os.close(fd)
    os.unlink(probe)
    try:
        os.utime(directory, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError:
        pass   # a directory this user may write in but not touch: the probe is gone all the same
    return None


PSEUDO_FILESYSTEMS = {"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs", "tracefs", "configfs"}


def filesystem_of(path: Path) -> tuple[str, set[str]]:
    """(type, mount options) of the filesystem holding `path`, from /proc/self/mounts (the longest mount point
    above it); ("unknown", set()) where that cannot be read."""
    try:
        mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return "unknown", set()
    target = Path(path).resolve()
    best = max((m for m in mounts if len(m) >= 4 and (target == Path(m[1]) or Path(m[1]) in target.parents)),
               key=lambda m: len(m[1]), default=None)
    return (best[2], set(best[3].split(","))) if best else ("unknown", set())


def check_shared_output_dir(output_dir: Path, engine) -> None:
    """Rank 0 creates each checkpoint directory and every rank writes its own files into it, so all
    ranks must see one output_dir. Rank 0 leaves a marker beside it; a rank that cannot see it is on
    a node whose disk is not shared: refused, on every rank, before anything else is written."""
    if engine.num_processes == 1:
        return
    import secrets

    from .guard import all_max
    marker = output_dir.parent / f".{output_dir.name}.shared-check-{broadcast(secrets.token_hex(8))}"
    if engine.is_main:
        from .places import creating
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
    and copies the tokenizer in; every rank agrees on it (guard.written_by_all): a full disk is one line, on every
    rank exit code 5."""
    from .guard import disk_full, written_by_all
    from .places import creating

    def write():
        with creating("run.output_dir", output_dir):   # an OSError the checks could not foresee: one line
            start_output_dir(output_dir, config_yaml, overwrite, resume)
            tokenizer.save_pretrained(output_dir / "tokenizer")
    written_by_all(write if engine.is_main else lambda: None, engine.control, engine.is_main, lambda: None,
                   lambda err: disk_full(err, output_dir, "the run's config and tokenizer", train_state["step"], None,
                                         "nothing was trained: free space there, then run again"))
