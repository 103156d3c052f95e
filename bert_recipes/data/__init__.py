"""A run's data, end to end: raw text (sources.py, beside this file) -> tokenizer (tokenizer.py) -> tokenized
splits -> collator, the task kind's own (bert_recipes/tasks/<kind>.py: its tokenize and collator); rank 0 goes first
(ranks.main_first); batching.py makes the batches. The modules of this package each hold one role of the data (text
to batches); this file composes them for a run."""
from __future__ import annotations

from pathlib import Path

from ..config import DataConfig, TaskConfig, TokenizerConfig
from ..disk import full_disk_is_one_line, fullest
from ..places import make_place
from ..ranks import main_first
from ..tasks import TASKS, kind_of
from .prepared import load_prepared
from .sources import data_cache, load_raw
from .tokenizer import get_tokenizer


def prepare_data(data_cfg: DataConfig, task: TaskConfig, tok: TokenizerConfig, model_name_or_path: str | None,
                 seed: int, output_dir: Path, is_main: bool, barrier, fixed_length: int | None = None,
                 broadcast=lambda obj: obj, first_on_node: bool | None = None):
    """raw text -> tokenizer (loaded, or trained once on rank 0) -> tokenized splits -> collator.
    The data, task and tokenizer sections meet here, with the model's name (its tokenizer) and the seed
    (the split and the masks). Rank 0 goes first (download, tokenize, cache); `barrier` lets the others
    follow; on several nodes each node's first rank goes next, for a node-local cache (ranks.on_nodes). Packed MLM's
    tokenize makes (or finds) a token store a split in the cache (store_cache.py); prepared data (data.source:
    prepared) and a token store made ahead of time (data.source: store) are memory-mapped as `make prepare` wrote
    them. The task kind's tokenize may
    write what it learnt of the labels into `task` (classification: task.label_names)."""
    from datasets import DatasetDict
    if data_cfg.source == "prepared":
        tokenizer, data, test_index = load_prepared(data_cfg, task, tok, model_name_or_path)
        return tokenizer, data, kind_of(task.kind).collator(data_cfg, task, seed, tokenizer, fixed_length), test_index
    if data_cfg.source == "store":   # packed MLM blocks, memory-mapped: nothing is tokenized or copied here
        from transformers import AutoTokenizer

        from .store import check_store_dir
        from .store_cache import store_splits
        tokenizer = AutoTokenizer.from_pretrained(str(check_store_dir(data_cfg.store_dir) / "tokenizer"))
        data = store_splits(data_cfg.store_dir, data_cfg.max_seq_length, tokenizer.all_special_ids,
                            data_cfg.document_mask, data_cfg.validation_split_percentage, data_cfg.max_train_samples,
                            data_cfg.max_eval_samples, data_cfg.packing, tokenizer.pad_token_id)
        return tokenizer, data, kind_of(task.kind).collator(data_cfg, task, seed, tokenizer, fixed_length), {}
    cache = data_cache(data_cfg)
    if is_main:   # the places the user named: an OSError creating one is one line naming the key
        for key, place in (("data.cache_dir", data_cfg.cache_dir),
                           ("data.sample_dir", data_cfg.sample_dir if data_cfg.source == "sample" else None)):
            if place:
                make_place(key, place)
    # the sample is built into data.sample_dir, then read into datasets' cache: a full disk is the fuller of the two
    raw_dir = fullest(Path(data_cfg.sample_dir), cache) if data_cfg.source == "sample" else cache
    first = (is_main, barrier, broadcast, first_on_node)
    with main_first(*first), full_disk_is_one_line("the raw data (the sample, or a download)", raw_dir, 0, None,
                                                   DATA_THEN):
        raw = load_raw(data_cfg, task, seed)
    tokenizer = get_tokenizer(tok, model_name_or_path, raw["train"], data_cfg, output_dir / "tokenizer", is_main,
                              broadcast)
    if data_cfg.mixture:   # each source tokenized (and packed) on its own, then joined (bert_recipes/data/mixture.py)
        raw = DatasetDict({k: v for k, v in raw.items() if "@" in k})
    stored = TASKS[task.kind].masked_lm and data_cfg.packing   # tasks/mlm.py writes token stores
    with main_first(*first), full_disk_is_one_line(
            "the tokenized data cache", cache, 0, lambda: tokenized_bytes(raw, data_cfg, stored), DATA_THEN):
        data = kind_of(task.kind).tokenize(raw, tokenizer, task, data_cfg)
    if data_cfg.mixture:
        from .mixture import joined_sources   # torch at import: not for the data modules a preflight reads
        data = joined_sources(data, [s.name for s in data_cfg.mixture])
    for line in kind_of(task.kind).notes(data, task) if is_main else []:
        print(line, flush=True)
    # a test split's own example ids (GLUE's `idx`, which a submission file must repeat), else row numbers
    test_index = {k.removeprefix("test:"): list(raw[k]["idx"]) if "idx" in raw[k].column_names else list(range(len(raw[k])))
                  for k in raw if k.startswith("test:")}
    return tokenizer, data, kind_of(task.kind).collator(data_cfg, task, seed, tokenizer, fixed_length), test_index


def data_progress_bars(enabled: bool) -> None:
    """logging.progress_bar, for the data libraries, once per run: false turns datasets' bars off for the process
    (loading's "Generating train split", map's "tokenizing" and "packing into N-token blocks"), and with them the
    tokenizer trainer's (tokenizer.train_wordpiece reads the same switch), so a log file holds lines, not bars; true
    leaves them as the library has them (on, unless HF_DATASETS_DISABLE_PROGRESS_BARS says otherwise)."""
    if not enabled:
        import datasets
        datasets.disable_progress_bars()


DATA_THEN = ("nothing was trained and the output directory is untouched: free space there (or set data.cache_dir to "
             "a larger disk), then run again")


def tokenized_bytes(raw, data_cfg: DataConfig, stored: bool) -> tuple[int, str]:
    """An estimate of the tokenized data's size. In token stores (`stored`: packed MLM, store_cache.py): the text's
    bytes (a uint16 store and its index take 0.74 a byte of English text: tools/prepare.py's
    STORE_BYTES_PER_TEXT_BYTE). In datasets' cache: every row at most data.max_seq_length tokens, in three int32
    columns (input ids, token types, attention mask)."""
    if stored:
        text = sum(split.data.nbytes for split in raw.values())
        return text, f"an estimate: a byte a byte of the {text / 1e6:.1f} MB of text read"
    rows, seq = sum(len(split) for split in raw.values()), data_cfg.max_seq_length
    return rows * seq * 12, f"an estimate: {rows} rows x {seq} tokens x 3 int32 columns"
