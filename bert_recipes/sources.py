"""Where a run's text and tokenizer come from: the embedded sample, the Hub or local files (always through
`datasets`), a tokenizer loaded or trained once on rank 0, and prepared data (`make prepare`: tokenized and
packed once, memory-mapped by every rank, checked against the recipe). The checks the preflight makes of
data files and prepared directories are here too. No torch at import time."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

from .config import ConfigError, DataConfig, TaskConfig, TokenizerConfig, first_line, path_kind
from .corpora import check_kinds, corrupt_file, resolve_data_files, resolve_files
from .ranks import on_rank0
from .tasks import TASKS
from .tokenizing import TOKENIZE_VERSION


def check_data_files(data: DataConfig) -> dict[str, list[str]]:
    """data.source=files: every entry (a file, a directory, a glob pattern; compressed or not) resolved through
    datasets (bert_recipes/corpora.py), every file readable, with bytes, of one format.
    -> {'train': [...], 'validation': [...]}"""
    return resolve_data_files(data)


def load_raw(data: DataConfig, task: TaskConfig, seed: int):
    """-> DatasetDict of raw rows: 'train', 'eval', and 'eval:<split>' / 'test:<split>' for
    data.extra_eval_splits / data.test_splits."""
    from datasets import DatasetDict, load_dataset

    if data.mixture:
        return load_mixture(data, task, seed)
    if data.source == "sample":
        from .sample import build_sample
        build_sample(data.sample_dir)   # idempotent; call under main_process_first
        root = Path(data.sample_dir)
        builder, path, splits = TASKS[task.kind].sample   # the sample's files this task kind trains on
        files = {s: str(root / path.format(split=s)) for s in splits}
        raw = load_dataset(builder, data_files=files, cache_dir=data.cache_dir)
    elif data.source == "hub":
        try:
            raw = load_dataset(data.dataset_name, data.dataset_config, cache_dir=data.cache_dir)
        except OSError as err:   # only the Hub out of reach with nothing cached; any other error is the library's
            import datasets
            if not hub_unreachable(err, datasets.config.HF_HUB_OFFLINE):
                raise
            named = f"data.dataset_name={data.dataset_name}" + (f" (data.dataset_config={data.dataset_config})"
                                                                 if data.dataset_config else "")
            cache = (f"{data.cache_dir} (data.cache_dir)" if data.cache_dir else
                     f"{datasets.config.HF_DATASETS_CACHE} (datasets' own: data.cache_dir is unset)")
            raise ConfigError(
                f"{named}: the Hub cannot be reached and the dataset is not in the cache {cache}; "
                f"{offline_note(datasets.config.HF_HUB_OFFLINE, ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE'))}: on a node "
                "that reaches the Hub, run make prepare RECIPE=<this recipe> (it downloads into that cache and writes "
                "prepared data: then --data.source=prepared --data.prepared_dir=OUT), or point data.cache_dir / "
                "HF_HOME at shared storage that holds the download") from None
    else:
        files = check_data_files(data)
        every = sum(files.values(), [])
        builder = check_kinds(every)
        try:
            raw = load_dataset(builder, data_files=files, cache_dir=data.cache_dir)
        except Exception as err:   # pyarrow / pandas parse errors, a header without rows, files that disagree,
            cause = err            # a corrupt compressed file
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            corrupt = corrupt_file(every)
            if corrupt:
                key = "data.train_files" if corrupt.split(" is a corrupt")[0] in files["train"] else "data.validation_files"
                raise ConfigError(f"{key}: {corrupt}: replace it with a good copy, or leave it out") from None
            shown = every if len(every) <= 4 else f"[{every[0]}, ... {len(every) - 2} more ..., {every[-1]}]"
            raise ConfigError(f"data files {shown} cannot be read as {builder} ({type(cause).__name__}: "
                              f"{first_line(cause)}); all files need the same columns and at least one row") from None

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
    """data.mixture: each source read with its own format's builder, its evaluation share held out (seeded), cut to
    data.max_train_samples / data.max_eval_samples rows, its text column checked. -> DatasetDict with each source's
    'train@<name>' and 'eval@<name>', and 'train' (every source's training rows, in the mixture's order: the
    tokenizer a run trains reads them). Files resolved in preflight (corpora.resolve_into)."""
    from datasets import DatasetDict, concatenate_datasets, load_dataset
    out = {}
    for i, source in enumerate(data.mixture):
        key = f"data.mixture[{i}].files"
        files = resolve_files(list(source.files), key)
        builder = check_kinds(files)
        try:
            train = load_dataset(builder, data_files={"train": files}, cache_dir=data.cache_dir)["train"]
        except Exception as err:   # as load_raw: a corrupt file is named, anything else is one line
            corrupt = corrupt_file(files)
            if corrupt:
                raise ConfigError(f"{key}: {corrupt}: replace it with a good copy, or leave it out") from None
            raise ConfigError(f"{key} (source {source.name}) cannot be read as {builder} ({type(err).__name__}: "
                              f"{first_line(err)}); all its files need the same columns and at least one row") from None
        train, evaluation = hold_out(train, data, seed, f"rows of source {source.name}",
                                     f"give source {source.name} more rows ({key})")
        train, evaluation = limited(train, evaluation, data, f"source {source.name}")
        check_columns(train, data, task, f"source {source.name} ({key})")
        out[f"train@{source.name}"] = train.select_columns([data.text_column])
        out[f"eval@{source.name}"] = evaluation.select_columns([data.text_column])
    out["train"] = concatenate_datasets([out[f"train@{s.name}"] for s in data.mixture])
    return DatasetDict(out)


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


# ---------------------------------------------------------------------------- tokenizer
def train_wordpiece(batches, vocab_size: int, lowercase: bool):
    """A BERT WordPiece tokenizer trained with the `tokenizers` library.

    Not bit-reproducible: the trainer breaks ties between equally frequent merges in hash
    order, so two trainings on the same text can differ slightly. The trained tokenizer is
    saved with the run (and every export), which is what makes a run reproducible."""
    from datasets import is_progress_bar_enabled
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    # its bar follows datasets' switch (logging.progress_bar: data.data_progress_bars); off a terminal it is hidden
    # but still prints an empty line per stage
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, min_frequency=2,
                                        show_progress=is_progress_bar_enabled())
    tok.train_from_iterator(batches, trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return BertTokenizerFast(tokenizer_object=tok, do_lower_case=lowercase, unk_token="[UNK]", sep_token="[SEP]",
                             pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


def get_tokenizer(tok_cfg: TokenizerConfig, model_name_or_path: str | None, train_raw, data: DataConfig,
                  save_dir: Path, is_main: bool, broadcast=lambda obj: obj):
    """Load the configured tokenizer, or train one (on rank 0, once). A tokenizer already in save_dir
    (a resumed run) is reused, so resumes tokenize identically. A trained tokenizer reaches the other
    ranks as rank 0's files over `broadcast`, so nodes need not share a disk for it."""
    from transformers import AutoTokenizer

    name = tok_cfg.name_or_path or model_name_or_path
    if name:
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as err:
            from huggingface_hub import constants
            key = "tokenizer.name_or_path" if tok_cfg.name_or_path else "model.name_or_path"
            if hub_unreachable(err, constants.HF_HUB_OFFLINE):   # a local directory was checked in preflight
                raise ConfigError(
                    f"{key}={name}: the Hub cannot be reached and the tokenizer is not in the cache "
                    f"{constants.HF_HUB_CACHE} (huggingface_hub's, under HF_HOME); "
                    f"{offline_note(constants.HF_HUB_OFFLINE, ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'))}: on a node "
                    "that reaches the Hub, run make prepare RECIPE=<this recipe> (it saves the tokenizer beside the "
                    "prepared data: then --data.source=prepared --data.prepared_dir=OUT), or point HF_HOME at shared "
                    "storage that holds the download, or give a local tokenizer directory") from None
            raise ConfigError(f"{key}={name}: cannot load a tokenizer from it ({first_line(err)}); give a directory with "
                              "tokenizer files (an export's model/ has them) or a Hub name") from None
    # Only rank 0 looks at the disk and decides. A trained tokenizer goes to a cache keyed by the
    # training data, outside output_dir: the run copies it in once it starts writing, so a run
    # refused later (too little data, a bad setting) leaves its output_dir untouched.
    def rank0_files():
        source = save_dir if (save_dir / "tokenizer.json").exists() else _trained_tokenizer_dir(train_raw, data, tok_cfg)
        if not (source / "tokenizer.json").exists():
            from .disk import full_disk_is_one_line
            tokenizer = train_wordpiece(texts(train_raw, data), tok_cfg.vocab_size, tok_cfg.lowercase)
            tmp = source.with_name(source.name + f".tmp{os.getpid()}")
            needed = (len(tokenizer.backend_tokenizer.to_str()) * 2, "an estimate: twice its tokenizer.json")
            then = "nothing was trained and the output directory is untouched: free space there, then run again"
            try:
                with full_disk_is_one_line("the trained tokenizer", tmp, 0, needed, then):
                    tokenizer.save_pretrained(tmp)
            except Exception:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            try:
                os.replace(tmp, source)
            except OSError:   # another run trained the same one meanwhile: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
        return {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    files = on_rank0(is_main, broadcast, rank0_files)   # every rank: rank 0's tokenizer files
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        for name, content in files.items():
            (Path(tmp) / name).write_bytes(content)
        return AutoTokenizer.from_pretrained(tmp)


def _trained_tokenizer_dir(train_raw, data: DataConfig, tok_cfg: TokenizerConfig) -> Path:
    import datasets
    key = json.dumps([train_raw._fingerprint, data.text_column, data.text_pair_column, tok_cfg.vocab_size,
                      tok_cfg.lowercase, TOKENIZE_VERSION])
    root = Path(data.cache_dir) if data.cache_dir else Path(datasets.config.HF_DATASETS_CACHE)
    return root / "bert_recipes_tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


# ---------------------------------------------------------------------------- prepared data (make prepare)
PREPARED_META = "prepared.json"


def tokenizer_identity(name: str | None) -> str | None:
    """A tokenizer as prepared data records it: a Hub name as it is; a local directory by the content of
    its files (sha256:...), so the data stays usable where the directory sits elsewhere (another
    node's mount, the GPU machine, a moved checkout)."""
    if not name or not Path(name).expanduser().is_dir():
        return name
    digest = hashlib.sha256()
    for path in sorted(Path(name).expanduser().iterdir()):
        if path.is_file() and (path.name.startswith(("tokenizer", "vocab", "merges", "special_tokens"))):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return "sha256:" + digest.hexdigest()[:32]


# Keys of the prepared signature that came later, with what data prepared before them holds
SIGNATURE_BEFORE = {"data.document_mask": False}


def prepared_signature(data: DataConfig, task: TaskConfig, tok: TokenizerConfig, model_name_or_path: str | None) -> dict:
    """The settings that decide a run's tokens: prepared data is used only by a recipe that agrees."""
    named = tok.name_or_path or model_name_or_path
    return {"task.kind": task.kind, "task.num_labels": task.num_labels if TASKS[task.kind].labelled else None,
            "task.label_names": task.label_names,
            "tokenizer": tokenizer_identity(named),
            "tokenizer.vocab_size": tok.vocab_size if not named else None,
            **{f"data.{k}": getattr(data, k) for k in (
                "max_seq_length", "packing", "document_mask", "text_column", "text_pair_column", "label_column",
                "train_split", "eval_split",
                "extra_eval_splits", "test_splits", "max_train_samples", "max_eval_samples",
                "validation_split_percentage")}}


def check_prepared_dir(data: DataConfig) -> Path:
    root = Path(data.prepared_dir)
    kind = path_kind(root, "data.prepared_dir")
    if kind == "dir":
        path_kind(root / PREPARED_META, "data.prepared_dir")   # a directory this user cannot look into
    if kind == "file":
        raise ConfigError(f"data.prepared_dir={root} is a file, not a directory: give the directory make prepare wrote")
    if not (root / PREPARED_META).is_file():
        raise ConfigError(f"data.prepared_dir={root} holds no prepared data ({PREPARED_META} missing): write it with "
                          "make prepare RECIPE=<this recipe> (tools/prepare.py)")
    return root


def load_prepared(data: DataConfig, task: TaskConfig, tok: TokenizerConfig, model_name_or_path: str | None):
    """-> (tokenizer, memory-mapped splits, test_index) from data.prepared_dir, checked against the recipe."""
    from datasets import DatasetDict
    from transformers import AutoTokenizer
    root = check_prepared_dir(data)
    meta = json.loads((root / PREPARED_META).read_text())
    expected = prepared_signature(data, task, tok, model_name_or_path)
    given = tok.name_or_path or model_name_or_path   # data prepared before tokenizer_identity: a path
    prepared = {**SIGNATURE_BEFORE, **meta["signature"]}   # a key added since: the value of the data it was written for
    differ = [f"{k}: prepared {prepared.get(k)!r}, this run {v!r}" for k, v in expected.items()
              if k != "data.source" and prepared.get(k) != v and not (k == "tokenizer" and prepared.get(k) == given)]
    if differ:
        raise ConfigError(f"data.prepared_dir={root} was prepared with other settings ({'; '.join(differ)}): prepare "
                          "it again with this recipe")
    if task.label_names is None and meta.get("label_names"):   # text labels, named when prepared
        task.label_names = meta["label_names"]
    splits = DatasetDict.load_from_disk(str(root / "data"))
    return AutoTokenizer.from_pretrained(str(root / "tokenizer")), splits, meta["test_index"]
