"""A run's data, end to end: raw text (bert_recipes/sources.py) -> tokenizer -> tokenized splits
(tokenizing.py) -> collator (collate.py); rank 0 goes first (rank0.py); batching.py makes the batches."""
from __future__ import annotations

from pathlib import Path

from .collate import ClassificationCollator, MLMCollator
from .rank0 import main_first
from .sources import get_tokenizer, load_prepared, load_raw
from .tokenizing import label_mapping, missing_classes, tokenize


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
    for warning in missing_classes(data, cfg.task) if is_main and cfg.task.kind == "classification" else []:
        print(warning, flush=True)
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
