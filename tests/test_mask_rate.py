"""A masking rate that moves (data.mlm_probability -> data.mlm_probability_end) and evaluation's own rate
(data.eval_mlm_probability), bert_recipes/mask_rate.py: the levels and their K; the collator masks round(rate x
tokens) a row at each level, in DataLoader workers that persist too; a run logs the rate it masked at; a resume
in the middle of a level is bit-exact (on another process count: tests/test_batch_ramp.py, whose halt falls inside
a level too); evaluation masks at its own rate; each bad value is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bert_recipes.config import load_config
from bert_recipes.mask_rate import MAX_LEVELS, largest, mask_schedule
from conftest import refused_in_process, run_in_process, tiny_args

REPO = Path(__file__).resolve().parent.parent


def config(tmp_path, sample_dir, datasets_cache, **extra):
    from bert_recipes.config import resolve
    cfg = load_config(None, tiny_args(tmp_path, sample_dir, datasets_cache, **extra))
    resolve(cfg)
    return cfg


def test_the_levels_run_from_the_start_rate_to_the_end_rate_with_k_following(tmp_path, sample_dir, datasets_cache):
    cfg = config(tmp_path, sample_dir, datasets_cache, **{"data.mlm_probability": 0.3, "data.mlm_probability_end": 0.05,
                                                          "data.max_seq_length": 64})
    s = mask_schedule(cfg.data, cfg.task.kind, cfg.train.compile, 100)
    rates = [rate for rate, _ in s.levels]
    assert len(rates) == MAX_LEVELS == 8 and rates[0] == 0.3 and rates[-1] == 0.05
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert [k for _, k in s.levels] == [max(1, round(19 * r / 0.3)) for r in rates]   # K 19 = round(0.3 x 64)
    assert s.starts == (0, 12, 25, 38, 50, 62, 75, 88)
    assert s.at(0) == (0, 12) and s.at(11) == (0, 12) and s.at(12) == (1, 25) and s.at(99) == (7, None)
    assert s.evaluation == (0.3, 19)            # null: the rate the run starts at
    assert largest(cfg.data, cfg.data.max_predictions_per_seq) == (0.3, 19)            # memory is sized for the largest level
    assert "8 levels" in s.line() and "evaluation masks at 0.3 (K 19)" in s.line()
    assert len(mask_schedule(cfg.data, cfg.task.kind, cfg.train.compile, 5).levels) == 5   # never more levels than steps


def test_a_rate_that_stays_is_one_level_and_no_line(tmp_path, sample_dir, datasets_cache):
    cfg = config(tmp_path, sample_dir, datasets_cache)
    s = mask_schedule(cfg.data, cfg.task.kind, cfg.train.compile, 100)
    assert s.levels == ((0.15, 5),) and s.starts == (0,) and s.at(50) == (0, None) and s.line() is None
    cfg = config(tmp_path, sample_dir, datasets_cache, **{"data.eval_mlm_probability": 0.3})
    s = mask_schedule(cfg.data, cfg.task.kind, cfg.train.compile, 100)
    assert s.levels == ((0.15, 5),) and s.evaluation == (0.3, 10) and "evaluation masks at 0.3 (K 10)" in s.line()
    assert largest(cfg.data, cfg.data.max_predictions_per_seq) == (0.3, 10)
    padded = config(tmp_path, sample_dir, datasets_cache, **{
        "data.packing": False, "data.length_bins": 4, "train.compile": True, "data.mlm_probability_end": 0.05})
    assert len(mask_schedule(padded.data, "mlm", True, 100).levels) == 2   # 4 bins x 2 K: dynamo's 8 compiled shapes


def collator(k: int | None = 20):
    from transformers import PreTrainedTokenizerFast

    from bert_recipes.tasks.mlm import MLMCollator
    tokenizer = PreTrainedTokenizerFast.from_pretrained(REPO / "tests/data/wordpiece-1000")
    return MLMCollator(tokenizer, 0.3, seed=3, max_predictions=k, pad_to_multiple_of=None), tokenizer


def rows(tokenizer, n=8, length=40):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 900, (n, length), generator=g)
    ids[:, 0], ids[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    special = torch.zeros(n, length, dtype=torch.long)
    special[:, 0] = special[:, -1] = 1
    return [{"input_ids": ids[i].tolist(), "special_tokens_mask": special[i].tolist(), "idx": i} for i in range(n)]


@pytest.mark.parametrize("k", [20, None], ids=["K", "per-token"])
def test_each_level_masks_its_rate_and_evaluation_its_own(k, tmp_path, sample_dir, datasets_cache):
    cfg = config(tmp_path, sample_dir, datasets_cache, **{"data.mlm_probability": 0.3, "data.mlm_probability_end": 0.05,
                                                          "data.eval_mlm_probability": 0.15})
    cfg.data.max_predictions_per_seq = k
    s = mask_schedule(cfg.data, cfg.task.kind, cfg.train.compile, 16)
    collate, tokenizer = collator(k)
    collate.follow(s)
    examples = rows(tokenizer)
    for level, (rate, kk) in enumerate(s.levels):
        collate.level = level
        batch = collate(examples)
        chosen = (batch["labels"] != -100).sum(1)
        if k is None:   # each token with probability `rate`: the mean within a wide band, no slots
            assert abs(chosen.float().mean() / 38 - rate) < 0.12 and "masked_positions" not in batch
        else:
            assert chosen.tolist() == [min(kk, round(rate * 38))] * 8 and batch["masked_positions"].shape == (8, kk)
    evaluation = collate.evaluation_copy()
    collate.level = 0   # the training collator moves on; evaluation's copy keeps its own level
    chosen = (evaluation(examples)["labels"] != -100).sum(1)
    if k is not None:
        assert chosen.tolist() == [min(s.evaluation[1], round(0.15 * 38))] * 8


def test_dataloader_workers_that_persist_follow_the_level(tmp_path, sample_dir, datasets_cache):
    """The level lives in shared memory: a persistent worker, forked at level 0, masks at the level set later."""
    from torch.utils.data import DataLoader
    cfg = config(tmp_path, sample_dir, datasets_cache, **{"data.mlm_probability": 0.3, "data.mlm_probability_end": 0.05})
    cfg.data.max_predictions_per_seq = 20
    collate, tokenizer = collator()
    collate.follow(mask_schedule(cfg.data, cfg.task.kind, cfg.train.compile, 16))
    loader = DataLoader(rows(tokenizer), batch_size=8, collate_fn=collate, num_workers=1, persistent_workers=True)
    counts = []
    for level in (0, 7):
        collate.level = level
        counts.append([int((b["labels"] != -100).sum(1)[0]) for b in loader])
    assert counts == [[round(0.3 * 38)], [round(0.05 * 38)]]


# ----------------------------------------------------------------------------- runs
def moving(shared_tokenizer, **extra):
    return {"tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 16, "checkpoint.save_every": 8,
            "logging.log_every": 1, "data.mlm_probability": 0.3, "data.mlm_probability_end": 0.05,
            "data.eval_mlm_probability": 0.15, **extra}


def history(path: Path) -> dict:
    return json.loads((path / "metrics.json").read_text())["history"]


def test_a_resume_in_the_middle_of_a_level_is_exact_and_evaluation_keeps_its_rate(tmp_path, sample_dir,
                                                                                   datasets_cache, shared_tokenizer):
    """Levels change every 2 steps; halted at step 7 (inside a level, a DataLoader worker that persists) and
    resumed: the losses and the weights of the uninterrupted run, bit for bit, dropout on. The logged rate goes
    from 0.3 to 0.05. Evaluation at another fixed rate changes the eval loss and nothing the training computes."""
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **moving(   # noqa: E731
        shared_tokenizer, **{"data.num_workers": 1, **more}))
    full = run_in_process(args(tmp_path / "full"))
    run_in_process(args(tmp_path / "split", **{"train.halt_at_step": 7}))
    resumed = run_in_process(args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    losses = lambda p: [r["loss"] for r in history(p)["train"]]   # noqa: E731
    assert losses(tmp_path / "split") == losses(tmp_path / "full") and full["steps"] == resumed["steps"] == 16
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "full/model/model.safetensors"), load_file(tmp_path / "split/model/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rates = [r["mlm_probability"] for r in history(tmp_path / "full")["train"]]
    assert rates[0] == 0.3 and rates[-1] == 0.05 and rates == sorted(rates, reverse=True) and len(set(rates)) == 8
    other = run_in_process(args(tmp_path / "other", **{"data.eval_mlm_probability": 0.3}))
    assert losses(tmp_path / "other") == losses(tmp_path / "full")
    assert other["eval_loss"] != full["eval_loss"]
    assert resumed["eval_loss"] == full["eval_loss"]


def test_bad_values_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    cases = [({"data.mlm_probability_end": 1.5}, "data.mlm_probability_end=1.5"),
             ({"data.eval_mlm_probability": 0}, "data.eval_mlm_probability=0"),
             ({"data.mlm_probability_end": 0.05, "task": "classification"},
              "data.mlm_probability_end=0.05 is a masking rate: it needs task.kind=mlm"),
             ({"data.packing": False, "data.length_bins": 8, "train.compile": True, "data.mlm_probability_end": 0.05},
              "data.length_bins=8: each level of the rate is one more compiled shape")]
    for extra, said in cases:
        task = extra.pop("task", "mlm")
        argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache, task=task,
                                            **{"tokenizer.name_or_path": shared_tokenizer, **extra})]
        assert said in refused_in_process(argv, tmp_path, capsys)
