"""Documents that attend apart (bert_recipes/attention.py): a packed row's documents (data.document_mask) and a batch
run as one row of its real tokens (data.unpad). In fp32 with dropout off, each document of a packed row gets the
logits it gets alone, and unpadded classification and MLM give the padded path's logits and losses, each with a
control that must differ (the mask off); the packer's document ids; runs on 2 processes on a row of each engine kind,
ZeRO stage and an offload (accelerate_configs/backends.tsv), each within TOL of DDP; a
resume, bit-exact on the same count and within the suite's band on another; each bad combination one line."""
from __future__ import annotations

import json

import pytest
import torch

from bert_recipes.architectures import ARCHITECTURES as TABLE, module
from bert_recipes.attention import block_mask, choose_path, cu_seqlens, positions_within
from bert_recipes.config import ModelConfig, TaskConfig
from bert_recipes.models import build_model, model_config
from conftest import assert_row_is_ddp, backend_rows, feature_rows, launch, refused_in_process, run_in_process, tiny_args

TOL = 1e-5   # fp32, dropout off: the measured gaps are about 1e-7


# Every architecture of the table, as its file's tiny model (TINY: ModernBERT's local layer reaches 4 tokens, under
# every test's lengths)
ARCHITECTURES = {name: {"architecture": name, **module(name).TINY} for name in TABLE}


def tiny(kind: str, attn: str = "sdpa", labels: int = 3, path: str | None = "mask", seed: int = 0, vocab: int = 100,
         arch: str = "bert", **fields):
    torch.manual_seed(seed)
    cfg = ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      max_position_embeddings=64, attention_probs_dropout_prob=0.0, attn_implementation=attn,
                      **ARCHITECTURES[arch])
    task = TaskConfig(kind=kind, num_labels=labels)
    config = model_config(cfg, task, vocab, 0)
    # the architecture's tiny config values (its file's TINY_CONFIG), then the test's (a classifier's pooling)
    for key, value in {**module(arch).TINY_CONFIG, **fields}.items():
        setattr(config, key, value)
    return build_model(cfg, task, config=config, attention_path=path).eval()


def test_positions_restart_and_lengths_are_counted_on_the_host():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    assert positions_within(doc).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2]]
    cu, longest = cu_seqlens(doc)
    assert cu.tolist() == [0, 3, 5, 8, 13, 16] and cu.dtype == torch.int32 and longest == 5
    assert block_mask(doc, None)[0, 0].int().tolist()[3] == [0, 0, 0, 1, 1, 0, 0, 0]
    additive = block_mask(doc, torch.float32)
    assert additive[0, 0, 0, 3] == torch.finfo(torch.float32).min and additive[0, 0, 0, 1] == 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_document_of_a_packed_row_gets_the_logits_it_gets_alone(attn, arch):
    """Three documents in one row with document ids (positions restarting at each) against each run alone: equal to
    1e-5 under SDPA (a bool mask) and eager attention (an additive mask), BERT and ModernBERT (whose local layer's
    mask is also within its window). The control, the same row without document ids (today's packing: attention
    crosses documents, positions run on), differs."""
    model = tiny("mlm", attn, arch=arch)
    docs = [torch.randint(5, 100, (1, n)) for n in (11, 7, 14)]
    row = torch.cat(docs, 1)
    ids = torch.cat([torch.full((1, d.size(1)), i) for i, d in enumerate(docs)], 1)
    with torch.no_grad():
        packed = model(row, document_ids=ids).logits
        alone = torch.cat([model(d).logits for d in docs], 1)
        crossing = model(row).logits
    assert (packed - alone).abs().max() < TOL
    assert (crossing - alone).abs().max() > 1e-3   # the control: without the mask the documents see each other


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_flex_attention_forward_matches_the_mask_path_on_cpu(arch):
    """The GPU's FlexAttention path, forward only (its backward needs a GPU): the same logits as the mask path (for
    ModernBERT's local layer, its window in the block mask)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    mask_model, flex_model = tiny("mlm", path="mask", arch=arch), tiny("mlm", path="flex", arch=arch)
    flex_model.load_state_dict(mask_model.state_dict())
    row = torch.randint(5, 100, (2, 32))
    ids = torch.tensor([[0] * 10 + [1] * 22, [0] * 16 + [1] * 16])
    with torch.no_grad():
        a, b = mask_model(row, document_ids=ids).logits, flex_model(row, document_ids=ids).logits
    assert (a - b).abs().max() < TOL


def test_flex_attention_takes_fewer_key_value_heads_than_query_heads():
    """Grouped queries (an encoder with num_key_value_heads < num_attention_heads): FlexAttention's document path
    gives what sdpa gives with each key/value head repeated for its queries under the same document mask. Control:
    the path without its grouping is refused by FlexAttention (the shapes differ)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from bert_recipes.attention import flex_attention
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 32, 16), torch.randn(2, 2, 32, 16), torch.randn(2, 2, 32, 16)
    ids = torch.tensor([[0] * 10 + [1] * 22, [0] * 16 + [1] * 16])
    got, _ = flex_attention(None, q, k, v, None, scaling=0.25, document_ids=ids)
    same = (ids[:, :, None] == ids[:, None, :])[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=same, scale=0.25).transpose(1, 2)
    assert got.shape == (2, 32, 4, 16) and (got - want).abs().max() < TOL
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex
    mask = create_block_mask(lambda b, h, i, j: ids[b, i] == ids[b, j], 2, None, 32, 32, device="cpu")
    with pytest.raises(Exception):
        flex(q, k, v, block_mask=mask, scale=0.25)


def test_a_fresh_model_takes_the_special_ids_its_row_names():
    """The tokenizer's special ids (modeling.special_token_ids: the mask id too) reach a fresh config of each
    architecture as its row's special_ids say: BERT the pad id, ModernBERT pad, cls, sep and bos/eos as cls/sep."""
    from types import SimpleNamespace
    from bert_recipes.modeling import SPECIAL_IDS, special_token_ids
    tok = SimpleNamespace(pad_token_id=0, cls_token_id=2, sep_token_id=3, mask_token_id=4)
    ids = special_token_ids(tok)
    assert set(ids) == set(SPECIAL_IDS) and ids["mask_token_id"] == 4 and (ids["bos_token_id"], ids["eos_token_id"]) == (2, 3)
    for name, row in TABLE.items():
        cfg = ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          max_position_embeddings=64, **ARCHITECTURES[name])
        config = model_config(cfg, TaskConfig(kind="mlm"), 100, 0, ids)
        assert {key: getattr(config, key) for key in row.special_ids} == {key: ids[key] for key in row.special_ids}
    assert TABLE["modernbert"].special_ids == SPECIAL_IDS[:5] and TABLE["bert"].special_ids == ("pad_token_id",)


def padded_batch(lengths, labels):
    from bert_recipes.data.collate import _collate
    torch.manual_seed(1)
    rows = [{"input_ids": [2] + torch.randint(5, 100, (n - 2,)).tolist() + [3], "token_type_ids": [0] * n,
             "labels": label} for n, label in zip(lengths, labels)]
    return _collate(rows, pad_id=0, pad_to_multiple_of=None, fixed_length=None)


@pytest.mark.parametrize("arch, pooling", [*((name, None) for name in TABLE), ("modernbert", "mean")])
@pytest.mark.parametrize("num_labels", [3, 1])
def test_unpadded_classification_gives_the_padded_logits_and_loss(num_labels, arch, pooling):
    """One row of four sequences' real tokens (data.unpad) against the padded batch: the pooled output's logits and
    the loss equal to 1e-5, classification and regression; ModernBERT pooling the first token or the mean. Control:
    the row without its sequences apart differs."""
    from bert_recipes.data.collate import unpadded
    model = tiny("classification", labels=num_labels, arch=arch, **({"classifier_pooling": pooling} if pooling else {}))
    labels = [0, 2, 1, 2] if num_labels > 1 else [0.5, 1.5, -1.0, 2.0]
    batch = padded_batch([9, 17, 5, 12], labels)
    flat = unpadded(dict(batch))
    assert flat["input_ids"].shape == (1, 9 + 17 + 5 + 12) and flat["sequence_starts"].tolist() == [0, 9, 26, 31]
    with torch.no_grad():
        padded, unpad = model(**batch), model(**flat)
        joined = model(**{**flat, "document_ids": torch.zeros_like(flat["document_ids"])})
    assert (padded.logits - unpad.logits).abs().max() < TOL and abs(padded.loss - unpad.loss) < TOL
    gap = (joined.logits - padded.logits).abs()
    assert gap[gap.isfinite()].max() > 1e-3   # (under mean pooling only the first sequence still has tokens)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_unpadded_mlm_gives_the_padded_loss(arch):
    """Unpacked MLM with K slots a sequence: the unpadded row's loss and its slots' logits equal the padded ones."""
    from transformers import PreTrainedTokenizerFast

    from bert_recipes.data.collate import unpadded
    from bert_recipes.tasks.mlm import MLMCollator
    from conftest import REPO, column
    tokenizer = PreTrainedTokenizerFast.from_pretrained(REPO / "tests/data/wordpiece-1000")
    model = tiny("mlm", vocab=len(tokenizer), arch=arch)
    texts = ["the quick brown fox jumps over the lazy dog", "a b", "print the value of the variable and return it",
             "lists and tuples are sequences"]
    rows = [dict(tokenizer(t, return_special_tokens_mask=True), idx=i) for i, t in enumerate(texts)]
    collate = MLMCollator(tokenizer, 0.3, seed=3, pad_to_multiple_of=None, max_predictions=4)
    batch = collate(rows)
    flat = unpadded(dict(batch))
    with torch.no_grad():
        padded, unpad = model(**batch), model(**flat)
    assert abs(padded.loss - unpad.loss) < TOL and (padded.logits - unpad.logits).abs().max() < TOL
    assert flat["input_ids"].shape[1] == int(batch["attention_mask"].sum())


def test_the_packer_keeps_each_documents_tokens_and_cuts_a_long_one(tmp_path):
    """data.document_mask's packed blocks: each block's document ids start at 0 and count up; a document longer than
    the rest of a block goes on as the next block's document 0 (positions from 0); the token ids are the plain
    packer's, read from the same token store (the documents come from its index as a block is read)."""
    from datasets import Dataset, DatasetDict
    from transformers import PreTrainedTokenizerFast

    from bert_recipes.config import DataConfig
    from bert_recipes.tasks.mlm import tokenize
    from conftest import REPO, column
    tokenizer = PreTrainedTokenizerFast.from_pretrained(REPO / "tests/data/wordpiece-1000")
    lines = ["the value of x", "a very long line " * 8, "return it", "print the list and the dict"] * 3
    raw = DatasetDict({"train": Dataset.from_dict({"text": lines}), "eval": Dataset.from_dict({"text": lines[:4]})})
    plain = tokenize(raw, tokenizer, TaskConfig(kind="mlm"), DataConfig(max_seq_length=16, cache_dir=str(tmp_path)))
    apart = tokenize(raw, tokenizer, TaskConfig(kind="mlm"), DataConfig(max_seq_length=16, document_mask=True,
                                                                        cache_dir=str(tmp_path)))
    assert column(apart["train"], "input_ids") == column(plain["train"], "input_ids")
    assert apart["train"].store.root == plain["train"].store.root and "document_ids" not in plain["train"][0]
    docs = column(apart["train"], "document_ids")
    lengths = [len(tokenizer(t)["input_ids"]) for t in lines]
    assert all(row[0] == 0 and all(b - a in (0, 1) for a, b in zip(row, row[1:])) for row in docs)
    assert docs[0][:lengths[0]] == [0] * lengths[0] and docs[0][lengths[0]] == 1   # the second document starts
    assert docs[1] == [0] * 16 and lengths[1] > 16 + (16 - lengths[0])   # the long line fills block 1: its document 0


def test_bad_combinations_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    cases = [({"data.packing": False, "data.document_mask": True}, "data.document_mask=true keeps a packed row's"),
             ({"data.unpad": True}, "data.unpad=true is for padded batches"),
             ({"data.packing": False, "data.unpad": True, "data.length_bins": 4}, "data.length_bins=4 pads batches"),
             ({"data.packing": False, "data.unpad": True, "train.compile": True}, "train.compile with data.unpad=true")]
    for extra, said in cases:
        argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache,
                                            **{"tokenizer.name_or_path": shared_tokenizer, **extra})]
        assert said in refused_in_process(argv, tmp_path, capsys)
    path, why = choose_path(True, "no", 0.1, 2048)   # a GPU, attention dropout, 2k tokens: no path serves
    assert why and "model.attention_probs_dropout_prob=0" in why
    assert choose_path(True, "bf16", 0.0, 8192) == ("varlen", None) and choose_path(True, "no", 0.0, 8192)[0] == "flex"
    assert choose_path(False, "bf16", 0.1, 8192) == ("mask", None)
    from bert_recipes.backends.deepspeed import pipeline_conflicts
    from bert_recipes.backends.plan import LaunchPlan
    from bert_recipes.config import load_config
    cfg = load_config(None, tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{"data.document_mask": True}))
    plan = LaunchPlan(deepspeed=True, ds_config={"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}})
    assert any("data.document_mask or data.unpad under the pipeline engine" in c for c in pipeline_conflicts(cfg, plan, "x"))


# ----------------------------------------------------------------------------- runs
def common(shared_tokenizer, **extra):
    return {"tokenizer.name_or_path": shared_tokenizer, "model.hidden_dropout_prob": 0.0,
            "model.attention_probs_dropout_prob": 0.0, "train.max_steps": 16, "checkpoint.save_every": 8,
            "logging.log_every": 4, **extra}


# The rows these features run on: conftest.feature_rows (the pipeline refuses them in one line:
# test_bad_combinations_are_one_line; best-fit needs document masks).
PLANS = {name: row.plan for name, row in backend_rows().items()}
ROWS = feature_rows()


@pytest.fixture(scope="module")
def pad_free(tmp_path_factory, sample_dir, datasets_cache, shared_tokenizer):
    """run(name, case) -> the row's metrics.json, launched once per module: case "mlm" packs documents apart
    (data.document_mask), case "unpad" fine-tunes one shared MLM export with length-grouped, unpadded batches
    (data.group_by_length, data.unpad: the batch sampler that left DeepSpeed's micro batch unset)."""
    root = tmp_path_factory.mktemp("pad_free")
    export = root / "export"
    run_in_process(tiny_args(export, sample_dir, datasets_cache, **common(shared_tokenizer, **{"train.max_steps": 8})))
    cases = {"mlm": lambda out: tiny_args(out, sample_dir, datasets_cache, **common(
                 shared_tokenizer, **{"data.document_mask": True, "train.max_steps": 12})),
             "best_fit": lambda out: tiny_args(out, sample_dir, datasets_cache, **common(
                 shared_tokenizer, **{"data.document_mask": True, "data.packing": "best_fit", "train.max_steps": 12})),
             "unpad": lambda out: tiny_args(out, sample_dir, datasets_cache, task="classification", **{
                 "model.name_or_path": export / "model", "model.hidden_dropout_prob": 0.0,
                 "model.attention_probs_dropout_prob": 0.0, "data.unpad": True, "data.group_by_length": True,
                 "train.max_steps": 12, "logging.log_every": 4})}
    done = {}

    def run(name: str, case: str) -> dict:
        if (name, case) not in done:
            done[name, case] = launch(2, cases[case](root / f"{case}-{name}"), backend=name)
        return done[name, case]
    return run


def test_the_rows_cover_every_zero_stage_and_an_offload():
    assert {PLANS[n].zero_stage for n in ROWS if PLANS[n].kind == "deepspeed"} == {1, 2, 3}
    assert {"ddp", "fsdp"} <= {PLANS[n].kind for n in ROWS} and PLANS[ROWS[-1]].offload == "cpu", ROWS


@pytest.mark.parametrize("case", ["mlm", "best_fit", "unpad"])
@pytest.mark.parametrize("backend", ROWS)
def test_documents_apart_and_unpadded_batches_match_ddp_on_every_row(backend, case, pad_free):
    """Each row on 2 processes, the backend engaged: packed MLM with data.document_mask, the same best-fit
    (data.packing: best_fit: its padding not counted as tokens), and fine-tuning with length-grouped unpadded batches
    (no padding counted); each learns, and its losses are DDP's within TOL."""
    ours, ref = pad_free(backend, case), pad_free("ddp", case)
    assert_row_is_ddp(backend, ours, ref, TOL)
    final, rows = ours["final"], ours["history"]["train"]
    if case == "unpad":
        assert all(r["padded_tokens_per_sec"] == pytest.approx(r["tokens_per_sec"]) for r in rows)   # no padding
    if case == "best_fit":
        assert all(r["tokens_per_sec"] < r["padded_tokens_per_sec"] for r in rows)   # the rows' tails, not counted
        assert final["eval_samples"] == final["eval_dataset_size"]
    (evaluated,), (reference,) = ours["history"]["eval"], ref["history"]["eval"]
    if case != "unpad":
        assert abs(evaluated["eval_loss"] - reference["eval_loss"]) < TOL, (evaluated, reference)
    else:   # no eval loss for a classifier: its predictions, one sample's flip allowed for the summation order
        assert abs(evaluated["accuracy"] - reference["accuracy"]) <= 1 / final["eval_samples"], (evaluated, reference)


@pytest.mark.parametrize("extra", [{"data.document_mask": True},
                                   {"data.packing": False, "data.unpad": True, "data.max_predictions_per_seq": 5}],
                         ids=["document_mask", "unpad"])
def test_a_resume_is_exact(extra, tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Halted at step 8 and resumed on the same process count: bit-equal to the uninterrupted run."""
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, **extra, **more))  # noqa: E731
    full = run_in_process(args(tmp_path / "full"))
    run_in_process(args(tmp_path / "split", **{"train.halt_at_step": 8}))
    resumed = run_in_process(args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    losses = lambda p: [r["loss"] for r in json.loads((p / "metrics.json").read_text())["history"]["train"]]   # noqa: E731
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "full/model/model.safetensors"), load_file(tmp_path / "split/model/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full["steps"] == resumed["steps"] == 16


def test_a_document_masked_resume_on_another_process_count_stays_in_the_band(tmp_path, sample_dir, datasets_cache,
                                                                            shared_tokenizer):
    """2 processes halted at step 8, resumed on 1: the uninterrupted 2-process run's weights within the suite's
    tolerance for another summation order (1e-5)."""
    from conftest import assert_same_weights
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **common(   # noqa: E731
        shared_tokenizer, **{"data.document_mask": True}, **more))
    launch(2, args(tmp_path / "full"))
    launch(2, args(tmp_path / "split", **{"train.halt_at_step": 8}))
    one = launch(1, args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 16
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "split/model/model.safetensors", 1e-5)
