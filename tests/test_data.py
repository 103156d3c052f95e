"""Embedded sample, tokenizer training, tokenization cache and MLM masking."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from bert_recipes.data.batching import Indexed
from bert_recipes.config import Config, ConfigError
from bert_recipes.data.sample import LABELS, build_sample
from bert_recipes.data.sources import load_raw, texts
from bert_recipes.data.tokenizer import train_wordpiece
from bert_recipes.tasks import kind_of
from bert_recipes.tasks.mlm import MLMCollator


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sample_is_reproducible(sample_dir, tmp_path):
    again = build_sample(tmp_path / "again")
    first = json.loads((sample_dir / "manifest.json").read_text())
    assert again["sha256"] == first["sha256"]


def test_sample_split_is_by_module_and_leak_free(sample_dir):
    splits = {s: read_jsonl(sample_dir / f"classify/{s}.jsonl") for s in ("train", "validation", "test")}
    modules = {s: {r["module"] for r in rows} for s, rows in splits.items()}
    text_sets = {s: {r["text"] for r in rows} for s, rows in splits.items()}
    for a, b in [("train", "validation"), ("train", "test"), ("validation", "test")]:
        assert not modules[a] & modules[b], f"modules shared by {a} and {b}"
        assert not text_sets[a] & text_sets[b], f"texts shared by {a} and {b}"
    for s, rows in splits.items():   # every class is present in every split
        assert set(Counter(r["area"] for r in rows)) == set(LABELS), s
    assert 6 <= len(LABELS) <= 10
    # held-out docstrings are not in the pretraining corpus either
    corpus = set((sample_dir / "pretrain/train.txt").read_text().splitlines())
    assert not corpus & (text_sets["validation"] | text_sets["test"])
    assert len(corpus) > 5000


def test_manifest_reports_majority_baseline(sample_dir):
    m = json.loads((sample_dir / "manifest.json").read_text())
    train = read_jsonl(sample_dir / "classify/train.jsonl")
    majority = Counter(r["area"] for r in train).most_common(1)[0][0]
    assert m["majority_label"] == majority
    val = read_jsonl(sample_dir / "classify/validation.jsonl")
    assert m["majority_baseline_accuracy"]["validation"] == pytest.approx(
        sum(r["area"] == majority for r in val) / len(val))


@pytest.fixture(scope="module")
def tokenizer(sample_dir):
    cfg = Config()
    cfg.data.sample_dir = str(sample_dir)
    raw = load_raw(cfg.data, cfg.task, seed=0)
    return train_wordpiece(texts(raw["train"], cfg.data), vocab_size=2000, lowercase=True)


def test_trained_wordpiece_tokenizer(tokenizer, tmp_path):
    from transformers import AutoTokenizer
    assert 1000 < len(tokenizer) <= 2000
    enc = tokenizer("Return the asyncio event loop.", "Second sentence")
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and 1 in enc["token_type_ids"]
    assert "[UNK]" not in tokens
    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert reloaded("event loop")["input_ids"] == tokenizer("event loop")["input_ids"]


TOKENIZE_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
from bert_recipes.config import Config
from bert_recipes.data.sources import load_raw
from bert_recipes.tasks import kind_of
cfg = Config()
cfg.data.sample_dir, cfg.data.cache_dir, cfg.data.max_seq_length, cfg.data.max_train_samples = sys.argv[1:5]
cfg.data.max_seq_length, cfg.data.max_train_samples = int(cfg.data.max_seq_length), int(cfg.data.max_train_samples)
data = kind_of(cfg.task.kind).tokenize(load_raw(cfg.data, cfg.task, seed=0), AutoTokenizer.from_pretrained(sys.argv[5]),
                                      cfg.task, cfg.data)
train = data["train"]   # a token store's blocks (packed MLM)
print(json.dumps({"files": sorted(str(f) for f in train.store.root.rglob("*") if f.is_file()),
                  "lengths": sorted({len(r["input_ids"]) for r in train.__getitems__(range(len(train)))})}))
"""


def test_packing_gives_full_blocks_and_tokenization_is_cached_across_processes(sample_dir, tokenizer, tmp_path):
    """A second process (another rank, or the next run) finds the first one's token store, every block full."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    tokenizer.save_pretrained(tmp_path / "tok")
    args = [sys.executable, "-c", TOKENIZE_SCRIPT, str(sample_dir), str(tmp_path / "cache"), "64", "500",
            str(tmp_path / "tok")]
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    first = json.loads(subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout)
    assert first["lengths"] == [64]
    mtimes = {f: Path(f).stat().st_mtime_ns for f in first["files"]}
    second = json.loads(subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout)
    assert second["files"] == first["files"]                               # same fingerprint
    assert {f: Path(f).stat().st_mtime_ns for f in first["files"]} == mtimes  # read, not rewritten


def test_line_by_line_pads_dynamically(sample_dir, tokenizer):
    cfg = Config()
    cfg.data.sample_dir, cfg.data.packing, cfg.data.max_seq_length, cfg.data.max_train_samples = \
        str(sample_dir), False, 48, 200
    data = kind_of(cfg.task.kind).tokenize(load_raw(cfg.data, cfg.task, seed=0), tokenizer, cfg.task, cfg.data)
    lengths = [len(x) for x in data["train"]["input_ids"]]
    assert max(lengths) <= 48 and min(lengths) < 48
    collate = MLMCollator(tokenizer, 0.15, seed=0)
    batch = collate([Indexed(data["train"])[i] for i in range(8)])
    assert batch["input_ids"].shape[1] % 8 == 0
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()   # padding is never a target


def test_mlm_masking_80_10_10_and_deterministic(tokenizer):
    seq = [tokenizer.cls_token_id] + list(range(10, 10 + 254)) + [tokenizer.sep_token_id]
    examples = [{"input_ids": seq, "attention_mask": [1] * 256, "token_type_ids": [0] * 256,
                 "special_tokens_mask": [1] + [0] * 254 + [1], "idx": i} for i in range(200)]
    collate = MLMCollator(tokenizer, 0.15, seed=3)
    batch = collate(examples)
    original = torch.tensor(seq).expand(200, -1)
    chosen = batch["labels"] != -100
    assert (batch["labels"][chosen] == original[chosen]).all()
    assert not chosen[:, 0].any() and not chosen[:, -1].any()         # [CLS]/[SEP] never chosen
    n = chosen.sum().item()
    assert 0.14 < n / (200 * 254) < 0.16
    masked = (batch["input_ids"] == tokenizer.mask_token_id) & chosen
    kept = (batch["input_ids"] == original) & chosen
    assert 0.77 < masked.sum().item() / n < 0.83
    assert 0.08 < kept.sum().item() / n < 0.12                        # ~10% kept (+ random hits of itself)
    # a pure function of (seed, epoch, idx): order and batch composition do not matter
    again = collate(list(reversed(examples)))
    assert torch.equal(again["input_ids"].flip(0), batch["input_ids"])
    collate.epoch = 1
    assert not torch.equal(collate(examples)["input_ids"], batch["input_ids"])


def test_k_predictions_a_sequence_as_static_positions(tokenizer):
    """data.max_predictions_per_seq=K: exactly min(K, round(0.15 x tokens)) chosen tokens a row, and the K
    slots list them in position order, the unused slots at 0. Packed rows of one length are stacked
    without an attention mask (nothing to pad, so no mask for the model to build)."""
    seq = [tokenizer.cls_token_id] + list(range(10, 10 + 126)) + [tokenizer.sep_token_id]
    rows = [{"input_ids": seq, "attention_mask": [1] * 128, "token_type_ids": [0] * 128,
             "special_tokens_mask": [1] + [0] * 126 + [1], "idx": i} for i in range(32)]
    short = {**rows[0], "input_ids": seq[:20], "attention_mask": [1] * 20, "token_type_ids": [0] * 20,
             "special_tokens_mask": [1] + [0] * 19, "idx": 99}   # 19 tokens: round(0.15 x 19) = 3
    collate = MLMCollator(tokenizer, 0.15, seed=3, max_predictions=19)
    packed = collate(rows)
    assert "attention_mask" not in packed and packed["input_ids"].shape == (32, 128)
    chosen = packed["labels"] != -100
    assert (chosen.sum(1) == 19).all() and not chosen[:, [0, -1]].any()
    slots = packed["masked_positions"]
    assert slots.shape == (32, 19) and torch.equal(chosen.nonzero()[:, 1].view(32, 19), slots)
    padded = collate(rows[:3] + [short])
    assert "attention_mask" in padded and (padded["labels"][3] != -100).sum() == 3
    assert padded["masked_positions"][3, 3:].eq(0).all() and padded["masked_positions"][3, :3].gt(0).all()
    collate.epoch = 1
    assert not torch.equal(collate(rows)["masked_positions"], slots)   # another epoch, other masks


def test_masks_are_the_same_with_persistent_workers_and_change_with_the_epoch(tokenizer):
    """Workers read the collator's epoch from shared memory: with persistent workers (kept across
    epochs) each epoch's batches equal those collated in the main process, and differ between epochs."""
    from torch.utils.data import DataLoader
    seq = [tokenizer.cls_token_id] + list(range(10, 10 + 62)) + [tokenizer.sep_token_id]
    rows = [{"input_ids": seq, "token_type_ids": [0] * 64, "special_tokens_mask": [1] + [0] * 62 + [1]}
            for _ in range(16)]
    data = Indexed(rows)
    main_process = MLMCollator(tokenizer, 0.15, seed=5, max_predictions=10)
    collate = MLMCollator(tokenizer, 0.15, seed=5, max_predictions=10)
    loader = DataLoader(data, batch_size=8, collate_fn=collate, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in (0, 1):
        collate.epoch = main_process.epoch = epoch
        batches = [b["input_ids"] for b in loader]
        expected = [main_process([data[i] for i in range(j, j + 8)])["input_ids"] for j in (0, 8)]
        assert all(torch.equal(a, b) for a, b in zip(batches, expected)), epoch
        seen.append(torch.cat(batches))
    assert not torch.equal(seen[0], seen[1])


def test_classification_with_string_labels(tmp_path, tokenizer):
    rows = [{"sentence": f"good {i}", "other": f"x {i}", "label": "pos"} for i in range(10)] + \
           [{"sentence": f"bad {i}", "other": f"y {i}", "label": "neg"} for i in range(10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config()
    cfg.task.kind, cfg.task.num_labels = "classification", 2
    cfg.data.source, cfg.data.train_files = "files", [str(tmp_path / "train.jsonl")]
    cfg.data.text_column, cfg.data.text_pair_column = "sentence", "other"
    cfg.data.validation_split_percentage = 20
    raw = load_raw(cfg.data, cfg.task, seed=0)
    assert len(raw["eval"]) == 4 and len(raw["train"]) == 16
    cfg.task.label_names = ["neg", "pos"]
    data = kind_of(cfg.task.kind).tokenize(raw, tokenizer, cfg.task, cfg.data)
    assert sorted(set(data["train"]["labels"])) == [0, 1]
    cfg.data.text_column = "missing"
    with pytest.raises(ConfigError, match="column 'missing' not in the training data"):
        load_raw(cfg.data, cfg.task, seed=0)


def test_hub_source_code_path_with_a_local_dataset_directory(tmp_path):
    """data.source=hub calls datasets.load_dataset(dataset_name, dataset_config) exactly as for
    'glue'/'sst2'; offline it is exercised with a dataset directory instead of a Hub name."""
    root = tmp_path / "my_glue_like"
    root.mkdir()
    for split, n in (("train", 30), ("validation", 10)):
        (root / f"{split}.jsonl").write_text("".join(
            json.dumps({"sentence": f"text {split} {i}", "label": i % 2}) + "\n" for i in range(n)))
    cfg = Config()
    cfg.task.kind, cfg.data.source, cfg.data.dataset_name = "classification", "hub", str(root)
    cfg.data.text_column = "sentence"
    raw = load_raw(cfg.data, cfg.task, seed=0)
    assert (len(raw["train"]), len(raw["eval"])) == (30, 10)
    cfg.data.eval_split = "validation_matched"   # a typo must not silently eat training data
    with pytest.raises(ConfigError, match="eval_split='validation_matched' not in the dataset's splits"):
        load_raw(cfg.data, cfg.task, seed=0)
    (root / "validation.jsonl").unlink()         # train only: a seeded 5% is held out
    raw = load_raw(cfg.data, cfg.task, seed=0)
    assert len(raw["train"]) + len(raw["eval"]) == 30 and len(raw["eval"]) >= 1
    cfg.data.train_split = "nope"
    with pytest.raises(ConfigError, match="train_split='nope' not in the dataset's splits"):
        load_raw(cfg.data, cfg.task, seed=0)


def test_a_batch_is_read_in_one_call_with_the_rows_of_one_by_one(sample_dir, tokenizer):
    """data.Indexed.__getitems__ (the DataLoader's fetcher uses it): the rows and indices __getitem__
    gives, in the order asked, for a list, a tuple or a tensor of indices; a dataset that is a plain
    list of rows is read row by row."""
    from datasets import Dataset
    rows = Dataset.from_dict({"input_ids": [[i, i + 1, i + 2][: 1 + i % 3] for i in range(40)],
                              "labels": list(range(40))})
    data = Indexed(rows)
    wanted = [7, 3, 39, 3]
    one_by_one = [data[i] for i in wanted]
    for indices in (wanted, tuple(wanted), torch.tensor(wanted)):
        assert data.__getitems__(indices) == one_by_one
    assert Indexed([{"input_ids": [1]}, {"input_ids": [2, 3]}]).__getitems__([1]) == [{"input_ids": [2, 3], "idx": 1}]


def test_length_bins_leave_the_least_padding_and_every_batch_takes_one():
    """data.length_bins: at most N lengths, the quantiles that leave the least padding (rounded up to 8
    where asked), the longest length of any split always the last; a padded batch takes the smallest bin
    that holds it, with a mask, also when its rows are of one length; without bins that batch is stacked
    as it is."""
    from bert_recipes.data.batching import length_bins, padded_width
    from bert_recipes.tasks.classification import ClassificationCollator
    lengths = [5] * 50 + [9] * 30 + [17] * 15 + [40] * 5
    assert length_bins(lengths, 4, None) == [5, 9, 17, 40]
    assert length_bins(lengths, 4, 8, longest=60) == [8, 16, 24, 64]
    assert length_bins(lengths, 2, None) == [9, 40] and length_bins(lengths, 0, 8) == []
    assert len(length_bins(list(range(1, 1000)), 8, 8)) <= 8
    assert [padded_width(n, 8, [8, 16, 24, 64]) for n in (1, 8, 9, 30, 64, 65)] == [8, 8, 16, 64, 64, 72]

    class Tok:
        pad_token_id = 0
    collate = ClassificationCollator(Tok(), pad_to_multiple_of=None)
    same = [{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [8, 9, 4], "labels": 0}]
    assert collate(same)["input_ids"].shape == (2, 3) and "attention_mask" not in collate(same)
    collate.bins = [2, 6, 12]
    batch = collate(same)
    assert batch["input_ids"].shape == (2, 6) and batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0]] * 2
