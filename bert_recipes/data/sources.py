"""Where a run's text comes from: one reader per source kind (data.source: the embedded sample, the Hub, local
files; always through `datasets`), which the single source and a mixture's sources both call; a split held out for
evaluation, the rows cut to data.max_*_samples, the columns checked; the Hub out of reach told in one line. The
tokenizer is bert_recipes/data/tokenizer.py's, prepared data prepared.py's. No torch at import time."""
from __future__ import annotations

import math
import os
from pathlib import Path

from ..config import ConfigError, DataConfig, TaskConfig, first_line
from ..tasks import TASKS
from .files import check_kinds, corrupt_file, resolve_data_files, resolve_files


def check_data_files(data: DataConfig) -> dict[str, list[str]]:
    """data.source=files: every entry (a file, a directory, a glob pattern; compressed or not) resolved through
    datasets (bert_recipes/data/files.py), every file readable, with bytes, of one format.
    -> {'train': [...], 'validation': [...]}"""
    return resolve_data_files(data)


# ---------------------------------------------------------------------------- a reader per source kind
def read_sample(data: DataConfig, task: TaskConfig):
    """data.source=sample: the embedded sample's files that the task kind trains on (its row's `sample`), built into
    data.sample_dir first (idempotent; call under main_process_first). -> DatasetDict of its splits."""
    from datasets import load_dataset

    from .sample import build_sample
    build_sample(data.sample_dir)
    builder, path, splits = TASKS[task.kind].sample
    files = {s: str(Path(data.sample_dir) / path.format(split=s)) for s in splits}
    return load_dataset(builder, data_files=files, cache_dir=data.cache_dir)


def read_hub(data: DataConfig, task: TaskConfig):
    """data.source=hub: data.dataset_name (and data.dataset_config) from the Hub or datasets' cache. -> DatasetDict of
    its splits."""
    return read_dataset(data.dataset_name, data.dataset_config, data, "data.dataset_name", "data.dataset_config",
                        data.dataset_revision)


def read_dataset(name: str, config: str | None, data: DataConfig, name_key: str, config_key: str,
                 revision: str | None = None):
    """A dataset by name (data.source=hub, a mixture's dataset source): a Hub name or a local directory
    datasets.load_dataset reads, from the Hub or datasets' cache; the Hub out of reach with nothing cached is one line
    naming the keys. -> DatasetDict of its splits."""
    import datasets
    try:
        return datasets.load_dataset(name, config, cache_dir=data.cache_dir, revision=revision)
    except OSError as err:   # only the Hub out of reach with nothing cached; any other error is the library's
        if not hub_unreachable(err, datasets.config.HF_HUB_OFFLINE):
            raise
        named = f"{name_key}={name}" + (f" ({config_key}={config})" if config else "")
        cache = (f"{data.cache_dir} (data.cache_dir)" if data.cache_dir else
                 f"{datasets.config.HF_DATASETS_CACHE} (datasets' own: data.cache_dir is unset)")
        fetch = ("run make prepare RECIPE=<this recipe> OUT=DIR (it downloads and tokenizes the data: then "
                 "--data.cache_dir=DIR for packed MLM, --data.source=prepared --data.prepared_dir=DIR for the rest)"
                 if not data.mixture else f"load it once into that cache (python -c \"import datasets; datasets.load_dataset('{name}'"
                 + (f", '{config}'" if config else "") + (f", cache_dir='{data.cache_dir}'" if data.cache_dir else "")
                 + ")\")")
        raise ConfigError(
            f"{named}: the Hub cannot be reached and the dataset is not in the cache {cache}; "
            f"{offline_note(datasets.config.HF_HUB_OFFLINE, ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE'))}: on a node "
            f"that reaches the Hub, {fetch}, or point data.cache_dir / HF_HOME at shared storage that holds the "
            "download") from None


def read_files(files: dict[str, list[str]], data: DataConfig, key_of, named: str):
    """Local files (data.source=files, a mixture's source): {split: resolved paths} read with their format's builder
    (csv, json lines, parquet, text; compressed or not). A corrupt file is one line naming it under its key
    (`key_of(path)`), any other failure one line naming the files (`named`). -> DatasetDict of its splits."""
    from datasets import load_dataset
    every = sum(files.values(), [])
    builder = check_kinds(every)
    if builder == "conll":   # CoNLL-2003's columns: its lines as text, grouped into sentences
        from datasets import DatasetDict

        from .files import conll_sentences
        lines = load_dataset("text", data_files=files, cache_dir=data.cache_dir)
        return DatasetDict({split: conll_sentences(rows["text"], named) for split, rows in lines.items()})
    try:
        return load_dataset(builder, data_files=files, cache_dir=data.cache_dir)
    except Exception as err:   # pyarrow / pandas parse errors, a header without rows, files that disagree,
        cause = err            # a corrupt compressed file
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        corrupt = corrupt_file(every)
        if corrupt:
            raise ConfigError(f"{key_of(corrupt.split(' is a corrupt')[0])}: {corrupt}: replace it with a good copy, "
                              "or leave it out") from None
        raise ConfigError(f"{named} cannot be read as {builder} ({type(cause).__name__}: {first_line(cause)}); all "
                          "files need the same columns and at least one row") from None


def read_data_files(data: DataConfig, task: TaskConfig):
    """data.source=files: data.train_files and data.validation_files, resolved (check_data_files)."""
    files = check_data_files(data)
    every = sum(files.values(), [])
    shown = every if len(every) <= 4 else f"[{every[0]}, ... {len(every) - 2} more ..., {every[-1]}]"
    return read_files(files, data, lambda path: "data.train_files" if path in files["train"] else
                      "data.validation_files", f"data files {shown}")


READERS = {"sample": read_sample, "hub": read_hub, "files": read_data_files}   # data.source -> its reader


# ---------------------------------------------------------------------------- splits
def data_cache(data: DataConfig) -> Path:
    """Where datasets writes this run's caches (and a packed MLM run its token stores: store_cache.py): data.cache_dir,
    else the library's own."""
    import datasets
    return Path(data.cache_dir) if data.cache_dir else Path(datasets.config.HF_DATASETS_CACHE)


def load_raw(data: DataConfig, task: TaskConfig, seed: int):
    """-> DatasetDict of raw rows: 'train', 'eval', and 'eval:<split>' / 'test:<split>' for
    data.extra_eval_splits / data.test_splits (data.mixture: load_mixture's)."""
    from datasets import DatasetDict

    if data.mixture:
        return load_mixture(data, task, seed)
    raw = READERS[data.source](data, task)
    if data.train_split not in raw:
        raise ConfigError(f"data.train_split='{data.train_split}' not in the dataset's splits {list(raw)}")
    train = raw[data.train_split]
    if data.eval_split in raw:
        evaluation = raw[data.eval_split]
    elif set(raw) - {data.train_split}:
        raise ConfigError(f"data.eval_split='{data.eval_split}' not in the dataset's splits {list(raw)}")
    else:   # train is the only split: hold out a seeded share of it
        train, evaluation = hold_out(train, data, seed, "training rows", "give more rows, or an evaluation split of its own "
                                     "(data.validation_files, data.eval_split)")
    train, evaluation = limited(train, evaluation, data, f"data.source={data.source}")
    check_columns(train, data, task, "the training data")
    out = {"train": train, "eval": evaluation}
    for kind, key, names in (("eval", "extra_eval_splits", data.extra_eval_splits), ("test", "test_splits", data.test_splits)):
        for name in names or []:
            if name not in raw:
                raise ConfigError(f"data.{key}: '{name}' is not a split of the dataset (splits: {list(raw)})")
            split = raw[name]
            if kind == "eval" and data.max_eval_samples is not None:
                split = split.select(range(min(data.max_eval_samples, len(split))))
            out[f"{kind}:{name}"] = split
    return DatasetDict(out)




def hold_out(train, data: DataConfig, seed: int, rows_of: str, fix: str) -> tuple:
    """A split with no evaluation split of its own: a seeded data.validation_split_percentage of its rows held out.
    -> (train, evaluation)."""
    rows, percent = len(train), data.validation_split_percentage
    held_out = math.ceil(rows * percent / 100)   # datasets' own rounding (test: ceil, train: the rest)
    if rows - held_out < 1:
        raise ConfigError(f"data.validation_split_percentage={percent} of the {rows} {rows_of} holds out "
                          f"{held_out} for evaluation and leaves {rows - held_out} to train on (at least 1 of "
                          f"each is needed): {fix}")
    held = train.train_test_split(test_size=percent / 100, seed=seed)
    return held["train"], held["test"]


def limited(train, evaluation, data: DataConfig, where: str) -> tuple:
    """Both splits have rows; data.max_train_samples and data.max_eval_samples cut each to its first rows."""
    for name, split in (("training", train), ("evaluation", evaluation)):
        if len(split) == 0:
            raise ConfigError(f"the {name} split has no rows ({where}); check the files or split names")
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if data.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data.max_eval_samples, len(evaluation))))
    return train, evaluation


def check_columns(train, data: DataConfig, task: TaskConfig, what: str) -> None:
    columns = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    if TASKS[task.kind].labelled:
        columns.append(data.label_column)
    for col in columns:
        if col not in train.column_names:
            raise ConfigError(f"column '{col}' not in {what} (columns: {train.column_names}); "
                              f"set data.text_column / data.text_pair_column / data.label_column")


def load_mixture(data: DataConfig, task: TaskConfig, seed: int):
    """data.mixture: each source read by its kind (read_source: its files with their format's builder, or a
    dataset's split), its evaluation share held out (seeded), cut to data.max_train_samples / data.max_eval_samples
    rows, its text column checked. -> DatasetDict with each source's
    'train@<name>' and 'eval@<name>', and 'train' (every source's training rows, in the mixture's order: the
    tokenizer a run trains reads them). Files resolved in preflight (files.resolve_into)."""
    from datasets import DatasetDict, concatenate_datasets
    out = {}
    for i, source in enumerate(data.mixture):
        train, key = read_source(source, f"data.mixture[{i}]", data)
        train, evaluation = hold_out(train, data, seed, f"rows of source {source.name}",
                                     f"give source {source.name} more rows ({key})")
        train, evaluation = limited(train, evaluation, data, f"source {source.name}")
        check_columns(train, data, task, f"source {source.name} ({key})")
        out[f"train@{source.name}"] = train.select_columns([data.text_column])
        out[f"eval@{source.name}"] = evaluation.select_columns([data.text_column])
    out["train"] = concatenate_datasets([out[f"train@{s.name}"] for s in data.mixture])
    return DatasetDict(out)


def read_source(source, at: str, data: DataConfig) -> tuple:
    """A mixture's source, by its kind: its files (read_files) or a dataset (read_dataset: its split, train unless
    given). -> (its training rows, the key lines name it by)."""
    if source.dataset_name:
        key, split = f"{at}.dataset_name", source.split or "train"
        raw = read_dataset(source.dataset_name, source.dataset_config, data, key, f"{at}.dataset_config")
        if split not in raw:
            raise ConfigError(f"{at}.split={split!r} (source {source.name}) is not a split of {source.dataset_name} "
                              f"(splits: {list(raw)}): set {at}.split")
        return raw[split], key
    key = f"{at}.files"
    files = resolve_files(list(source.files), key)
    return read_files({"train": files}, data, lambda path: key, f"{key} (source {source.name})")["train"], key


def texts(dataset, data: DataConfig, batch_size: int = 1000):
    """Iterate batches of non-empty strings from the text (and pair) columns."""
    cols = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start:start + batch_size]
        yield [t for c in cols for t in rows[c] if t and t.strip()]


# ---------------------------------------------------------------------------- the Hub out of reach
# The connect errors of the HTTP clients the libraries have used (requests, httpx, aiohttp), by name: which one a
# version surfaces unwrapped varies, and importing each only to compare would cost more than it tells.
CONNECT_ERRORS = {"ConnectionError", "ConnectError", "ConnectTimeout", "ClientConnectorError"}


def hub_unreachable(err: BaseException, offline: bool) -> bool:
    """The Hub could not be asked (offline mode, no network) and the cache did not hold the answer. Seen offline
    and with a refused connection (datasets 5.2, huggingface_hub 2.4, transformers 5.24): datasets raises
    ConnectionError "Couldn't reach '<name>' on the Hub (OfflineModeIsEnabled | LocalEntryNotFoundError)";
    transformers raises OSError "We couldn't connect to ..." from huggingface_hub's LocalEntryNotFoundError.
    Older datasets said FileNotFoundError "... on the Hub ..." in offline mode. A name the Hub does not know, a
    gated repository or a broken file is none of these: the caller's own message (or the library's) says it."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:   # the whole chain: each library wraps the one below
        seen.add(id(cause))
        if isinstance(cause, (ConnectionError, LocalEntryNotFoundError)):   # OfflineModeIsEnabled is a ConnectionError
            return True
        if any(cls.__name__ in CONNECT_ERRORS for cls in type(cause).__mro__):
            return True
        if offline and isinstance(cause, FileNotFoundError) and "Hub" in str(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def offline_note(offline: bool, variables: tuple[str, ...]) -> str:
    """Whether the library ran in offline mode, and which variables say so (it reads them at import)."""
    given = [f"{v}={os.environ[v]}" for v in variables if os.environ.get(v)]
    if offline:
        return (f"offline mode is on ({', '.join(given) or 'set when the library was imported'}), so the Hub was not "
                "asked")
    return (f"offline mode is off ({', '.join(given) or ' and '.join(variables) + ' unset'}), and the Hub did not "
            "answer from this node")
