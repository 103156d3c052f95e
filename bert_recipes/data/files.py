"""Data files as corpora ship: many shards, compressed, named by a glob pattern or a directory. Each entry of
data.train_files / data.validation_files is resolved by `datasets` itself (datasets.data_files.resolve_pattern,
the glob `load_dataset` uses), once, before a rank starts: the resolved list replaces the entries in the run's
resolved config, so a resume reads the same files in the same order, and datasets' cache (keyed by each file's
path and mtime) follows the files, never the pattern's text. No torch at import time.

    an existing file     read as it is (the form every list had before)
    a directory          every file of the kinds below under it, at any depth (datasets' `**`), sorted by path
    a glob pattern       its matches (datasets' glob: `*` within a directory, `**` across them), sorted by path
    compressed           .gz, .bz2, .xz (Python's own codecs); .zst with the zstandard package (requirements.txt)

Hidden files (a leading dot) are skipped, as datasets skips them. The entries' order is kept: a list
[shards/*.txt.gz, extra.txt] reads the shards in sorted order, then extra.txt.

A file's fingerprint (data_fingerprint: its size and a digest of a few sampled blocks) is what a checkpoint records
of it, so a resume sees a file rewritten in place since (checkpoint.data_record, check_data_fits).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import zlib
from pathlib import Path

from ..config import ConfigError, DataConfig, first_line, path_kind

FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
           ".conll": "conll"}   # CoNLL-2003's columns (conll_sentences): read as text, then grouped
# suffix -> (what it is, the module fsspec/datasets decompress it with). Parquet compresses inside its own
# pages: a compressed parquet file is refused.
COMPRESSIONS = {".gz": ("gzip", "gzip"), ".bz2": ("bzip2", "bz2"), ".xz": ("xz", "lzma"), ".zst": ("zstd", "zstandard")}
FILE_KEYS = ("data.train_files", "data.validation_files")
# Names a download in progress has (huggingface_hub: .incomplete; wget/aria2 and browsers: .partial, .part,
# .crdownload, .aria2; many copy tools: .tmp): such a file is read half-written, or not at all, when the run starts.
IN_PROGRESS = (".incomplete", ".partial", ".part", ".crdownload", ".aria2", ".tmp")


def kind_of(path: str) -> tuple[str | None, str | None]:
    """-> (datasets builder, compression) from the file's name: part-00000.txt.gz -> ("text", "gzip")."""
    name = Path(path).name.lower()
    compression = next((c for s, (c, _) in COMPRESSIONS.items() if name.endswith(s)), None)
    if compression:
        name = name[:name.rfind(".")]
    return FORMATS.get(Path(name).suffix), compression


def conll_sentences(lines, name: str):
    """CoNLL-2003's column files read as text lines -> a Dataset of sentences: {tokens: the first column, ner_tags:
    the last}, a blank line ending a sentence, -DOCSTART- lines skipped. A line of one column is one line naming
    the file and the line."""
    from datasets import Dataset
    tokens, tags, words, labels = [], [], [], []
    for number, line in enumerate(list(lines) + [""], 1):
        cells = line.split()
        if not cells or cells[0] == "-DOCSTART-":
            if words:
                tokens.append(words)
                tags.append(labels)
                words, labels = [], []
            continue
        if len(cells) < 2:
            raise ConfigError(f"{name}: line {number} ({line.strip()[:40]!r}) has one column; a CoNLL file has a word "
                              "and its tag on each line (the tag last), sentences apart by a blank line")
        words.append(cells[0])
        labels.append(cells[-1])
    return Dataset.from_dict({"tokens": tokens, "ner_tags": tags})


def readable_compressions() -> list[str]:
    """The compressed suffixes this installation decompresses (.zst only with the zstandard package)."""
    return [s for s, (_, module) in COMPRESSIONS.items() if importlib.util.find_spec(module) is not None]


def _allowed() -> list[str]:
    return list(FORMATS)   # resolve_pattern keeps a name with any of these among its suffixes: a.txt.gz too


def resolve_entries(entries: list[str], key: str) -> list[str]:
    """Each entry -> the files it names, through datasets' resolve_pattern; every pattern or directory must
    name at least one file. Paths of relative entries stay relative to the working directory."""
    from datasets.data_files import contains_wildcards, resolve_pattern

    cwd = os.getcwd()
    out = []
    for entry in entries:
        kind = path_kind(entry, key)
        if kind == "file":
            out.append(entry)
            continue
        if kind == "missing" and not contains_wildcards(entry):
            sample = Path(DataConfig.sample_dir)   # the embedded sample's place, which recipes may name
            hint = (f" (the embedded sample's text: build it with python -m bert_recipes.data.sample {sample}, as make demo "
                    "does)") if Path(entry).parts[:len(sample.parts)] == sample.parts else ""
            raise ConfigError(f"{key}: data file not found: {entry}{hint}")
        base, pattern = (str(Path(entry).expanduser().resolve()), "**") if kind == "dir" else (cwd, os.path.expanduser(entry))
        try:
            matched = resolve_pattern(pattern, base_path=base, allowed_extensions=_allowed())
        except FileNotFoundError:
            kinds = f"{sorted(FORMATS)}, or those compressed ({', '.join(readable_compressions())})"
            if kind == "dir":
                raise ConfigError(f"{key}: {entry} is a directory without a data file of the kinds datasets reads "
                                  f"here ({kinds}): give a directory of data files, or the files") from None
            raise ConfigError(f"{key}: the pattern {entry} matches no data file of the kinds datasets reads here "
                              f"({kinds}): check it (datasets' glob: * within a directory, ** across them)") from None
        absolute = Path(entry).expanduser().is_absolute()
        out += sorted(m if absolute else os.path.relpath(m, cwd) for m in matched)
    return out


def check_kinds(files: list[str]) -> str:
    """One format for every file of a run (datasets reads them with one builder), each compression one this
    installation can decompress. -> the builder."""
    by_kind: dict[str, list[str]] = {}
    for f in files:
        in_progress = next((s for s in IN_PROGRESS if f.lower().endswith(s)), None)
        if in_progress:
            raise ConfigError(f"data file {f} looks like a download in progress (its name ends in {in_progress}): "
                              "wait until the download finishes (it is renamed then) and run again, or remove the "
                              "file")
        builder, compression = kind_of(f)
        if builder is None:
            raise ConfigError(f"data file {f}: use one of the formats {sorted(FORMATS)} (all the same), plain or "
                              f"compressed ({', '.join(readable_compressions())})")
        if compression and builder == "parquet":
            raise ConfigError(f"data file {f}: parquet compresses inside the file; give the .parquet file itself")
        module = next(m for c, m in COMPRESSIONS.values() if c == compression) if compression else None
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"data file {f}: reading {compression} needs the {module} package, which is not "
                              f"installed: pip install {module}, or decompress the file")
        by_kind.setdefault(builder, []).append(f)
    if len(by_kind) > 1:
        shown = "; ".join(f"{b}: {len(fs)} file{'s' * (len(fs) > 1)}, e.g. {fs[0]}" for b, fs in sorted(by_kind.items()))
        raise ConfigError(f"data files of different formats in one run ({shown}): datasets reads a run's files "
                          "with one builder; give files of one format (convert the others)")
    return next(iter(by_kind))


def resolve_data_files(data: DataConfig) -> dict[str, list[str]]:
    """data.source=files: every entry resolved, every file readable and not empty, one format.
    -> {'train': [...], 'validation': [...]} (no 'validation' without data.validation_files)."""
    files = {"train": resolve_files(list(data.train_files or []), "data.train_files")}
    if data.validation_files:
        files["validation"] = resolve_files(list(data.validation_files), "data.validation_files")
    check_kinds(sum(files.values(), []))
    return files


def resolve_files(entries: list[str], key: str) -> list[str]:
    """One list of entries (data.train_files, a source's files) resolved, each file readable and not empty."""
    files = resolve_entries(entries, key)
    for f in files:
        if not os.access(f, os.R_OK):
            raise ConfigError(f"{key}={f} cannot be read (permission denied): give a file this user can read")
        if Path(f).stat().st_size == 0:
            raise ConfigError(f"{key}: {f} is empty; give a file with rows")
    return files


def file_lists(data: DataConfig) -> dict[str, list[str]]:
    """Every list of files the run reads, by its key: data.train_files and data.validation_files, or each source's
    (data.mixture[i].files; a dataset source has none)."""
    if data.mixture:
        return {f"data.mixture[{i}].files": list(source.files) for i, source in enumerate(data.mixture)
                if not source.dataset_name}
    return {key: list(value) for key, value in zip(FILE_KEYS, (data.train_files, data.validation_files)) if value}


def dataset_files(name: str) -> list[str]:
    """A dataset named by a local directory (a mixture's dataset source): the data files under it that datasets reads
    (resolve_entries' directory rule, sorted by path); [] for a Hub name or a directory without such files (a
    checkpoint records nothing of those)."""
    from ..config import looks_local
    if not (looks_local(name) or Path(name).expanduser().is_dir()):
        return []
    try:
        return resolve_entries([name], "dataset_name")
    except ConfigError:
        return []


def describe(files: list[str], key: str) -> str:
    """One line: count, total size, first and last names."""
    size = sum(Path(f).stat().st_size for f in files)
    compressed = sorted({c for c in (kind_of(f)[1] for f in files) if c})
    names = files[0] if len(files) == 1 else f"{files[0]} ... {files[-1]}"
    return (f"[data] {key}: {len(files)} file{'s' * (len(files) > 1)}, {_size(size)} on disk"
            f"{' (' + ', '.join(compressed) + ')' if compressed else ''}: {names} (each pattern's and directory's "
            "files sorted by path; written into the run's config)")


def _size(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n_bytes < 1024 or unit == "TiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024


def resolve_into(data: DataConfig, checkpoint_files: dict[str, list | None] | None = None) -> list[str]:
    """Resolve every file list (file_lists: data.train_files / data.validation_files, or each source of data.mixture)
    and write the lists into `data`, so the run's resolved config holds them. A resume whose entries now name more
    files than the checkpoint's run read (a shard added to the directory) reads the checkpoint's files, in their
    order, with one line. -> the lines to print."""
    if data.source != "files":
        return []
    notes, resolved = [], {}
    for key, given in file_lists(data).items():
        now, before = resolve_files(given, key), (checkpoint_files or {}).get(key) or []
        if data.mixture:   # a source's files are one format; sources may differ
            check_kinds(now)
        grown = [f for f in now if f not in set(before)]
        by_pattern = any(not Path(e).expanduser().is_file() for e in given)
        keep = by_pattern and before and grown and set(before) <= set(now) and all(Path(f).is_file() for f in before)
        resolved[key] = list(before) if keep else now
        notes.append(describe(resolved[key], key))
        if keep:
            notes.append(f"[resume] {key}: {given} now names {len(grown)} file{'s' * (len(grown) > 1)} the "
                         f"checkpoint's run did not read ({grown[0]}{' ...' if len(grown) > 1 else ''}): the resume "
                         f"reads that run's {len(before)} files, in their order; to train on the new ones, start a "
                         "new run (another run.output_dir, or --run.overwrite=true)")
    if data.mixture:
        for i, source in enumerate(data.mixture):
            source.files = resolved.get(f"data.mixture[{i}].files", source.files)   # a dataset source: none
        return notes
    check_kinds(sum(resolved.values(), []))
    data.train_files = resolved[FILE_KEYS[0]]
    if FILE_KEYS[1] in resolved:
        data.validation_files = resolved[FILE_KEYS[1]]
    return notes


def same_files_on_every_rank(data: DataConfig, group) -> None:
    """Each rank resolved the file lists itself (preflight), on its node's view of the disk: a node whose copy of
    a directory lacks a shard, holds one more, or one still being copied, would train on other data. The lists
    (names, sizes) are compared across the ranks, once, before any data is read: one line on every rank."""
    if data.source != "files" or group is None:
        return
    from ..ranks import spread
    files = sum(file_lists(data).values(), [])
    sizes = [Path(f).stat().st_size for f in files]
    digest = float(zlib.crc32(json.dumps(list(zip(files, sizes))).encode()))   # below 2**32: exact in float64
    low, high = spread(digest, group)
    if low != high:
        here = f"rank {os.environ.get('RANK', '0')}: {len(files)} file{'s' * (len(files) > 1)}, {_size(sum(sizes))}"
        keys = "data.mixture's files" if data.mixture else ", ".join(FILE_KEYS)
        raise ConfigError(f"{keys}: the ranks resolved different files ({here}; another rank's node "
                          "sees other names or sizes): give every node the same files (a shared filesystem, or "
                          "complete copies on each node)")


# A file's fingerprint reads SAMPLED_BLOCKS blocks of BLOCK_BYTES (the first, the last, the rest evenly between): 32 KiB
# of any file, one open and 8 reads of a 1 GiB shard, so a terabyte in 1,000 shards costs 8,000 reads, not a pass over
# it. A file up to 32 KiB is read whole (the blocks overlap). Modification times are left out: a node-local copy of the
# same file has its own, and a copy tool may or may not keep them.
SAMPLED_BLOCKS, BLOCK_BYTES = 8, 4096
SAMPLING = f"blake2b-128 of the size and {SAMPLED_BLOCKS} blocks of {BLOCK_BYTES} bytes"   # recorded beside the digests


def sampled_digest(path: str) -> tuple[int, str]:
    """-> (size in bytes, the hex digest of the size and the sampled blocks). The same size with one byte changed in
    a sampled block gives another digest; a change between the blocks of a large file goes unseen (a sample, not a
    checksum: a full pass over a terabyte at each start is what this avoids)."""
    size = os.stat(path).st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    last = max(size - BLOCK_BYTES, 0)
    with open(path, "rb") as stream:
        for offset in sorted({i * last // (SAMPLED_BLOCKS - 1) for i in range(SAMPLED_BLOCKS)}):
            stream.seek(offset)
            digest.update(stream.read(BLOCK_BYTES))
    return size, digest.hexdigest()


def data_fingerprint(lists: dict[str, list[str]]) -> dict[str, list[list]]:
    """{key: [[path, size, digest], ...]} for each list of files (file_lists' keys: the resolved data.train_files, a
    source's files; or a prepared store's manifest), each file by sampled_digest."""
    return {key: [[path, *sampled_digest(path)] for path in paths] for key, paths in lists.items()}


def corrupt_file(files: list[str]) -> str | None:
    """After datasets failed to read the files: the first compressed file that does not decompress, with
    where it breaks (decompressed through fsspec, datasets' own opener). None when every one does."""
    import fsspec
    for f in files:
        if not kind_of(f)[1]:
            continue
        done, lines = 0, 0
        try:
            with fsspec.open(f, "rb", compression="infer") as stream:
                while chunk := stream.read(1 << 16):   # 64 KiB: where it breaks, to within one read
                    done += len(chunk)
                    lines += chunk.count(b"\n")
        except Exception as err:   # gzip.BadGzipFile, EOFError, lzma.LZMAError, OSError: every codec has its own
            return (f"{f} is a corrupt {kind_of(f)[1]} file ({type(err).__name__}: {first_line(err)}), in its "
                    f"decompressed bytes from {done} on (line {lines + 1})")
    return None
