"""ModernBERT (model.architecture=modernbert, bert_recipes/architectures/modernbert.py) through the recipe's own runs:
packed documents that attend apart, StableAdamW, halted and resumed bit-exact on one process; 2 processes under DDP,
FSDP2 and ZeRO-3, and ZeRO-2 halted on 2 and resumed on 1, ending within the suite's band of the DDP run; the export loads with
AutoModelForMaskedLM and gives the training class's logits; FSDP's unit is its encoder layer; each field of the other
architecture, an unknown architecture, a checkpoint of the other one and the pipeline engine are one line each.

Every run here has a local window (16 tokens, a reach of 8) under its sequence length (32), so both layer types run.
The planner's and the MFU's terms are tests/test_memory.py's and tests/test_perf.py's; the attention paths'
equalities, tests/test_attention.py's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bert_recipes.config import ConfigError, ModelConfig, TaskConfig, load_config
from bert_recipes.models import build_model, model_config
from conftest import assert_same_weights, launch, refused_in_process, run_in_process, tiny_args

TOL = 1e-5   # fp32, no dropout (ModernBERT's): another process count sums in another order
MODERN = {"model.architecture": "modernbert", "model.local_attention": 16, "model.global_attn_every_n_layers": 2,
          "model.global_rope_theta": 10000, "data.packing": True, "data.document_mask": True, "train.max_steps": 12,
          "logging.log_every": 1}


def args(out: Path, sample_dir, datasets_cache, shared_tokenizer, **extra) -> list[str]:
    return tiny_args(out, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer, **MODERN, **extra})


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in json.loads((out / "metrics.json").read_text())["history"]["train"]]


def test_a_halted_modernbert_resumes_bit_exact_and_exports_as_itself(tmp_path, sample_dir, datasets_cache,
                                                                      shared_tokenizer):
    """One process, StableAdamW and attention output dropout 0.1 (ModernBERT's), packed rows whose documents attend
    apart: halted at step 6 and resumed, the uninterrupted run's losses and weights bit for bit; the step reads nothing on the host between log
    steps (logging.sync_audit). The export is transformers' ModernBERT with both
    layer types; AutoModelForMaskedLM gives the training class's logits (1e-5) on a padded batch longer than the
    window. The loss goes down."""
    full, split = tmp_path / "full", tmp_path / "split"
    modern = {"optim.name": "stable_adamw", "model.attention_output_dropout": 0.1}   # ModernBERT's, drawn anew on resume
    run_in_process(args(full, sample_dir, datasets_cache, shared_tokenizer, **modern))
    run_in_process(args(split, sample_dir, datasets_cache, shared_tokenizer, **modern, **{"train.halt_at_step": 6}))
    resumed = run_in_process(args(split, sample_dir, datasets_cache, shared_tokenizer,
                                  **modern, **{"checkpoint.resume": "auto"}))
    assert resumed["steps"] == 12 and losses(split) == losses(full) and losses(full)[-1] < losses(full)[0]
    audited = run_in_process(args(tmp_path / "audit", sample_dir, datasets_cache, shared_tokenizer, **{
        "optim.name": "stable_adamw", "train.max_steps": 4, "logging.sync_audit": True}))
    assert audited["sync_audit"] == {}   # no host read in the step between log steps (StableAdamW's skip included)
    assert_same_weights(full / "model/model.safetensors", split / "model/model.safetensors", 0.0)

    from transformers import AutoModelForMaskedLM

    from bert_recipes.architectures.modernbert import RecipeModernBertForMaskedLM
    from bert_recipes.dropout import use_recipe_attention
    config = json.loads((full / "model/config.json").read_text())
    assert config["architectures"] == ["ModernBertForMaskedLM"] and config["local_attention"] == 16
    assert set(config["layer_types"]) == {"full_attention", "sliding_attention"}
    plain = AutoModelForMaskedLM.from_pretrained(full / "model").eval()
    ours = RecipeModernBertForMaskedLM.from_pretrained(full / "model").eval()
    use_recipe_attention(ours, packed=False)
    assert type(plain).__name__ == "ModernBertForMaskedLM"
    ids = torch.randint(5, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.no_grad():
        a, b = plain(input_ids=ids, attention_mask=mask).logits, ours(input_ids=ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max() < TOL


def test_modernbert_trains_on_2_processes_and_resumes_on_1(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """DDP on 2 processes (every rank's weights equal); FSDP2 on 2 (forced onto CPU processes by the tests' harness,
    its units the model's own layer class) and ZeRO-3 (parameters sharded, the export gathered) within 1e-5 of DDP;
    ZeRO-2 on 2 processes halted at step 6 and resumed on
    1: it ends within 1e-5 of the DDP run's weights, with the DDP run's losses before the halt."""
    ddp = launch(2, args(tmp_path / "ddp", sample_dir, datasets_cache, shared_tokenizer))
    assert ddp["final"]["num_processes"] == 2 and ddp["final"]["backend"]["name"] == "ddp"
    assert len({tuple(row) for row in ddp["final"]["rank_checksums"]}) == 1   # every rank holds the same weights
    fsdp = launch(2, args(tmp_path / "fsdp", sample_dir, datasets_cache, shared_tokenizer), backend="fsdp")
    assert fsdp["final"]["num_processes"] == 2 and fsdp["final"]["backend"]["name"] == "fsdp"
    assert fsdp["final"]["backend"]["params_sharded"]   # FSDP2 units of ModernBertEncoderLayer (backends/fsdp.py)
    assert_same_weights(tmp_path / "ddp/model/model.safetensors", tmp_path / "fsdp/model/model.safetensors", TOL)
    zero3 = launch(2, args(tmp_path / "zero3", sample_dir, datasets_cache, shared_tokenizer), backend="zero3")
    assert zero3["final"]["num_processes"] == 2 and zero3["final"]["backend"]["name"] == "zero3"
    assert zero3["final"]["backend"]["params_sharded"] and "DEEPSPEED" in zero3["final"]["backend"]["distributed_type"]
    assert_same_weights(tmp_path / "ddp/model/model.safetensors", tmp_path / "zero3/model/model.safetensors", TOL)
    zero = launch(2, args(tmp_path / "zero2", sample_dir, datasets_cache, shared_tokenizer,
                          **{"train.halt_at_step": 6}), backend="zero2")
    assert zero["final"] == {"steps": 6, "halted": True}
    assert ("[backend] name=zero2, distributed_type=DistributedType.DEEPSPEED, num_processes=2"
            in (tmp_path / "zero2.log").read_text())
    one = launch(1, args(tmp_path / "zero2", sample_dir, datasets_cache, shared_tokenizer,
                         **{"checkpoint.resume": "auto"}), backend="zero2")
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 12
    assert one["final"]["backend"]["name"] == "zero2"
    assert losses(tmp_path / "zero2")[:6] == pytest.approx(losses(tmp_path / "ddp")[:6], abs=TOL)
    assert_same_weights(tmp_path / "ddp/model/model.safetensors", tmp_path / "zero2/model/model.safetensors", TOL)


def test_fsdp_wraps_the_models_own_encoder_layer():
    """accelerate_configs/fsdp.yaml names BertLayer; a ModernBERT gets its own layer class as FSDP's unit (Accelerate's
    own wrap policy then finds it), a BERT keeps BertLayer, and a config naming a class of its own keeps it."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from bert_recipes.backends.fsdp import wrap_model_layers
    for arch, layer in (("modernbert", "ModernBertEncoderLayer"), ("bert", "BertLayer")):
        model = tiny_model(arch)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["BertLayer"])
        wrap_model_layers(plugin, model)
        assert plugin.transformer_cls_names_to_wrap == [layer]
        plugin.set_auto_wrap_policy(model)   # Accelerate's: raises where the model has no such class
        units = [m for m in model.modules() if plugin.auto_wrap_policy(m, recurse=False, nonwrapped_numel=0)]
        assert len(units) == 2 and {type(m).__name__ for m in units} == {layer}
    custom = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["ModernBertEmbeddings", "BertLayer"])
    wrap_model_layers(custom, tiny_model("modernbert"))
    assert custom.transformer_cls_names_to_wrap == ["ModernBertEmbeddings", "BertLayer"]


def tiny_model(arch: str):
    fields = {"local_attention": 16, "global_attn_every_n_layers": 2} if arch == "modernbert" else {}
    cfg = ModelConfig(architecture=arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, **fields)
    task = TaskConfig(kind="mlm")
    return build_model(cfg, task, config=model_config(cfg, task, 100, 0))


def test_bad_architecture_fields_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """A field of the other architecture, an unknown one, and a ModernBERT checkpoint named architecture bert: one
    line each, nothing written. The pipeline engine, which cuts BERT's layers, refuses ModernBERT in one line."""
    export = tmp_path / "modern-export"
    tiny_model("modernbert").save_pretrained(export)
    cases = [({"model.architecture": "modernbert", "model.hidden_dropout_prob": 0.1},
              "model.hidden_dropout_prob=0.1 is BERT's; model.architecture=modernbert has no such field: remove it "
              "(or set model.architecture=bert)"),
             ({"model.local_attention": 64}, "model.local_attention=64 is ModernBERT's; model.architecture=bert has "
                                             "no such field: remove it (or set model.architecture=modernbert)"),
             ({"model.attention_output_dropout": 0.1}, "model.attention_output_dropout=0.1 is ModernBERT's; "
              "model.architecture=bert has no such field"),   # BERT's hidden dropout covers its attention output
             ({"model.architecture": "gpt2"}, "model.architecture=gpt2 is not one of bert, modernbert"),
             ({"model.name_or_path": export, "model.architecture": "bert"},   # named: unset, it is the checkpoint's
              f"model.name_or_path={export} is a modernbert model and model.architecture=bert: set "
              "model.architecture=modernbert")]
    for extra, said in cases:
        argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache,
                                            **{"tokenizer.name_or_path": shared_tokenizer, **extra})]
        assert said in refused_in_process(argv, tmp_path / "run", capsys)
    from bert_recipes.backends.consistency import check_consistency
    from bert_recipes.backends.plan import LaunchPlan
    cfg = load_config(None, args(tmp_path / "run", sample_dir, datasets_cache, shared_tokenizer))
    plan = LaunchPlan(deepspeed=True, ds_config={"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}})
    with pytest.raises(ConfigError, match="model.architecture=modernbert: the pipeline engine cuts BERT's layers only"):
        check_consistency(cfg, plan, 2, 1, False)


def test_a_field_its_row_says_shapes_a_weight_must_match_on_resume(tmp_path, monkeypatch):
    """An architecture's own shape fields (its row's shape_fields, e.g. a grouped-query encoder's key/value heads)
    join the shared shape keys a resumed checkpoint is checked against: a change is one line naming the field with
    both values. Control: without the row's field the same change passes."""
    import dataclasses

    import yaml

    from bert_recipes import architectures
    from bert_recipes.checkpoint import CONFIG_FILE, check_checkpoint_fits
    saved = {"model": {"architecture": "modernbert", "local_attention": 8}}
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(saved))
    now = yaml.safe_dump({"model": {"architecture": "modernbert", "local_attention": 16}})
    check_checkpoint_fits(tmp_path, now)   # the control: local_attention shapes no weight of ModernBERT's
    row = dataclasses.replace(architectures.ARCHITECTURES["modernbert"], shape_fields=("local_attention",))
    monkeypatch.setitem(architectures.ARCHITECTURES, "modernbert", row)
    with pytest.raises(ConfigError, match=r"\(model.local_attention: 8 in the checkpoint, 16 now\)"):
        check_checkpoint_fits(tmp_path, now)


def test_the_attention_output_drops_at_its_own_rate(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """model.attention_output_dropout=0.1 beside probabilities' dropout 0 (ModernBERT's pretraining): in training each
    layer zeroes about 10% of Wo's output (binomial bounds, 4 sd) and scales the rest by 1 / 0.9, so the expectation
    is Wo's; in evaluation it drops nothing. The probabilities' rate stays 0, so a GPU's varlen path is not refused.
    A run trains with it on documents apart (CPU: the mask path); the export's config.json says attention_dropout 0
    and attention_output_dropout 0.1, and transformers' own class loads it. Control: unset, transformers' one knob
    (0) drops nothing (under BERT the field is one line: test_bad_architecture_fields_are_one_line)."""
    from transformers import AutoModelForMaskedLM

    from bert_recipes.backends.consistency import attention_path
    from bert_recipes.backends.plan import LaunchPlan
    cfg = ModelConfig(architecture="modernbert", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, local_attention=16,
                      global_attn_every_n_layers=2, attention_output_dropout=0.1)
    task = TaskConfig(kind="mlm")
    model = build_model(cfg, task, config=model_config(cfg, task, 100, 0))
    assert model.config.attention_dropout == 0 and model.config.attention_output_dropout == 0.1
    seen = {}
    for n, layer in enumerate(model.model.layers):
        layer.attn.Wo.register_forward_hook(lambda m, i, out, n=n: seen.__setitem__(("wo", n), out.detach()))
        layer.attn.out_drop.register_forward_hook(lambda m, i, out, n=n: seen.__setitem__(("out", n), out.detach()))
    ids = torch.randint(5, 100, (16, 64))
    model.train()
    model(input_ids=ids)
    for n in range(2):
        wo, out = seen[("wo", n)], seen[("out", n)]
        dropped = (out == 0).double().mean().item()
        assert abs(dropped - 0.1) < 4 * (0.09 / wo.numel()) ** 0.5, dropped   # 32,768 elements: sd 0.0017
        kept = out != 0
        torch.testing.assert_close(out[kept], wo[kept] / 0.9)
    model.eval()
    model(input_ids=ids)
    assert all(torch.equal(seen[("out", n)], seen[("wo", n)]) for n in range(2))
    unset = build_model(ModelConfig(**{**cfg.__dict__, "attention_output_dropout": None}), task,
                        config=model_config(ModelConfig(**{**cfg.__dict__, "attention_output_dropout": None}), task,
                                            100, 0))
    assert all(isinstance(layer.attn.out_drop, torch.nn.Identity) for layer in unset.model.layers)
    gpu = load_config(None, args(tmp_path / "gpu", sample_dir, datasets_cache, shared_tokenizer, **{
        "model.attention_output_dropout": 0.1, "train.mixed_precision": "bf16"}))
    assert attention_path(gpu, LaunchPlan(on_gpu=True)) == "varlen"

    out = tmp_path / "run"
    metrics = run_in_process(args(out, sample_dir, datasets_cache, shared_tokenizer, **{
        "model.attention_output_dropout": 0.1, "train.max_steps": 6}))
    assert metrics["steps"] == 6 and losses(out)[-1] < losses(out)[0]
    saved = json.loads((out / "model/config.json").read_text())
    assert saved["attention_dropout"] == 0.0 and saved["attention_output_dropout"] == 0.1
    loaded = AutoModelForMaskedLM.from_pretrained(out / "model")
    assert type(loaded).__name__ == "ModernBertForMaskedLM"
