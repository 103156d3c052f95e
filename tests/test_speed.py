"""The speed features, each checked for what it must not change: the static-shape MLM head gives the
loss of the boolean one, torch.compile trains along the same loss curve, length-grouped batches cut
padding and stay exact on resume, DeepSpeed's CPU Adam follows the recipe's optimizer, and a DeepSpeed
JSON shaped like Accelerate's templates (owning optimizer and schedule) trains with the recipe's
values. tools/bench.py (make bench) measures the speed itself; a smoke test keeps it working."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, launch, run_in_process, tiny_args

NO_DROPOUT = {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}


# ----------------------------------------------------------------------------- static shapes, compile
def test_static_positions_give_the_loss_of_the_boolean_head(shared_tokenizer, sample_dir):
    """data.max_predictions_per_seq: the collator passes K positions per sequence; the head gathers
    them (no boolean indexing, the same shapes every batch) and the loss equals the boolean path's on
    the same labels. Half the rows are cut like packed blocks (no [CLS] at position 0, which can then
    be masked) and many are short, so unused slots (which point at position 0) must not count."""
    from transformers import AutoTokenizer, BertConfig

    from bert_recipes.tasks.mlm import MLMCollator
    from bert_recipes.architectures.bert import RecipeBertForMaskedLM
    tok = AutoTokenizer.from_pretrained(shared_tokenizer)
    lines = [l for l in (sample_dir / "pretrain/train.txt").read_text().splitlines() if len(l) > 60][:16]
    examples = []
    for i, line in enumerate(lines):
        e = tok(line, truncation=True, max_length=12 + 3 * i, return_special_tokens_mask=True)
        if i % 2:   # a packed block: cut in the middle of the stream
            e = {k: v[1:] for k, v in e.items()}
        examples.append({**e, "idx": i})
    for seed in range(1, 50):   # a batch where a cut row has position 0 masked and unused slots
        batch = MLMCollator(tok, 0.15, seed=seed, max_predictions=7)(examples)
        chosen = (batch["labels"] != -100).sum(1)
        if any(batch["labels"][r, 0] != -100 and chosen[r] < 7 for r in range(1, 16, 2)):
            break
    else:
        raise AssertionError("no batch with a masked position 0 and unused slots")
    assert batch["masked_positions"].shape == (16, 7)
    assert (chosen <= 7).all() and (chosen >= 1).all()
    torch.manual_seed(0)
    model = RecipeBertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    static = model(**batch).loss
    static.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    dynamic = model(**{k: v for k, v in batch.items() if k != "masked_positions"}).loss
    dynamic.backward()
    torch.testing.assert_close(static, dynamic, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compile_follows_the_same_loss_curve(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """train.compile (inductor on CPU) against eager on the same static-shape batches: the same losses
    within 1e-4 over 12 steps."""
    common = {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 12,
              "logging.log_every": 1, "data.max_predictions_per_seq": 5}
    eager = run_in_process(tiny_args(tmp_path / "eager", sample_dir, datasets_cache, **common))
    compiled = run_in_process(tiny_args(tmp_path / "compiled", sample_dir, datasets_cache,
                                        **{**common, "train.compile": True}))
    a = json.loads((tmp_path / "eager/metrics.json").read_text())["history"]["train"]
    b = json.loads((tmp_path / "compiled/metrics.json").read_text())["history"]["train"]
    gaps = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    assert len(gaps) == 12 and max(gaps) < 1e-4, gaps
    assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], abs=1e-4)
    from safetensors.torch import load_file   # the export of a compiled run is a plain Hugging Face model
    exported, reference = (load_file(tmp_path / name / "model/model.safetensors") for name in ("compiled", "eager"))
    assert exported.keys() == reference.keys()


# ----------------------------------------------------------------------------- dropout masks
def test_packed_dropout_keeps_one_minus_p_and_the_expectation():
    """model.dropout_impl=packed: a 16-bit word per element, kept at or above round(p * 2^16); kept
    values scaled by the inverse of that exact keep probability; the same seed, the same mask; the
    gradient is the mask times the scale."""
    from bert_recipes.dropout import packed_dropout
    x = torch.ones(1_000_003, requires_grad=True)   # not a multiple of four words
    torch.manual_seed(3)
    y = packed_dropout(x, 0.1)
    kept = (y != 0).double().mean().item()
    assert kept == pytest.approx(1 - 6554 / 65536, abs=0.0015)        # binomial sd 0.0003
    values = y.unique().tolist()
    assert len(values) == 2 and values[0] == 0 and values[1] == pytest.approx(65536 / (65536 - 6554))
    assert y.double().mean().item() == pytest.approx(1.0, abs=0.002)   # the expectation is the input's
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach())
    torch.manual_seed(3)
    assert torch.equal(packed_dropout(torch.ones(1_000_003), 0.1), y.detach())
    assert (packed_dropout(torch.ones(1000), 1.0) == 0).all()
    assert (packed_dropout(torch.ones(1000), 1 - 2 ** -18) == 0).all()   # no int16 threshold: nothing kept


def test_packed_attention_is_sdpas_math_path_with_that_mask():
    """The attention used with model.dropout_impl=packed equals torch's own SDPA math kernel fed the same
    dropout mask (aten._scaled_dot_product_attention_math), padding included; without dropout it is
    transformers' sdpa."""
    from types import SimpleNamespace

    from bert_recipes.dropout import attention, keep_mask
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3))
    attend = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    attend[1, :, :, 11:] = False                       # the second sequence: 5 padded positions
    module = SimpleNamespace(training=True, is_causal=False, packed_dropout=True)
    torch.manual_seed(5)
    ours, _ = attention(module, q, k, v, attend, dropout=0.1, scaling=0.3)
    torch.manual_seed(5)
    mask, scale = keep_mask((2, 2, 16, 16), 0.1, "cpu")
    additive = torch.zeros(attend.shape).masked_fill(~attend, float("-inf"))   # what SDPA hands its math kernel
    reference, _ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, additive, 1 - 1 / scale, False, mask,
                                                                       scale=0.3)
    torch.testing.assert_close(ours, reference.transpose(1, 2), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(ours.sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(reference.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain, _ = attention(module, q, k, v, attend, dropout=0.0, scaling=0.3)
    torch.testing.assert_close(plain, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attend, scale=0.3).transpose(1, 2))


@pytest.mark.parametrize("packed", [True, False])
def test_the_recipes_attention_masks_padding_and_exports_plain_sdpa(packed, tmp_path):
    """The recipe's attention (bert_recipes.dropout: its own mask function, which never reads the mask on
    the host; packed dropout masks or torch's) still builds the padding mask (transformers builds none
    for an attention name it has no mask function for): in training, with dropout on, a padded token
    changes nothing at the real positions, and without padding there is no mask at all. Its export has
    no trace of it: it loads as a plain model with sdpa."""
    from transformers import BertConfig, BertForSequenceClassification

    from bert_recipes.dropout import ATTENTION, PackedDropout, padding_mask, use_recipe_attention
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64))
    swapped = use_recipe_attention(model, packed)
    assert model.config._attn_implementation == ATTENTION
    assert swapped == (8 if packed else 0)   # embeddings, 3 per layer, classifier
    assert sum(isinstance(m, PackedDropout) for m in model.modules()) == swapped
    model.train()
    ids = torch.randint(5, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    outputs = []
    for pad_token in (0, 77):
        ids[1, 8:] = pad_token
        torch.manual_seed(9)
        outputs.append(model.bert(ids, attention_mask=mask).last_hidden_state)
    torch.testing.assert_close(outputs[0][0], outputs[1][0])
    torch.testing.assert_close(outputs[0][1, :8], outputs[1][1, :8])
    assert padding_mask(2, 12, 12, attention_mask=None) is None
    model.save_pretrained(tmp_path / "export")
    assert ATTENTION not in (tmp_path / "export/config.json").read_text()
    loaded = BertForSequenceClassification.from_pretrained(tmp_path / "export")
    assert loaded.config._attn_implementation == "sdpa"
    decoder = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                       num_attention_heads=2, intermediate_size=64, is_decoder=True))
    use_recipe_attention(decoder, packed)   # causal attention: transformers' sdpa, only the dropout modules swap
    assert decoder.config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------- padding
def test_length_grouped_batches_cut_padding_and_resume_exactly(tmp_path, sample_dir, datasets_cache,
                                                               shared_tokenizer):
    """Fine-tuning on the sample task: under 10% of the positions are padding with data.group_by_length
    (about 70% without), and halt + resume ends with the uninterrupted run's weights."""
    from safetensors.torch import load_file
    args = {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 24, "data.max_seq_length": 64,
            "data.max_train_samples": "null", "checkpoint.save_every": 12}

    def waste(name, **extra):
        run_in_process(tiny_args(tmp_path / name, sample_dir, datasets_cache, task="classification", **{**args, **extra}))
        rows = json.loads((tmp_path / name / "metrics.json").read_text())["history"]["train"]
        real = sum(r["tokens_per_sec"] * r["window_s"] for r in rows)
        padded = sum(r["padded_tokens_per_sec"] * r["window_s"] for r in rows)
        return 1 - real / padded
    plain, grouped = waste("plain"), waste("grouped", **{"data.group_by_length": True})
    assert grouped < 0.10 and plain > 0.3, (plain, grouped)
    split = tiny_args(tmp_path / "split", sample_dir, datasets_cache, task="classification",
                      **{**args, "data.group_by_length": True})
    run_in_process(split + ["train.halt_at_step=12"])
    run_in_process(split + ["checkpoint.resume=auto"])
    full, resumed = load_file(tmp_path / "grouped/model/model.safetensors"), load_file(tmp_path / "split/model/model.safetensors")
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_length_grouped_batches_under_ddp(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """2 ranks: each rank gets its share of grouped batches (Accelerate shards batch i to rank i % 2) and
    the run ends with identical weights on both ranks."""
    metrics = launch(2, tiny_args(tmp_path / "run", sample_dir, datasets_cache, task="classification", **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "data.group_by_length": True,
        "data.max_train_samples": "null"}))
    final = metrics["final"]
    assert final["num_processes"] == 2 and final["rank_checksums"][0] == final["rank_checksums"][1]
    rows = metrics["history"]["train"]
    assert sum(r["tokens_per_sec"] for r in rows) / sum(r["padded_tokens_per_sec"] for r in rows) > 0.85


# ----------------------------------------------------------------------------- DeepSpeed's optimizer paths
TEMPLATE = {   # the shape of Accelerate's examples/deepspeed_config_templates/zero_stage2_config.json
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True,
                                              "adam_w_mode": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _config_with(tmp_path, name: str, ds: dict):
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    text = (REPO / f"accelerate_configs/{name}.yaml").read_text()
    (tmp_path / "acc.yaml").write_text(text.replace(f"ds_configs/{name}.json", str(tmp_path / "ds.json")))
    return tmp_path / "acc.yaml"


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_json_that_owns_optimizer_and_schedule_trains_with_the_recipes_values(
        stage, tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Accelerate's template JSON (optimizer and schedule blocks) in bf16: the recipe's values fill them,
    and the export holds the fp32 master weights (below)."""
    ds = json.loads(json.dumps(TEMPLATE))
    ds["zero_optimization"]["stage"] = stage
    config = _config_with(tmp_path, f"zero{stage}", ds)
    out = tmp_path / "run"
    metrics = launch(2, tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 16, "train.mixed_precision": "bf16"}),
        backend=f"zero{stage}", config=config)
    final, rows = metrics["final"], metrics["history"]["train"]
    assert final["num_processes"] == 2 and final["backend"]["zero_stage"] == stage
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, rows
    log = (tmp_path / "run.log").read_text()
    assert ("[optim] optimizer AdamW from the DeepSpeed config (lr 0.003, betas [0.9, 0.999], eps 1e-08, weight decay "
            "0.01, none on biases and norms); schedule WarmupDecayLR from the DeepSpeed config (2 warmup steps of 16)"
            in log), log[-3000:]
    assert "its warmup is log-shaped" in log
    # the logged lr is the one the step used: the last of 16 steps decays to 1/14 of the peak
    assert rows[-1]["lr"] == pytest.approx(0.003 / 14) and max(r["lr"] for r in rows) <= 0.003 + 1e-12
    assert_export_holds_fp32_masters(out, f"zero{stage}", steps=16)


def assert_export_holds_fp32_masters(out, backend: str, steps: int):
    """Under DeepSpeed in bf16 the model's parameters are bf16 copies; the export holds the fp32
    master weights: equal, to the bit, to what DeepSpeed's own zero_to_fp32 reads back from the final
    checkpoint, and not merely bf16 values widened. It carries a model card."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from bert_recipes.checkpoint import complete_checkpoints
    exported = load_file(out / "model/model.safetensors")
    assert {v.dtype for v in exported.values()} == {torch.float32}
    masters = get_fp32_state_dict_from_zero_checkpoint(str(complete_checkpoints(out)[-1]))
    compared = [k for k in exported if k in masters]
    assert len(compared) >= len(exported) - 1, (sorted(exported), sorted(masters))
    for k in compared:
        torch.testing.assert_close(exported[k], masters[k].float(), atol=0, rtol=0, msg=k)
    assert any((v != v.bfloat16().float()).any() for v in exported.values()), "only bf16 values, widened"
    card = (out / "model/README.md").read_text()
    for expected in ["masked-language-model pretraining", "none: trained from scratch", f"{steps} optimizer steps of 16",
                     f"{backend} on 2 processes", "bf16 (the weights here are fp32)", "| eval_loss |"]:
        assert expected in card, (expected, card)
    tokens = int(card.split("| tokens seen | ")[1].split(" ")[0].replace(",", ""))
    assert tokens == steps * 16 * 32   # steps x 16 packed sequences x 32 tokens, no padding


def test_a_pinned_value_that_contradicts_the_recipe_is_named(tmp_path):
    from bert_recipes.backends.consistency import check_consistency
    from bert_recipes.backends.plan import LaunchPlan
    from bert_recipes.config import ConfigError, load_config
    ds = json.loads(json.dumps(TEMPLATE))
    ds["optimizer"]["params"]["lr"] = 1e-3
    ds["scheduler"]["type"] = "WarmupCosineLR"
    with pytest.raises(ConfigError) as err:
        check_consistency(load_config(REPO / "recipes/tiny-mlm.yaml"), LaunchPlan(deepspeed=True, ds_config=ds,
                                                                                ds_config_path="ds.json"),
                          1, 2, has_cuda=False)
    message = str(err.value)
    assert "optimizer: recipe optim.lr=0.002, ds.json optimizer.params.lr=0.001" in message
    assert "schedule: recipe optim.decay=linear (DeepSpeed's WarmupDecayLR), ds.json scheduler.type=WarmupCosineLR" \
        in message


@pytest.mark.parametrize("decay", ["linear", "constant", "cosine"])
def test_each_deepspeed_schedule_gets_its_own_params_from_the_recipe(decay):
    """WarmupLR, WarmupDecayLR and WarmupCosineLR take different params (the cosine one takes ratios);
    DeepSpeed's own class is built from what the recipe fills in, and after warmup it follows the
    recipe's curve, down to optim.min_lr_ratio for cosine."""
    from deepspeed.runtime import lr_schedules
    from bert_recipes.backends.deepspeed import DS_SCHEDULES, ds_schedule_values
    from bert_recipes.config import OptimConfig
    from bert_recipes.optim import build_scheduler
    o = OptimConfig(lr=1e-3, decay=decay, warmup_steps=4, min_lr_ratio=0.1 if decay == "cosine" else 0.0)
    ours_opt, ds_opt = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=o.lr) for _ in range(2))
    ours = build_scheduler(ours_opt, o, 20)
    ds_type = DS_SCHEDULES[decay]
    ds = getattr(lr_schedules, ds_type)(ds_opt, warmup_type="linear",
                                       **ds_schedule_values(o, ds_type, ours.warmup_steps, 20))
    lrs = []
    for _ in range(20):
        lrs.append((ours_opt.param_groups[0]["lr"], ds_opt.param_groups[0]["lr"]))
        ours_opt.step(), ours.step(), ds_opt.step(), ds.step()
    if decay != "linear":   # DeepSpeed's WarmupDecayLR runs one step behind; the others meet after warmup
        assert all(a == pytest.approx(b, rel=1e-6) for a, b in lrs[5:]), lrs
    assert 0.99 * o.lr <= max(b for _, b in lrs) <= o.lr * (1 + 1e-9)
    if decay == "cosine":
        assert lrs[-1][1] == pytest.approx(o.lr * 0.1, rel=0.1)


def test_warmup_decay_lr_with_a_floor_is_refused():
    from bert_recipes.backends.deepspeed import ds_block_conflicts
    from bert_recipes.config import load_config
    cfg = load_config(REPO / "recipes/tiny-mlm.yaml", ["optim.min_lr_ratio=0.1"])
    conflicts = ds_block_conflicts(cfg.optim, {"scheduler": TEMPLATE["scheduler"]}, "ds.json")
    assert conflicts == ["schedule: recipe optim.min_lr_ratio=0.1, ds.json scheduler.type=WarmupDecayLR decays to 0 "
                         "(set min_lr_ratio: 0, or drop the JSON's scheduler block)"]


def test_offload_steps_with_deepspeeds_cpu_adam_built_from_the_recipe(tmp_path, sample_dir, datasets_cache,
                                                                      shared_tokenizer):
    """ZeRO-2 offload: DeepSpeed's CPU Adam (the recipe's lr, betas, eps and weight decay) steps the
    optimizer, and the run matches torch's AdamW on the CPU (optim.cpu_adam=false) within 1e-4."""
    common = {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "logging.log_every": 1}
    runs = {}
    ds = json.loads((REPO / "ds_configs/zero2_offload.json").read_text())
    del ds["zero_force_ds_cpu_optimizer"]
    config = _config_with(tmp_path, "zero2_offload", ds)
    for cpu_adam in (True, False):
        out = tmp_path / f"cpu_adam_{cpu_adam}"
        runs[cpu_adam] = launch(2, tiny_args(out, sample_dir, datasets_cache, **{**common, "optim.cpu_adam": cpu_adam}),
                                backend="zero2-offload", config=config if cpu_adam else None)
        final = runs[cpu_adam]["final"]
        assert final["num_processes"] == 2 and final["backend"]["zero_stage"] == 2
        assert final["backend"]["offload_optimizer"] is True
    # the optimizer that steps, read from under ZeRO's wrapper: CPU Adam with decoupled weight decay,
    # even from a JSON that leaves zero_force_ds_cpu_optimizer at its default (Accelerate would rebuild it)
    assert "[optim] stepping: DeepSpeedCPUAdam (adamw_mode=True, lr 0.003" in (tmp_path / "cpu_adam_True.log").read_text()
    assert "[optim] stepping: AdamW (fused=True, lr 0.003" in (tmp_path / "cpu_adam_False.log").read_text()
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(runs[True]["history"]["train"], runs[False]["history"]["train"])]
    assert max(gaps) < 1e-4, gaps


# ----------------------------------------------------------------------------- make bench
def test_bench_smoke_writes_the_table_and_the_chart(tmp_path, sample_dir):
    """Not a speed test: the table has its rows and columns, every number is finite, each run was written
    down as it finished (bench.jsonl), and the collation and fetch costs, the accuracy check and the profile
    are there. Three of the rows (--rows); the GPU session's rows (train.py fine-tuning, the Trainer's MLM
    rows, the compile rows) run in tests/test_gpu_session.py's rehearsal, and train.compile has its own
    tests above."""
    out = tmp_path / "bench"
    rows = ("mlm: train.py|mlm: train.py, packed dropout|classify: Trainer|classify: train.py|classify: train.py, "
            "unpadded|mlm: train.py, documents apart")
    proc = subprocess.run([sys.executable, "tools/bench.py", "--size", "tiny", "--steps", "20", "--classify-steps", "20",
                           "--warmup", "10", "--repeats", "1", "--precisions", "no", "--out", str(out), "--profile",
                           "--rows", rows, "--quality-seeds", "0",   # quality: tests/test_references.py
                           "--accuracy", "--accuracy-seeds", "1", "--accuracy-steps", "8", "--accuracy-pretrain-steps", "4",
                           "--sample-dir", str(sample_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    names = {row["name"] for row in result["rows"]}
    assert names == set(rows.split("|")), names
    for row in result["rows"]:
        for key in ("tokens_per_s", "sequences_per_s", "mfu_anchors", "mfu_ours", "data_wait", "peak_memory_mb",
                    "padding", "shapes"):
            assert row[key] == row[key] and row[key] >= 0, (key, row)
    ours = next(r for r in result["rows"] if r["name"] == "mlm: train.py")
    assert ours["mfu_anchors"] > ours["mfu_ours"] and ours["shapes"] == 1   # the dense head counts more FLOPs
    assert all(r["ratio"] > 0 for r in result["ratios"]) and len(result["ratios"]) == 4
    # no compute on padding against grouped batches, documents apart against plain packing (data.unpad, document_mask)
    by_name = {r["name"]: r for r in result["rows"]}
    assert by_name["classify: train.py, unpadded"]["padding"] == 0 < by_name["classify: train.py"]["padding"]
    assert by_name["mlm: train.py, documents apart"]["padding"] == 0 and by_name["mlm: train.py, documents apart"]["shapes"] == 1
    assert {"classify: train.py, unpadded / classify: train.py", "mlm: train.py, documents apart / mlm: train.py"} <= \
        {r["what"] for r in result["ratios"]}
    journal = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in journal) == sorted(rows.split("|"))   # each run kept as it finished
    assert set(result["collate_ms"]) == {"K predictions (default)", "whole-word masking, K", "per-token choice"}
    assert all(0 < ms < 1000 for by_batch in result["collate_ms"].values() for ms in by_batch.values())
    assert set(result["fetch_ms"]) == {"row by row", "one call", "one call, documents apart", "one call, best-fit rows"}
    text = (out / "bench.md").read_text()
    assert text.count("| mlm") >= 2 and "| collate: K predictions (default) |" in text and "MFU, anchors'" in text
    assert "on CPUs both run a dense block-diagonal mask" in text   # the CPU proxy's limits, beside the rows
    assert (out / "bench.png").stat().st_size > 10_000
    grouped, plain = result["accuracy"]["runs"]["grouped"][0], result["accuracy"]["runs"]["not grouped"][0]
    assert 0 <= grouped["accuracy"] <= 1 and 0 <= plain["accuracy"] <= 1
    assert grouped["padding"] < plain["padding"] / 2, (grouped, plain)
    assert "| not grouped |" in text
    assert "## Where train.py's MLM step spends its time (no)" in text and "aten::addmm" in text, text[-2000:]


# ----------------------------------------------------------------------------- shapes that repeat
@pytest.fixture
def strict_after(monkeypatch):
    """strict_after(warmed_up) -> state: wraps train.py's step; once warmed_up(engine, shapes seen) holds
    after a step, torch.compiler.set_stance("fail_on_recompile") (public API): from then on a recompile
    fails the run. Dynamo's caches and the stance are reset around the test."""
    import train
    original, state = train.train_step, {"seen": set(), "strict_from": None, "steps": 0}

    def install(warmed_up):
        def step(run, batches):
            def watched():
                for batch in batches:
                    state["seen"].add(tuple(batch["input_ids"].shape))
                    yield batch
            out = original(run, watched())
            state["steps"] += 1
            if state["strict_from"] is None and warmed_up(run.engine, state["seen"]):
                torch.compiler.set_stance("fail_on_recompile")
                state["strict_from"] = state["steps"]
            return out
        monkeypatch.setattr(train, "train_step", step)
        return state
    torch.compiler.reset()
    yield install
    torch.compiler.set_stance("default")
    torch.compiler.reset()


COMPILE_FAST = {"train.compile": True, "train.compile_backend": "eager"}   # dynamo's tracing and guards, no kernels


def test_mlm_compiles_once_and_never_again(strict_after, tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Packed blocks with K predictions have one shape: compiled with dynamic=False, no recompile after the
    first step, evaluations (eager, under train.compile) included."""
    state = strict_after(lambda engine, seen: True)
    metrics = run_in_process(tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        **COMPILE_FAST, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "train.eval_every": 4}))
    assert metrics["backend"]["compile"] == {"backend": "eager", "mode": "default", "dynamic": False}
    assert state["strict_from"] == 1 and state["steps"] == 8 and metrics["batch_shapes"] == 1
    assert metrics["eval_loss"] == metrics["eval_loss"]


def test_fine_tuning_compiles_each_length_bin_once(strict_after, tmp_path, sample_dir, datasets_cache,
                                                   shared_tokenizer):
    """data.length_bins=4: once every bin has been trained on, no recompile (4 graphs, within dynamo's
    recompile limit of 8); without bins the shapes keep changing and the same check fails the run."""
    args = {**COMPILE_FAST, **NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 24,
            "train.eval_every": 12, "data.max_seq_length": 64, "data.group_by_length": True,
            "data.max_train_samples": "null"}
    state = strict_after(lambda engine, seen: {width for _, width in seen} >= set(engine.collate.bins))
    metrics = run_in_process(tiny_args(tmp_path / "bins", sample_dir, datasets_cache, task="classification",
                                       **{**args, "data.length_bins": 4}))
    assert metrics["backend"]["compile"]["dynamic"] is False
    assert metrics["batch_shapes"] <= 4 and state["strict_from"] is not None and state["strict_from"] < 24, state
    state.update(seen=set(), strict_from=None, steps=0)
    torch.compiler.set_stance("default")
    torch.compiler.reset()
    state = strict_after(lambda engine, seen: True)
    with pytest.raises(Exception, match="(?i)recompil"):
        run_in_process(tiny_args(tmp_path / "no_bins", sample_dir, datasets_cache, task="classification",
                                 **{**args, "data.length_bins": 0}))


def test_length_bins_keep_padding_low_and_shapes_few(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """The sample task at sequence 128 with length grouping: 8 bins keep padding under 10% of the positions
    (about 3% without bins) in at most 8 batch shapes, where the batches' own longest lengths give dozens."""
    args = {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 40, "data.max_seq_length": 128,
            "model.max_position_embeddings": 128, "data.group_by_length": True, "data.max_train_samples": "null",
            "logging.log_every": 40}
    found = {}
    for bins in (0, 8):
        metrics = run_in_process(tiny_args(tmp_path / f"bins{bins}", sample_dir, datasets_cache, task="classification",
                                           **{**args, "data.length_bins": bins}))
        row = json.loads((tmp_path / f"bins{bins}/metrics.json").read_text())["history"]["train"][-1]
        found[bins] = (1 - row["tokens_per_sec"] / row["padded_tokens_per_sec"], metrics["batch_shapes"])
    (plain_padding, plain_shapes), (binned_padding, binned_shapes) = found[0], found[8]
    print(f"[length bins] padding and shapes: {found}")
    assert binned_padding < 0.10 and binned_shapes <= 8 < plain_shapes, found
