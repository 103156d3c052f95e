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

from .config import ConfigError, DataConfig, path_kind
from .ranks import broadcast, on_rank0, print0

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


def pick_checkpoint(resume: str | None, output_dir: Path, engine) -> Path | None:
    """The checkpoint checkpoint.resume names (None: a new run), picked by rank 0 (resolve_resume, its notes
    printed) and told to the others: ranks may see the disk at different times."""
    checkpoint, notes = on_rank0(engine.is_main, broadcast, lambda: resolve_resume(resume, output_dir))
    for note in notes:
        print0(note)
    return checkpoint


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
    (ranks.written_by_all): a full disk on any rank removes the .partial, keeps the previous checkpoint
    and raises disk.DiskFull everywhere, with no rank left in a barrier."""
    from .disk import disk_full
    from .ranks import written_by_all
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


# What gives every model's tensors their shapes (an architecture's own: its row's shape_fields): a checkpoint written
# under other values cannot be loaded into this run's model (torch's size mismatch, after the data was prepared).
# The vocabulary size counts only for a tokenizer trained here; the dropouts, the attention implementation and the rest do not change a shape.
# Not tokenizer.name_or_path: a resume may name the run's own saved tokenizer (<output_dir>/tokenizer) where the
# first run trained it, the same vocabulary under another path (tools/gpu_smoke.py's resume does).
SHAPE_KEYS = ("model.architecture", "model.name_or_path", "model.hidden_size", "model.num_hidden_layers",
              "model.num_attention_heads",
              "model.intermediate_size", "model.max_position_embeddings", "tokenizer.vocab_size", "task.kind",
              "task.num_labels")


SHAPE_DEFAULTS = {"model.architecture": "bert"}


def check_checkpoint_fits(checkpoint: Path | None, config_yaml: str, key: str = "checkpoint.resume") -> None:
    """The checkpoint a run resumes (or starts from: key checkpoint.init_from) against this run's model shape
    (SHAPE_KEYS, and the architecture row's shape_fields, from the resolved config saved beside it), before any tensor
    is loaded: one line naming every differing field with both values, and the ways out. max_position_embeddings shapes no weight of a RoPE model
    (architectures' position_weights): there it may change. Warm-starting from an export (model.name_or_path) is not
    a resume: not checked."""
    import yaml

    from .architectures import ARCHITECTURES
    if checkpoint is None or not (Path(checkpoint) / CONFIG_FILE).is_file():
        return
    old, new = (yaml.safe_load(text) or {} for text in ((Path(checkpoint) / CONFIG_FILE).read_text(), config_yaml))
    # a checkpoint saved before model.architecture existed holds a BERT
    value = lambda d, key: (d.get(key.split(".")[0]) or {}).get(key.split(".")[1], SHAPE_DEFAULTS.get(key))   # noqa: E731
    trained_here = lambda d: (value(d, "tokenizer.name_or_path") is None   # noqa: E731
                              and value(d, "model.name_or_path") is None)
    row = ARCHITECTURES.get(value(new, "model.architecture"))
    shape_keys = SHAPE_KEYS + tuple(f"model.{k}" for k in (row.shape_fields if row is not None else ()))
    keys = [k for k in shape_keys if (k != "tokenizer.vocab_size" or trained_here(old) and trained_here(new))
            and (k != "model.max_position_embeddings" or row is None or row.position_weights)]
    differ = [f"{k}: {value(old, k)!r} in the checkpoint, {value(new, k)!r} now" for k in keys
              if value(old, k) != value(new, k)]
    if not differ:
        return
    if key == "checkpoint.resume":
        ways = (f"resume it with the config it was saved with ({Path(checkpoint) / CONFIG_FILE}), or start a new run in "
                "another run.output_dir (or this one, without --resume, with --run.overwrite=true)")
    else:
        ways = f"set these fields to the checkpoint's values ({Path(checkpoint) / CONFIG_FILE}), or start from another run"
    raise ConfigError(f"{key}: {checkpoint} holds a model of another shape than this run's ({'; '.join(differ)}): "
                      f"{ways}")


def tokenizer_record(tokenizer, source: str | None) -> dict:
    """What a checkpoint records of the tokenizer it was trained with (train_state.json): a fingerprint of its
    vocabulary and ids, normaliser and special tokens (tokenizing.vocabulary_fingerprint), its size and where it
    came from (tokenizer.name_or_path, the model's, or None: trained by the run)."""
    from .data.tokenizing import vocabulary_fingerprint
    return {"fingerprint": vocabulary_fingerprint(tokenizer), "vocab_size": len(tokenizer), "source": source}


def check_tokenizer_fits(checkpoint: Path | None, record: dict, output_dir: Path, resumed: bool = True) -> str | None:
    """A resume's tokenizer against the one its checkpoint was trained with, before anything is written: another
    one (the same size with two ids swapped is enough: the ids then mean other words) is one line naming both and
    the ways out. -> a note for a checkpoint that records none (saved before fingerprints were), else None."""
    if checkpoint is None:
        return None
    saved = read_train_state(checkpoint).get("tokenizer")
    if saved is None:
        return (f"[resume] {Path(checkpoint).name} records no tokenizer fingerprint (saved before checkpoints did): "
                "this run's tokenizer is not checked against the one it was trained with")
    if saved["fingerprint"] == record["fingerprint"]:
        return None
    shown = lambda r: (f"{r['source'] or 'trained by the run'}, {r['vocab_size']} tokens, "   # noqa: E731
                       f"fingerprint {r['fingerprint'][:12]}")
    own = Path(output_dir if resumed else Path(checkpoint).parent.parent) / "tokenizer"
    verb = "resume" if resumed else "start (checkpoint.init_from)"
    way = (f"{verb} with the run's own saved tokenizer (--tokenizer.name_or_path={own}), or "
           if (own / "tokenizer.json").is_file() else f"{verb} with the tokenizer it was trained with, or ")
    other = "start a new run in another run.output_dir" if resumed else "train from scratch (no checkpoint.init_from)"
    raise ConfigError(f"tokenizer: {checkpoint} was trained with another tokenizer ({shown(saved)}) than this run's "
                      f"({shown(record)}): its token ids would mean other words; {way}{other}")


def data_record(data: DataConfig) -> dict:
    """What a checkpoint records of the data files it was trained on (train_state.json's data_files): each file's size
    and a digest of sampled blocks (files.data_fingerprint), by key: every resolved list of data.source=files
    (files.file_lists), or data.source=prepared's manifest (prepared.json: make prepare writes it anew, with the
    files' list and the store's counts), or data.source=store's manifest (store.json: its shards' counts). A mixture's dataset source that is a local directory records the data files
    under it (data.mixture[i].dataset_name: files.dataset_files). The sample and the Hub record none."""
    from .data.files import SAMPLING, data_fingerprint, dataset_files, file_lists
    from .data.prepared import PREPARED_META
    from .data.store import STORE_META
    lists = (file_lists(data) if data.source == "files" else
             {"data.prepared_dir": [str(Path(data.prepared_dir) / PREPARED_META)]} if data.source == "prepared" else
             {"data.store_dir": [str(Path(data.store_dir) / STORE_META)]} if data.source == "store" else {})
    for i, source in enumerate(data.mixture or []):
        found = dataset_files(source.dataset_name) if source.dataset_name else []
        if found:
            lists[f"data.mixture[{i}].dataset_name"] = found
    return {"sampling": SAMPLING, "files": data_fingerprint(lists)} if lists else {}


def data_changes(saved: dict, record: dict, since: str) -> list[str]:
    """How this run's data files (data_record) differ from those a checkpoint recorded: under each key both have, a
    file of the checkpoint's at the same path with another size or digest, or one no longer on the disk. A file found
    under another path with the same size and digest is the same file (a copy on a node's own disk, a moved store); a
    key's one file gone and one new is the same file replaced. A file this run no longer names that is still on the
    disk is a list edited in the recipe (another file named on purpose), the config's own [resume] line; files only
    this run has are not a change either (a pattern's new files are left out before: files.resolve_into). Digests
    count only where both were sampled alike (SAMPLING); sizes always."""
    alike = saved.get("sampling") == record.get("sampling")

    def differ(a: list, b: list) -> str | None:   # [path, size, digest] twice -> what changed, or None
        if a[1] != b[1]:
            return f"size {a[1]} -> {b[1]} bytes"
        return f"the same size, {a[1]} bytes, other bytes in its sampled blocks" if alike and a[2] != b[2] else None

    changes = []
    for key, before in saved.get("files", {}).items():
        now = {entry[0]: entry for entry in record.get("files", {}).get(key, [])}
        if not now:   # a list this run does not read (validation_files dropped): the config's own change
            continue
        changes += [f"{key}: {e[0]} changed since {since} ({differ(e, now[e[0]])})" for e in before
                    if e[0] in now and differ(e, now[e[0]])]
        new = [entry for path, entry in now.items() if path not in {e[0] for e in before}]
        gone = [e for e in before if e[0] not in now and not Path(e[0]).exists() and all(differ(e, n) for n in new)]
        if len(gone) == 1 and len(new) == 1:   # one file in the other's place (a store prepared again elsewhere)
            changes.append(f"{key}: {gone[0][0]} changed since {since}: this run reads {new[0][0]} in its place "
                           f"({differ(gone[0], new[0])})")
            continue
        changes += [f"{key}: {path} is gone since {since} (no such file now)" for path, *_ in gone]
    return changes


def check_data_fits(checkpoint: Path | None, record: dict, accept: bool) -> list[str]:
    """A resume's data files (data_record) against those its checkpoint recorded, before anything is written: a file
    rewritten in place since, or gone, is one line naming the key, the file and what changed, and the ways out;
    checkpoint.accept_data_change=true goes on with a [resume] line for each change. A checkpoint that records no
    data (saved before checkpoints did, or trained on the sample or the Hub) resumes as before. -> the lines to
    print."""
    if checkpoint is None:
        return []
    saved = read_train_state(checkpoint).get("data_files")
    changes = data_changes(saved, record, Path(checkpoint).name) if saved and record else []
    if accept:
        return [f"[resume] checkpoint.accept_data_change=true: {change}; the run goes on with the data as it is now"
                for change in changes]
    if changes:
        more = f" (and {len(changes) - 1} more change{'s' * (len(changes) > 2)})" if len(changes) > 1 else ""
        raise ConfigError(f"{changes[0]}{more}: the resumed run would read other data than {checkpoint} was trained "
                          "on; restore the file, start a new run (another run.output_dir), or set "
                          "checkpoint.accept_data_change=true to go on knowingly")
    return []


def resumed_checkpoint(output_dir: str | Path, resume: str | None) -> Path | None:
    """The checkpoint a resume would start from, as preflight sees it (auto: the latest complete one)."""
    if resume == "auto":
        return (complete_checkpoints(output_dir)[-1:] or [None])[0]
    return Path(resume) if resume else None
