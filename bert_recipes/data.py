"""Datasets, tokenizers and collators.

Raw text comes from the embedded sample, the Hub or local files, always through
`datasets`, and is tokenized with `datasets.map` (batched, cached by fingerprint, so a
second run with the same data and tokenizer loads the cached result instead of
re-tokenizing).

MLM masking is a pure function of (seed, epoch, example index): the same example is
masked the same way whichever rank, worker or prefetch order reads it, which is what
makes a resumed run equal an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .config import ConfigError, DataConfig, TaskConfig, TokenizerConfig, first_line

_FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
                  ".csv": "csv", ".parquet": "parquet"}


# ---------------------------------------------------------------------------- raw data
def check_data_files(data: DataConfig) -> dict[str, list[str]]:
    """data.source=files: every file exists and has bytes. -> {'train': [...], 'validation': [...]}"""
    files = {"train": list(data.train_files or [])}
    if data.validation_files:
        files["validation"] = list(data.validation_files)
    for key, paths in (("data.train_files", files["train"]), ("data.validation_files", files.get("validation", []))):
        for f in paths:
            if not Path(f).is_file():
                raise ConfigError(f"{key}: data file not found: {f}")
            if Path(f).stat().st_size == 0:
                raise ConfigError(f"{key}: {f} is empty; give a file with rows")
    return files


def _builder_for(files: list[str]) -> str:
    kinds = {_FILE_BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(f"data files {files}: use one of the formats {sorted(_FILE_BUILDERS)} (all the same)")
    return kinds.pop()


def load_raw(data: DataConfig, task: TaskConfig, seed: int):
    """-> DatasetDict of raw rows: 'train', 'eval', and 'eval:<split>' / 'test:<split>' for
    data.extra_eval_splits / data.test_splits."""
    from datasets import DatasetDict, load_dataset

    if data.source == "sample":
        from .sample import build_sample
        build_sample(data.sample_dir)   # idempotent; call under main_process_first
        root = Path(data.sample_dir)
        if task.kind == "mlm":
            files = {"train": str(root / "pretrain/train.txt"), "validation": str(root / "pretrain/validation.txt")}
            raw = load_dataset("text", data_files=files, cache_dir=data.cache_dir)
        else:
            files = {s: str(root / f"classify/{s}.jsonl") for s in ("train", "validation", "test")}
            raw = load_dataset("json", data_files=files, cache_dir=data.cache_dir)
    elif data.source == "hub":
        raw = load_dataset(data.dataset_name, data.dataset_config, cache_dir=data.cache_dir)
    else:
        files = check_data_files(data)
        try:
            raw = load_dataset(_builder_for(sum(files.values(), [])), data_files=files, cache_dir=data.cache_dir)
        except Exception as err:   # pyarrow / pandas parse errors, a header without rows, files that disagree
            cause = err
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            raise ConfigError(f"data files {sum(files.values(), [])} cannot be read as "
                              f"{_builder_for(sum(files.values(), []))} ({type(cause).__name__}: {first_line(cause)}); "
                              "all files need the same columns and at least one row") from None

    if data.train_split not in raw:
        raise ConfigError(f"data.train_split='{data.train_split}' not in the dataset's splits {list(raw)}")
    train = raw[data.train_split]
    if data.eval_split in raw:
        evaluation = raw[data.eval_split]
    elif set(raw) - {data.train_split}:
        raise ConfigError(f"data.eval_split='{data.eval_split}' not in the dataset's splits {list(raw)}")
    else:   # train is the only split: hold out a seeded share of it
        held = train.train_test_split(test_size=data.validation_split_percentage / 100, seed=seed)
        train, evaluation = held["train"], held["test"]
    for name, split in (("training", train), ("evaluation", evaluation)):
        if len(split) == 0:
            raise ConfigError(f"the {name} split has no rows (data.source={data.source}); check the files or split names")
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if data.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data.max_eval_samples, len(evaluation))))

    columns = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    if task.kind == "classification":
        columns.append(data.label_column)
    for col in columns:
        if col not in train.column_names:
            raise ConfigError(f"column '{col}' not in the training data (columns: {train.column_names}); "
                              f"set data.text_column / data.text_pair_column / data.label_column")
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


def texts(dataset, data: DataConfig, batch_size: int = 1000):
    """Iterate batches of non-empty strings from the text (and pair) columns."""
    cols = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start:start + batch_size]
        yield [t for c in cols for t in rows[c] if t and t.strip()]


# ---------------------------------------------------------------------------- tokenizer
def train_wordpiece(batches, vocab_size: int, lowercase: bool):
    """A BERT WordPiece tokenizer trained with the `tokenizers` library.

    Not bit-reproducible: the trainer breaks ties between equally frequent merges in hash
    order, so two trainings on the same text can differ slightly. The trained tokenizer is
    saved with the run (and every export), which is what makes a run reproducible."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, min_frequency=2)
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
            key = "tokenizer.name_or_path" if tok_cfg.name_or_path else "model.name_or_path"
            raise ConfigError(f"{key}={name}: cannot load a tokenizer from it ({first_line(err)}); give a directory with "
                              "tokenizer files (an export's model/ has them) or a Hub name") from None
    # Only rank 0 looks at the disk and decides. A trained tokenizer goes to a cache keyed by the
    # training data, outside output_dir: the run copies it in once it starts writing, so a run
    # refused later (too little data, a bad setting) leaves its output_dir untouched.
    def rank0_files():
        source = save_dir if (save_dir / "tokenizer.json").exists() else _trained_tokenizer_dir(train_raw, data, tok_cfg)
        if not (source / "tokenizer.json").exists():
            tokenizer = train_wordpiece(texts(train_raw, data), tok_cfg.vocab_size, tok_cfg.lowercase)
            tmp = source.with_name(source.name + f".tmp{os.getpid()}")
            tokenizer.save_pretrained(tmp)
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


# ---------------------------------------------------------------------------- tokenization
TOKENIZE_VERSION = 1   # bump when encode/group below change: it is part of the cache fingerprint


def tokenizer_fingerprint(tokenizer) -> str:
    """A content hash of a fast tokenizer that is the same in every process. (datasets' default
    fingerprint pickles the tokenizer, whose vocabulary is a hash map serialized in random order,
    so every process would compute a different fingerprint and re-tokenize.)"""
    content = json.loads(tokenizer.backend_tokenizer.to_str())
    extra = {k: str(getattr(tokenizer, k, None)) for k in ("model_max_length", "padding_side", "truncation_side")}
    return hashlib.sha256(json.dumps([content, type(tokenizer).__name__, extra], sort_keys=True).encode()).hexdigest()


def _map_splits(dataset_dict, fn, key: list, desc: str, num_proc, remove_columns):
    """datasets.map on each split, with a fingerprint from (split data, key) alone, so the cache is
    found by every rank and by the next run."""
    from datasets import DatasetDict
    out = {}
    for split, ds in dataset_dict.items():
        fingerprint = hashlib.sha256(json.dumps([ds._fingerprint, TOKENIZE_VERSION, *key], default=str)
                                     .encode()).hexdigest()[:32]
        out[split] = ds.map(fn, batched=True, num_proc=num_proc, remove_columns=remove_columns,
                            new_fingerprint=fingerprint, desc=desc)
    return DatasetDict(out)


def tokenize(raw, tokenizer, task: TaskConfig, data: DataConfig, label_names: list[str] | None = None):
    """-> DatasetDict of model inputs. Cached by datasets' fingerprint of (data, function, tokenizer)."""
    seq = data.max_seq_length
    text_cols = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    columns = raw["train"].column_names
    tok_fp = tokenizer_fingerprint(tokenizer)

    if task.kind == "mlm":
        def encode(batch):
            lines = [t for t in batch[data.text_column] if t and t.strip()]
            if data.packing:
                return tokenizer(lines, return_special_tokens_mask=True)
            return tokenizer(lines, truncation=True, max_length=seq, return_special_tokens_mask=True)

        key = ["mlm", tok_fp, seq, data.packing, data.text_column]
        tokenized = _map_splits(raw, encode, key, "tokenizing", data.num_proc, columns)
        if data.packing:
            def group(batch):
                # concatenate every sequence, then cut into full blocks of max_seq_length; the tail is dropped
                joined = {k: list(itertools.chain.from_iterable(batch[k])) for k in batch}
                n = (len(joined["input_ids"]) // seq) * seq
                return {k: [v[i:i + seq] for i in range(0, n, seq)] for k, v in joined.items()}

            tokenized = _map_splits(tokenized, group, key + ["group"], f"packing into {seq}-token blocks",
                                    data.num_proc, None)
        return tokenized

    regression = task.num_labels == 1
    labelled = {k: v for k, v in raw.items() if not k.startswith("test:")}
    mapping = label_mapping(labelled, task, data, label_names)

    def encode(batch):
        args = [batch[c] for c in text_cols]
        out = tokenizer(*args, truncation=True, max_length=seq)
        labels = batch[data.label_column]
        if mapping is not None:
            labels = [mapping[l] for l in labels]
        out["labels"] = [float(l) for l in labels] if regression else [int(l) for l in labels]
        return out

    def encode_unlabelled(batch):   # a test split: its labels are hidden (GLUE: -1) and never used
        out = tokenizer(*[batch[c] for c in text_cols], truncation=True, max_length=seq)
        out["labels"] = [-1.0 if regression else -1] * len(out["input_ids"])
        return out

    from datasets import DatasetDict
    key = ["classification", tok_fp, seq, text_cols, data.label_column, regression, mapping]
    out = dict(_map_splits(DatasetDict(labelled), encode, key, "tokenizing", data.num_proc, columns))
    tests = DatasetDict({k: v for k, v in raw.items() if k.startswith("test:")})
    if tests:
        out.update(_map_splits(tests, encode_unlabelled, key + ["unlabelled"], "tokenizing",
                               data.num_proc, tests[next(iter(tests))].column_names))
    return DatasetDict(out)


def label_mapping(raw, task: TaskConfig, data: DataConfig, label_names: list[str] | None) -> dict | None:
    """Check every label of the train and eval splits before tokenizing; -> {name: id} for string
    labels (task.label_names' order, else sorted), None for numeric ones."""
    col = data.label_column
    feature = raw["train"].features.get(col)
    if getattr(feature, "dtype", None) in ("string", "large_string") and task.num_labels > 1:
        names = label_names or sorted(set(raw["train"][col]))
        if len(names) != task.num_labels:
            raise ConfigError(f"data.label_column '{col}' has {len(names)} distinct labels {names[:10]} but "
                              f"task.num_labels={task.num_labels}; set task.num_labels (or task.label_names)")
        for split in (s for s in raw if not s.startswith("test:")):
            unknown = sorted(set(raw[split][col]) - set(names))
            if unknown:
                raise ConfigError(f"data.label_column '{col}' of the {split} split has labels {unknown[:5]} that "
                                  f"task.label_names={names} does not list; add them or fix the data")
        return {n: i for i, n in enumerate(names)}
    for split in raw:
        if split.startswith("test:"):
            continue
        values = raw[split][col]
        try:
            numbers = [float(v) for v in values]
        except (TypeError, ValueError):
            raise ConfigError(f"data.label_column '{col}' of the {split} split holds non-numeric labels (e.g. "
                              f"{next(v for v in values if not _is_number(v))!r}); for text labels set "
                              "task.num_labels > 1 (and task.label_names)") from None
        if task.num_labels == 1:
            bad = [i for i, v in enumerate(numbers) if not math.isfinite(v)]
            what = "regression targets that are not finite"
        else:
            bad = [i for i, v in enumerate(numbers)
                   if not (math.isfinite(v) and v == int(v) and 0 <= v < task.num_labels)]
            what = f"labels outside [0, task.num_labels={task.num_labels})"
        if bad:
            shown = ", ".join(f"row {i}: {values[i]}" for i in bad[:3])
            raise ConfigError(f"data.label_column '{col}' of the {split} split has {len(bad)} {what} ({shown}); "
                              "fix the data or task.num_labels")
    return None


def _is_number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------- batches of similar length
class LengthGroupedBatches:
    """Micro batches of sequences of similar length, in random order, so little compute goes to padding
    (what transformers' Trainer calls group_by_length). Each epoch: a seeded shuffle, cut into groups of
    `group` optimizer steps, each group sorted by length and cut into micro batches; the steps (runs of
    `step_batches` = global batch / micro batch micro batches, every rank's accumulation included) are
    then shuffled, so the ranks of one step get similar lengths. A pure function of (seed, epoch) and
    the recipe's batch sizes, not of the world size: a resumed epoch is the same epoch, even on another
    number of processes. Accelerate shards batch i to rank i % world and skips a resumed epoch's first
    batches, as for the default sampler."""

    drop_last = True

    def __init__(self, lengths: list[int], batch_size: int, seed: int, step_batches: int = 1, group: int = 50):
        self.lengths, self.batch_size, self.seed, self.step_batches = lengths, batch_size, seed, step_batches
        self.group = group
        self.epoch = 0
        self.sampler = self   # where Accelerate's DataLoaderShard.set_epoch looks for it

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return len(self.lengths) // self.batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(_seed_of(self.seed, self.epoch, -1))
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        span = self.batch_size * self.group * self.step_batches
        batches = []
        for start in range(0, len(order), span):
            chunk = sorted(order[start:start + span], key=lambda i: -self.lengths[i])
            batches += [chunk[i:i + self.batch_size] for i in range(0, len(chunk) - self.batch_size + 1, self.batch_size)]
        steps = [batches[i:i + self.step_batches] for i in range(0, len(batches), self.step_batches)]
        for r in torch.randperm(len(steps), generator=g).tolist():
            yield from steps[r]


# ---------------------------------------------------------------------------- collators
class Indexed(Dataset):
    """Adds each row's index as 'idx', which the MLM collator seeds its masking from.

    `__getitems__` reads a whole micro batch in one Arrow call (the DataLoader's fetcher uses it when
    it exists): row by row, a micro batch of 256 costs 256 table slices and conversions on the
    process that collates (the training process itself with data.num_workers=0); here, one."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return {**self.dataset[int(i)], "idx": int(i)}

    def __getitems__(self, indices) -> list[dict]:
        """Rows `indices` (any sequence of ints: a list, a tuple, a tensor) as __getitem__ gives them."""
        indices = [int(i) for i in indices]
        if not hasattr(self.dataset, "column_names"):   # not a datasets.Dataset (a list of rows): one by one
            return [self[i] for i in indices]
        columns = self.dataset[indices]   # {column: [value of each row]}
        return [{**{k: values[j] for k, values in columns.items()}, "idx": i} for j, i in enumerate(indices)]


def sequence_lengths(dataset, column: str = "input_ids") -> list[int]:
    """The token count of every row, from Arrow's list lengths (no row is converted to Python)."""
    import pyarrow.compute as pc
    values = dataset.with_format("arrow")[column]
    return pc.list_value_length(values).to_pylist()


def length_bins(lengths: list[int], bins: int, multiple: int | None, longest: int | None = None) -> list[int]:
    """At most `bins` padded lengths for batches of these sequences, each rounded up to `multiple` (8 on
    GPUs: tensor cores): the quantiles of `lengths` that leave the least padding when each sequence is
    padded to the smallest bin that holds it (a dynamic program over the histogram of the lengths, so
    the bins sit where the sequences are). The longest length, or `longest` when another split has a
    longer row, is always the last bin. A batch is padded to the smallest bin that holds its longest
    sequence (padded_width), so the same few shapes repeat. -> sorted lengths, or [] for bins=0."""
    import numpy as np
    if not bins or not lengths:
        return []
    step = multiple or 1
    up = lambda n: -(-n // step) * step   # noqa: E731
    histogram = Counter(up(n) for n in lengths)
    histogram[up(max(max(lengths), longest or 0))] += 0
    values = np.array(sorted(histogram), dtype=np.float64)
    if len(values) <= bins:
        return [int(v) for v in values]
    counts = np.array([histogram[int(v)] for v in values], dtype=np.float64)
    below = np.concatenate([[0.0], np.cumsum(counts)])             # below[i]: sequences of value index < i
    below_sum = np.concatenate([[0.0], np.cumsum(counts * values)])
    m = len(values)
    # padding[b][j]: the least padding of the sequences of value index <= j in b bins, the last ending at j
    padding = np.full((bins + 1, m), np.inf)
    back = np.full((bins + 1, m), -1, dtype=np.int64)
    padding[1] = values * below[1:] - below_sum[1:]
    for b in range(2, bins + 1):
        for j in range(b - 1, m):   # the bin before ends at i < j; the sequences of i+1..j pad to values[j]
            i = np.arange(j)
            cost = padding[b - 1, :j] + values[j] * (below[j + 1] - below[i + 1]) - (below_sum[j + 1] - below_sum[i + 1])
            back[b, j] = int(cost.argmin())
            padding[b, j] = cost[back[b, j]]
    edges, j = [], m - 1
    for b in range(bins, 0, -1):
        edges.append(int(values[j]))
        j = back[b, j]
        if j < 0:
            break
    return sorted(edges)


def _seed_of(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return value - 2 ** 64 if value >= 2 ** 63 else value


_MASK64 = [(1 << (64 - k)) - 1 for k in range(64)]   # logical right shift of an int64: (x >> k) & _MASK64[k]


def random_bits(key: int, rows: torch.Tensor, columns: int) -> torch.Tensor:
    """64 random bits (an int64) for each (row id, column), shape (len(rows), columns), each a pure
    function of (key, row id, column): splitmix64 of a counter (Steele et al. 2014), vectorised over the
    whole batch, so example i's values do not depend on which other examples share its batch, worker
    or rank."""
    counter = rows.to(torch.int64)[:, None] * columns + torch.arange(columns) + _signed((key * 0x9E3779B97F4A7C15) % 2 ** 64)
    z = counter + _signed(0x9E3779B97F4A7C15)
    z = (z ^ ((z >> 30) & _MASK64[30])) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 27) & _MASK64[27])) * _signed(0x94D049BB133111EB)
    return z ^ ((z >> 31) & _MASK64[31])


def uniform_field(bits: torch.Tensor, shift: int, width: int) -> torch.Tensor:
    """Bits shift .. shift + width - 1 of `bits` as a uniform float in [0, 1)."""
    return ((bits >> shift) & ((1 << width) - 1)).to(torch.float32) / float(1 << width)


class MLMCollator:
    """Stacks (packed blocks) or pads a batch and masks `mlm_probability` of its non-special tokens:
    80% [MASK], 10% a random token, 10% unchanged. Labels are -100 everywhere else.

    max_predictions (K): exactly min(K, round(mlm_probability x tokens)) tokens of each sequence are
    chosen, uniformly, as BERT's create_pretraining_data does, and with `positions` the batch carries
    them as `masked_positions` (K a row, the chosen ones first in position order, then unused slots at
    0): the model's head then has static shapes and no boolean indexing (modeling.py). None: each
    token is chosen with probability mlm_probability (a count that varies per sequence).

    whole_word: words, not tokens, are chosen (a word is a WordPiece token and the "##" pieces that
    follow it), as BERT's whole-word-masking models were trained: words in a random order are taken
    while they fit in min(K, round(mlm_probability x tokens)), a word that does not fit is passed over
    for the next ones (BERT's rule), so all pieces of a word are predicted together; each chosen token
    then gets the 80/10/10 replacement.

    The masking of example i in epoch e depends only on (seed, e, i): every random number is a hash of
    those and its position (`random_bits`), computed for the whole batch at once. Set `.epoch` before each
    epoch; it lives in shared memory, so persistent DataLoader workers see it too (a copy gets its own)."""

    def __init__(self, tokenizer, mlm_probability: float, seed: int, pad_to_multiple_of: int | None = 8,
                 fixed_length: int | None = None, whole_word: bool = False, max_predictions: int | None = None,
                 positions: bool = True):
        self.max_predictions, self.positions = max_predictions, positions and bool(max_predictions)
        self.tokenizer = tokenizer
        self.pad_id, self.mask_id = tokenizer.pad_token_id, tokenizer.mask_token_id
        self.mlm_probability = mlm_probability
        self.seed = seed
        self.pad_to_multiple_of = pad_to_multiple_of
        self.fixed_length = fixed_length
        self.bins: list[int] | None = None   # data.length_bins, set by the engine (fit_length_bins)
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.vocab_size = len(tokenizer)
        self.whole_word = whole_word
        if whole_word:   # token id -> is it a "##" continuation piece?
            pieces = tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
            self.continuation = torch.tensor([p is not None and p.startswith("##") for p in pieces])

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    @epoch.setter
    def epoch(self, value: int):
        self._epoch[0] = value

    def __copy__(self):
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._epoch = self._epoch.clone().share_memory_()
        return other

    def _targets(self, valid: torch.Tensor) -> torch.Tensor:
        """Tokens to predict in each row: round(p x valid tokens), at least 1, at most K."""
        count = valid.sum(1)
        target = torch.round(count.double() * self.mlm_probability).long().clamp(min=1)
        if self.max_predictions:
            target = target.clamp(max=self.max_predictions)
        return torch.where(count > 0, target, torch.zeros_like(target))

    def _choose_tokens(self, valid, u) -> torch.Tensor:
        """K-exact choice: the `target` valid positions with the smallest random keys."""
        keys = torch.where(valid, u, torch.full_like(u, 2.0))
        order = keys.argsort(dim=1, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(valid.shape[1]).expand_as(order))
        return rank < self._targets(valid)[:, None]

    def _choose_words(self, ids, valid, u) -> torch.Tensor:
        """Whole-word choice (see the class docstring), all rows at once; the greedy pass over each
        row's words in random order runs over word ranks, not rows."""
        import numpy as np
        rows, n = ids.shape
        starts = valid & ~(self.continuation[ids] & torch.cat([torch.zeros(rows, 1, dtype=torch.bool), valid[:, :-1]], 1))
        word = torch.cumsum(starts.long(), 1) - 1                      # word index of each position
        word = torch.where(valid, word, torch.full_like(word, n))      # n: not a word
        lengths = torch.zeros(rows, n + 1, dtype=torch.long).scatter_add_(1, word, torch.ones_like(word))[:, :n]
        keys = torch.where(starts, u, torch.full_like(u, 2.0))        # a word's key: its first token's
        word_key = torch.full((rows, n + 1), 2.0).scatter_(1, torch.where(starts, word, n), keys)[:, :n]
        order = word_key.argsort(dim=1, stable=True).numpy()           # words in random order (no-words last)
        sorted_len = np.take_along_axis(lengths.numpy(), order, 1)
        target, taken = self._targets(valid).numpy(), np.zeros(rows, dtype=np.int64)
        take = np.zeros_like(sorted_len, dtype=bool)
        for j in range(int((lengths > 0).sum(1).max())):     # BERT's skip-and-continue, per rank
            fits = (sorted_len[:, j] > 0) & (taken + sorted_len[:, j] <= target)
            take[:, j] = fits
            taken += np.where(fits, sorted_len[:, j], 0)
            if (taken >= target).all():
                break
        chosen_word = np.zeros((rows, n + 1), dtype=bool)
        np.put_along_axis(chosen_word, order, take, 1)
        return torch.from_numpy(chosen_word).gather(1, word) & valid

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = _collate(examples, self.pad_id, self.pad_to_multiple_of, self.fixed_length, self.bins)
        special = batch.pop("special_tokens_mask").bool()
        if "attention_mask" in batch:
            special |= batch["attention_mask"] == 0
        ids, valid = batch["input_ids"], ~special
        rows = torch.tensor([e["idx"] for e in examples], dtype=torch.int64)
        # one 64-bit draw a position: 24 bits choose it, 20 bits its replacement, 20 bits a random token
        bits = random_bits(_seed_of(self.seed, self.epoch), rows, ids.shape[1])
        u, action, pick = uniform_field(bits, 40, 24), uniform_field(bits, 20, 20), uniform_field(bits, 0, 20)
        if self.whole_word:
            chosen = self._choose_words(ids, valid, u)
        elif self.max_predictions:
            chosen = self._choose_tokens(valid, u)
        else:
            chosen = (u < self.mlm_probability) & valid
        random_ids = (pick * self.vocab_size).long().clamp(max=self.vocab_size - 1)
        batch["labels"] = torch.where(chosen, ids, -100)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, ids)
        batch["input_ids"] = torch.where(chosen & (action < 0.8), self.mask_id, inputs)
        if self.positions:   # K slots a row: the chosen positions in order, then unused slots at 0
            k, n = self.max_predictions, ids.shape[1]
            slots = torch.where(chosen, torch.arange(n), n).sort(dim=1).values[:, :k]
            if slots.shape[1] < k:
                slots = torch.cat([slots, torch.full((len(slots), k - slots.shape[1]), n)], 1)
            batch["masked_positions"] = torch.where(slots < n, slots, 0)
        return batch


class ClassificationCollator:
    """Dynamic padding (to a multiple of 8 for tensor cores); labels pass through."""

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = 8, fixed_length: int | None = None):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.fixed_length = fixed_length
        self.bins: list[int] | None = None   # data.length_bins, set by the engine (fit_length_bins)
        self.epoch = 0

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return _collate(examples, self.pad_id, self.pad_to_multiple_of, self.fixed_length, self.bins)


def fit_length_bins(collate, data: dict, bins: int, print0=print) -> list[int] | None:
    """data.length_bins for the run's padded batches: the bins from the training split's lengths, the
    longest row of any split the run collates (eval, extra eval, test) always the last, set on the
    collator that every loader copies. -> the training split's lengths (LengthGroupedBatches reuses
    them), or None without bins."""
    if not bins:
        return None
    lengths = sequence_lengths(data["train"])
    longest = max(max(sequence_lengths(split), default=0) for split in data.values())
    collate.bins = length_bins(lengths, bins, collate.pad_to_multiple_of, longest)
    padded = sum(padded_width(n, collate.pad_to_multiple_of, collate.bins) for n in lengths)
    print0(f"[data] data.length_bins={bins}: padded batches take one of the lengths {collate.bins}, the quantiles of "
           f"the {len(lengths)} training sequences' lengths that leave the least padding ({1 - sum(lengths) / padded:.1%}"
           " of the positions, each sequence padded to its bin)")
    return lengths


def padded_width(longest: int, pad_to_multiple_of: int | None, bins: list[int] | None) -> int:
    """The length a padded batch whose longest row has `longest` tokens is padded to: the smallest of
    `bins` that holds it (data.length_bins), else `longest` rounded up to `pad_to_multiple_of`."""
    for width in bins or ():
        if width >= longest:
            return width
    return -(-longest // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else longest


def _collate(examples: list[dict], pad_id: int, pad_to_multiple_of: int | None, fixed_length: int | None,
             bins: list[int] | None = None) -> dict:
    """Tensors of a list of tokenized rows. Rows of one length (packed MLM blocks) are stacked as they
    are, without an attention_mask: the model then attends everywhere, and builds no mask (on a GPU,
    checking an all-ones mask makes the host wait: bert_recipes.dropout). Otherwise every row is
    padded (padded_width: to a length bin, or to the longest rounded up to `pad_to_multiple_of`), or
    to `fixed_length` (the pipeline engine needs fixed shapes), with an attention_mask. With `bins`
    every batch is padded to a bin and has a mask, even one whose rows are of one length: the model
    then sees only the bins' shapes and always the same inputs (one compiled graph per bin)."""
    import numpy as np   # numpy builds an int64 array from lists about 6x faster than torch.tensor
    lengths = [len(e["input_ids"]) for e in examples]
    columns = [k for k in examples[0] if k not in ("idx", "labels", "label")]
    if fixed_length is None and not bins and min(lengths) == max(lengths):
        batch = {k: torch.from_numpy(np.array([e[k] for e in examples], dtype=np.int64))
                 for k in columns if k != "attention_mask"}
    else:
        width = fixed_length or padded_width(max(lengths), pad_to_multiple_of, bins)
        fill = {"input_ids": pad_id, "special_tokens_mask": 1}
        batch = {}
        for k in sorted(set(columns) | {"attention_mask"}):
            out = np.full((len(examples), width), fill.get(k, 0), dtype=np.int64)
            for row, (e, n) in enumerate(zip(examples, lengths)):
                out[row, :n] = e[k] if k in e else 1   # no attention_mask column: the real tokens
            batch[k] = torch.from_numpy(out)
    if "labels" in examples[0]:
        batch["labels"] = torch.tensor([e["labels"] for e in examples])
    return batch


def loader_kwargs(data: DataConfig, collate, seed: int, pin: bool) -> dict:
    """DataLoader settings shared by the train and eval loaders. One seeded generator of their own:
    otherwise each new iterator draws its worker seed from the global torch RNG, which shifts the
    dropout stream of a resumed run away from the uninterrupted one."""
    return dict(collate_fn=collate, num_workers=data.num_workers,
                persistent_workers=data.persistent_workers and data.num_workers > 0,
                pin_memory=data.pin_memory and pin, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- all of it
@contextlib.contextmanager
def main_first(is_main: bool, barrier, broadcast=lambda obj: obj):
    """Rank 0 runs the block first (build, download, tokenize); the others then read its cache. If
    rank 0 fails, every rank raises its error: nobody is left waiting in the barrier."""
    if not is_main:
        barrier()
        raise_shared(broadcast(None))
    try:
        yield
    except Exception as err:
        if is_main:
            barrier()
            broadcast(shared_error(err))
        raise
    if is_main:
        barrier()
        broadcast(None)


def shared_error(err: BaseException) -> tuple[bool, str]:
    """An error of rank 0 as the other ranks will raise it: (was it a ConfigError, its message)."""
    return isinstance(err, ConfigError), str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"


def raise_shared(error: tuple[bool, str] | None) -> None:
    if error is not None:
        is_config, message = error
        raise ConfigError(message) if is_config else RuntimeError(f"rank 0 failed: {message}")


def on_rank0(is_main: bool, broadcast, compute):
    """compute() on rank 0 and its result on every rank; an error of rank 0 is raised on every rank."""
    result, error = None, None
    if is_main:
        try:
            result = compute()
        except Exception as err:
            error = shared_error(err)
            broadcast((None, error))
            raise
    result, error = broadcast((result, error))
    raise_shared(error)
    return result


def prepare_data(cfg, output_dir: Path, is_main: bool, barrier, fixed_length: int | None = None,
                 broadcast=lambda obj: obj):
    """raw text -> tokenizer (loaded, or trained once on rank 0) -> tokenized splits -> collator.
    `cfg` is the whole Config: data, task, tokenizer, the model's name and the seed all meet here.
    Rank 0 goes first (download, tokenize, cache); `barrier` lets the others follow. Prepared data
    (data.source: prepared) is memory-mapped as `make prepare` wrote it."""
    if cfg.data.source == "prepared":
        tokenizer, data, test_index = load_prepared(cfg)
        return tokenizer, data, make_collator(cfg, tokenizer, fixed_length), test_index
    with main_first(is_main, barrier, broadcast):
        raw = load_raw(cfg.data, cfg.task, cfg.run.seed)
    tokenizer = get_tokenizer(cfg.tokenizer, cfg.model.name_or_path, raw["train"], cfg.data,
                              output_dir / "tokenizer", is_main, broadcast)
    with main_first(is_main, barrier, broadcast):
        data = tokenize(raw, tokenizer, cfg.task, cfg.data, cfg.task.label_names)
    if cfg.task.kind == "classification" and cfg.task.label_names is None:
        # text labels without task.label_names: their sorted order becomes the run's label_names,
        # so the resolved config and the export's id2label name them
        mapping = label_mapping(raw, cfg.task, cfg.data, None)
        if mapping is not None:
            cfg.task.label_names = list(mapping)
    # a test split's own example ids (GLUE's `idx`, which a submission file must repeat), else row numbers
    test_index = {k.removeprefix("test:"): list(raw[k]["idx"]) if "idx" in raw[k].column_names else list(range(len(raw[k])))
                  for k in raw if k.startswith("test:")}
    return tokenizer, data, make_collator(cfg, tokenizer, fixed_length), test_index


def make_collator(cfg, tokenizer, fixed_length: int | None):
    if cfg.task.kind == "mlm":
        # the pipeline (fixed_length) computes every position's logits: the same tokens are chosen, no positions
        return MLMCollator(tokenizer, cfg.data.mlm_probability, cfg.run.seed, fixed_length=fixed_length,
                           whole_word=cfg.data.whole_word_masking, max_predictions=cfg.data.max_predictions_per_seq,
                           positions=fixed_length is None)
    return ClassificationCollator(tokenizer, fixed_length=fixed_length)


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


def prepared_signature(cfg) -> dict:
    """The settings that decide a run's tokens: prepared data is used only by a recipe that agrees."""
    d, t = cfg.data, cfg.task
    return {"task.kind": t.kind, "task.num_labels": t.num_labels if t.kind == "classification" else None,
            "task.label_names": t.label_names,
            "tokenizer": tokenizer_identity(cfg.tokenizer.name_or_path or cfg.model.name_or_path),
            "tokenizer.vocab_size": cfg.tokenizer.vocab_size if not (cfg.tokenizer.name_or_path or cfg.model.name_or_path)
            else None,
            **{f"data.{k}": getattr(d, k) for k in (
                "max_seq_length", "packing", "text_column", "text_pair_column", "label_column", "train_split", "eval_split",
                "extra_eval_splits", "test_splits", "max_train_samples", "max_eval_samples",
                "validation_split_percentage")}}


def check_prepared_dir(data: DataConfig) -> Path:
    root = Path(data.prepared_dir)
    if not (root / PREPARED_META).is_file():
        raise ConfigError(f"data.prepared_dir={root} holds no prepared data ({PREPARED_META} missing): write it with "
                          "make prepare RECIPE=<this recipe> (tools/prepare.py)")
    return root


def load_prepared(cfg):
    """-> (tokenizer, memory-mapped splits, test_index) from data.prepared_dir, checked against the recipe."""
    from datasets import DatasetDict
    from transformers import AutoTokenizer
    root = check_prepared_dir(cfg.data)
    meta = json.loads((root / PREPARED_META).read_text())
    expected = prepared_signature(cfg)
    given = cfg.tokenizer.name_or_path or cfg.model.name_or_path   # data prepared before tokenizer_identity: a path
    differ = [f"{k}: prepared {meta['signature'].get(k)!r}, this run {v!r}" for k, v in expected.items()
              if k != "data.source" and meta["signature"].get(k) != v
              and not (k == "tokenizer" and meta["signature"].get(k) == given)]
    if differ:
        raise ConfigError(f"data.prepared_dir={root} was prepared with other settings ({'; '.join(differ)}): prepare "
                          "it again with this recipe")
    if cfg.task.label_names is None and meta.get("label_names"):   # text labels, named when prepared
        cfg.task.label_names = meta["label_names"]
    data = DatasetDict.load_from_disk(str(root / "data"))
    return AutoTokenizer.from_pretrained(str(root / "tokenizer")), data, meta["test_index"]
