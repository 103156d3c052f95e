"""The memory planner against measurement: every component within 10%.

- Activations: the planner's op-by-op count against the bytes autograd really saves
  (saved_tensors_hooks), over model sizes, sequence lengths, batch sizes, precisions, attention
  kernels, heads, dropout, padding and gradient checkpointing.
- Parameters, gradients, optimizer states: against the tensors a real step leaves on each rank,
  with 2 processes under DDP, ZeRO-1/2/3 and FSDP (tools/memory.py --measure under the launcher).
- The verdict: a plan that does not fit names a change, and with that change the plan fits.
"""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import yaml

from bert_recipes.config import ConfigError, ModelConfig, OptimConfig, TaskConfig
from bert_recipes.activations import Shape, Workload, activation_bytes
from bert_recipes.models import build_model, model_config
from bert_recipes.optim import build_optimizer
from conftest import REPO, backend_rows, launch_script

sys.path.insert(0, str(REPO / "tools"))
from measure import measure_activations  # noqa: E402 (tools/measure.py: a tool's, not a training run's)

TOLERANCE = 0.10


def tiny_model(task: str, hidden: int, layers: int, heads: int, seq: int, dropout: float, attn_dropout: float,
               attn: str = "sdpa", sparse: bool = True, checkpointing: bool = False, num_labels: int = 3,
               dropout_impl: str = "torch"):
    model_cfg = ModelConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=4 * hidden, max_position_embeddings=max(64, seq),
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=attn_dropout,
                            attn_implementation=attn, sparse_mlm_head=sparse, gradient_checkpointing=checkpointing,
                            dropout_impl=dropout_impl)
    task_cfg = TaskConfig(kind=task, num_labels=num_labels)
    config = model_config(model_cfg, task_cfg, vocab_size=500, pad_token_id=0)
    from bert_recipes.config import packed_dropout_here
    return build_model(model_cfg, task_cfg, config=config,
                       packed_dropout=packed_dropout_here(dropout_impl, False, "cpu")), config


def tiny_batch(task: str, batch: int, seq: int, vocab: int, masked: int, num_labels: int, padded: bool):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[0, seq // 2:] = 0
    # as tasks/mlm.MLMCollator: a batch without padding comes without an attention_mask (no mask is built)
    out = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), **({"attention_mask": mask} if padded else {})}
    if task == "mlm":
        labels = torch.full((batch, seq), -100)
        labels.view(-1)[torch.randperm(batch * seq, generator=gen)[:masked]] = 7
        out["labels"] = labels
    elif task == "token_classification":   # a tag a token (its collator's -100s cost nothing more)
        out["labels"] = torch.randint(0, num_labels, (batch, seq), generator=gen)
        out.pop("token_type_ids")   # tasks/token_classification.py asks the tokenizer for none
    else:
        out["labels"] = torch.rand(batch, generator=gen) if num_labels == 1 else torch.randint(0, num_labels, (batch,))
    return out


# (task, hidden, layers, heads, batch, seq, precision, attn, dropout, attn_dropout, sparse, ckpt, padded, labels)
CASES = [
    ("mlm", 32, 2, 2, 4, 32, "fp32", "sdpa", 0.1, 0.1, True, False, False, 3),
    ("mlm", 64, 2, 4, 2, 64, "fp32", "sdpa", 0.1, 0.1, False, False, False, 3),
    ("mlm", 128, 3, 4, 8, 32, "fp32", "sdpa", 0.1, 0.0, True, False, False, 3),
    ("mlm", 64, 2, 4, 1, 128, "fp32", "sdpa", 0.0, 0.0, False, False, False, 3),
    ("mlm", 64, 2, 4, 4, 64, "fp32", "eager", 0.1, 0.1, True, False, False, 3),
    ("mlm", 64, 2, 4, 4, 64, "fp32", "eager", 0.0, 0.0, True, False, False, 3),
    ("mlm", 64, 2, 4, 4, 64, "autocast", "sdpa", 0.1, 0.1, True, False, False, 3),
    ("mlm", 128, 2, 4, 2, 32, "autocast", "sdpa", 0.1, 0.0, False, False, False, 3),
    ("mlm", 64, 2, 4, 4, 32, "autocast", "eager", 0.1, 0.1, True, False, False, 3),
    ("mlm", 64, 2, 4, 4, 64, "half", "sdpa", 0.1, 0.1, True, False, False, 3),
    ("mlm", 64, 3, 4, 4, 32, "half", "sdpa", 0.1, 0.0, False, False, False, 3),
    ("mlm", 64, 2, 4, 4, 32, "half", "eager", 0.1, 0.1, True, False, False, 3),
    ("mlm", 64, 3, 4, 4, 64, "fp32", "sdpa", 0.1, 0.1, True, True, False, 3),
    ("mlm", 64, 3, 4, 4, 64, "autocast", "sdpa", 0.1, 0.1, True, True, False, 3),
    ("mlm", 64, 3, 4, 4, 64, "half", "sdpa", 0.0, 0.0, True, True, False, 3),
    ("classification", 64, 2, 4, 8, 64, "fp32", "sdpa", 0.1, 0.1, True, False, True, 3),
    ("token_classification", 64, 2, 4, 4, 32, "fp32", "sdpa", 0.1, 0.1, True, False, True, 5),
    ("token_classification", 64, 2, 4, 4, 32, "fp32", "sdpa", 0.0, 0.0, True, False, False, 5),
    ("token_classification", 64, 2, 4, 4, 32, "autocast", "sdpa", 0.1, 0.0, True, False, True, 5),
    ("classification", 64, 2, 4, 8, 64, "fp32", "sdpa", 0.1, 0.0, True, False, True, 3),
    ("classification", 64, 3, 4, 8, 48, "autocast", "sdpa", 0.1, 0.0, True, False, True, 3),
    ("classification", 64, 3, 4, 4, 64, "fp32", "sdpa", 0.1, 0.0, True, True, True, 3),
    ("classification", 32, 2, 2, 4, 32, "autocast", "sdpa", 0.1, 0.1, True, False, True, 2),
    ("classification", 64, 2, 4, 4, 32, "half", "sdpa", 0.1, 0.1, True, False, False, 1),
    ("classification", 64, 2, 4, 4, 32, "fp32", "eager", 0.0, 0.0, True, False, True, 1),
    # (the cases above: model.dropout_impl=torch, the default: torch's CPU dropout, masks in the input's
    # dtype, sdpa's fp32 math path) model.dropout_impl=packed, the CPU opt-in: also with padding in half precision
    ("mlm", 32, 2, 2, 4, 32, "fp32", "sdpa", 0.1, 0.1, True, False, False, 3, "packed"),
    ("mlm", 64, 2, 4, 4, 64, "autocast", "sdpa", 0.1, 0.1, True, False, False, 3, "packed"),
    ("classification", 32, 2, 2, 4, 32, "autocast", "sdpa", 0.1, 0.1, True, False, True, 2, "packed"),
    ("mlm", 64, 3, 4, 4, 64, "fp32", "sdpa", 0.1, 0.1, True, True, False, 3, "packed"),
    ("classification", 64, 2, 4, 4, 32, "half", "sdpa", 0.1, 0.1, True, False, True, 1, "packed"),
]


def measured(model, config, task, batch, seq, labels, padded, precision) -> tuple[dict, int]:
    """What one training forward of a tiny batch saves (tools/measure.py), the model in `precision`'s dtype.
    -> (the measurement, the masked tokens of an MLM batch)."""
    if precision == "half":
        model.to(torch.bfloat16)
    model.train()
    masked = math.ceil(0.15 * batch * seq)
    data = tiny_batch(task, batch, seq, config.vocab_size, masked, labels, padded)
    return measure_activations(model, data, torch.bfloat16 if precision == "autocast" else None), masked


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_activation_estimate_matches_saved_tensors(case):
    task, hidden, layers, heads, batch, seq, precision, attn, p, p_attn, sparse, ckpt, padded, labels, *impl = case
    impl = impl[0] if impl else "torch"
    torch.manual_seed(0)
    model, config = tiny_model(task, hidden, layers, heads, seq, p, p_attn, attn, sparse, ckpt, labels, impl)
    got, masked = measured(model, config, task, batch, seq, labels, padded, precision)
    work = Workload(batch=batch, seq=seq, hidden_dropout=p, attention_dropout=p_attn, attn_implementation=attn,
                    sparse_head=sparse, masked_tokens=masked, padded=padded, dropout_impl=impl)
    shape = Shape.from_config(config, task)
    estimate = activation_bytes(shape, work, precision, "cpu", ckpt)
    print(f"[activations] {case}: estimate {estimate['total']:,} measured {got['activations']:,}")
    assert abs(estimate["total"] - got["activations"]) <= TOLERANCE * got["activations"]
    # Tighter than the 10% asked for: the count is op by op, so a missing term (a dropout mask,
    # a cast) shows; only a regression head's loss inputs differ, by a few bytes.
    assert abs(estimate["total"] - got["activations"]) <= 16, (estimate["total"], got["activations"])
    if precision == "autocast" and not ckpt:   # the weight copies autocast saves are part of the temporary estimate
        casts = shape.autocast_cast_params * 2
        assert got["weight_casts"] <= casts <= (1 + TOLERANCE) * got["weight_casts"]


@pytest.mark.parametrize("precision, k", [("fp32", 5), ("autocast", 5), ("half", 7)])
def test_activation_estimate_of_the_static_mlm_head(precision, k):
    """The default MLM head (data.max_predictions_per_seq): K position slots a sequence, the used ones
    first, the rest pointing at position 0 and ignored by the loss; the head runs on batch x K rows."""
    torch.manual_seed(0)
    batch, seq = 4, 32
    model, config = tiny_model("mlm", 64, 2, 4, seq, 0.1, 0.1)
    if precision == "half":
        model.to(torch.bfloat16)
    model.train()
    data = tiny_batch("mlm", batch, seq, config.vocab_size, 0, 3, False)
    gen = torch.Generator().manual_seed(1)
    positions = torch.stack([torch.randperm(seq, generator=gen)[:k].sort().values for _ in range(batch)])
    positions[0, k - 2:] = 0                                  # two unused slots in the first row
    labels = torch.full((batch, seq), -100)
    for row in range(batch):
        used = positions[row][:k - 2] if row == 0 else positions[row]
        labels[row, used] = 7
    data.update(labels=labels, masked_positions=positions)
    got = measure_activations(model, data, torch.bfloat16 if precision == "autocast" else None)
    work = Workload(batch=batch, seq=seq, masked_tokens=batch * k, static_head=True)
    estimate = activation_bytes(Shape.from_config(config, "mlm"), work, precision, "cpu")
    print(f"[activations] static head {precision} K={k}: estimate {estimate['total']:,} measured {got['activations']:,}")
    assert abs(estimate["total"] - got["activations"]) <= 16, (estimate["total"], got["activations"])


# ModernBERT (model.architecture=modernbert): its own op-by-op count (bert_recipes/architectures/modernbert.py), local
# layers below the sequence length so both layer types run; ModernBERT's default dropout 0, and attention dropout.
# (task, layers, global every n, local window, batch, seq, precision, attn, attention dropout, ckpt, padded, labels)
MODERNBERT_CASES = [
    ("mlm", 3, 2, 16, 4, 32, "fp32", "sdpa", 0.0, False, False, 3),
    ("mlm", 4, 3, 16, 4, 64, "fp32", "sdpa", 0.0, False, False, 3),
    ("mlm", 3, 2, 16, 4, 32, "autocast", "sdpa", 0.0, False, False, 3),
    ("mlm", 3, 2, 16, 4, 32, "half", "sdpa", 0.0, False, False, 3),
    ("mlm", 3, 2, 16, 4, 32, "fp32", "sdpa", 0.1, False, False, 3),
    ("mlm", 2, 2, 16, 4, 32, "autocast", "eager", 0.0, False, False, 3),
    ("mlm", 2, 2, 16, 4, 32, "fp32", "eager", 0.1, False, False, 3),
    ("mlm", 3, 2, 16, 4, 32, "fp32", "sdpa", 0.0, True, False, 3),
    ("classification", 3, 2, 16, 4, 32, "fp32", "sdpa", 0.0, False, True, 3),
    ("classification", 2, 2, 16, 4, 32, "autocast", "sdpa", 0.0, False, True, 1),
    ("token_classification", 3, 2, 16, 4, 32, "fp32", "sdpa", 0.0, False, True, 5),
    ("token_classification", 2, 2, 16, 4, 32, "autocast", "sdpa", 0.0, False, False, 5),
]


def tiny_modernbert(task, layers, every, window, seq, attn, attn_dropout, checkpointing, num_labels):
    model_cfg = ModelConfig(architecture="modernbert", hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                            intermediate_size=96, max_position_embeddings=max(64, seq), local_attention=window,
                            global_attn_every_n_layers=every, attn_implementation=attn,
                            attention_probs_dropout_prob=attn_dropout, gradient_checkpointing=checkpointing)
    task_cfg = TaskConfig(kind=task, num_labels=num_labels)
    config = model_config(model_cfg, task_cfg, vocab_size=500, pad_token_id=0)
    return build_model(model_cfg, task_cfg, config=config), config


@pytest.mark.parametrize("case", MODERNBERT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_modernbert_activation_estimate_matches_saved_tensors(case):
    task, layers, every, window, batch, seq, precision, attn, p_attn, ckpt, padded, labels = case
    torch.manual_seed(0)
    model, config = tiny_modernbert(task, layers, every, window, seq, attn, p_attn, ckpt, labels)
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    got, masked = measured(model, config, task, batch, seq, labels, padded, precision)
    work = Workload(batch=batch, seq=seq, hidden_dropout=0.0, attention_dropout=p_attn, attn_implementation=attn,
                    masked_tokens=masked, padded=padded)
    estimate = activation_bytes(Shape.from_config(config, task), work, precision, "cpu", ckpt)
    print(f"[activations] modernbert {case}: estimate {estimate['total']:,} measured {got['activations']:,}")
    assert abs(estimate["total"] - got["activations"]) <= 32, (estimate["total"], got["activations"])
    # the control: BERT's count of the same sizes, which the op-by-op count must not be mistaken for
    bert = activation_bytes(replace(Shape.from_config(config, task), architecture="bert"), work, precision, "cpu", ckpt)
    assert abs(bert["total"] - got["activations"]) > TOLERANCE * got["activations"]


@pytest.mark.parametrize("task,labels", [("mlm", 3), ("classification", 3), ("classification", 1),
                                         ("token_classification", 5)])
def test_modernbert_parameter_count_is_the_models(task, labels):
    model, config = tiny_modernbert(task, 3, 2, 16, 32, "sdpa", 0.0, False, labels)
    shape = Shape.from_config(config, task)
    assert [p.numel() for p in model.parameters()] == shape.param_sizes()
    assert [p.numel() for group in build_optimizer(model, OptimConfig()).param_groups for p in group["params"]] \
        == [n for group in shape.optimizer_groups() for n in group]


@pytest.mark.parametrize("task,labels", [("mlm", 3), ("classification", 3), ("classification", 1),
                                         ("token_classification", 5)])
def test_parameter_count_is_the_models(task, labels):
    model, config = tiny_model(task, 64, 2, 4, 32, 0.1, 0.1, num_labels=labels)
    shape = Shape.from_config(config, task)
    sizes = [p.numel() for p in model.parameters()]
    assert sizes == shape.param_sizes()
    assert [p.numel() for group in build_optimizer(model, OptimConfig()).param_groups for p in group["params"]] \
        == [n for group in shape.optimizer_groups() for n in group]
    assert shape.small_params == sum(n for n in sizes if n <= 10 * 64)


# ----------------------------------------------------------------------------- model states, 2 processes
# (backend, precision, hidden, layers, seq, micro batch)
STATE_ROWS = [("ddp", "no", 64, 2, 32, 4), ("zero1", "no", 64, 2, 32, 4), ("zero2", "no", 64, 2, 32, 4),
              ("zero3", "no", 64, 2, 32, 4), ("fsdp", "no", 64, 2, 32, 4), ("zero2", "bf16", 64, 2, 32, 4),
              ("zero3", "bf16", 64, 2, 32, 4), ("fsdp", "bf16", 64, 2, 32, 4), ("ddp", "bf16", 128, 2, 64, 2), ("zero2", "no", 128, 3, 64, 2),
              ("zero3", "no", 32, 1, 32, 8)]


@pytest.mark.parametrize("row", STATE_ROWS, ids=lambda r: "-".join(map(str, r)))
def test_model_states_match_a_real_step(row, tmp_path):
    backend, precision, hidden, layers, seq, micro = row
    out = tmp_path / "measure.json"
    args = ["--measure", "--recipe", "recipes/tiny-mlm.yaml", "--out", str(out),
            f"--model.hidden_size={hidden}", f"--model.num_hidden_layers={layers}", "--model.num_attention_heads=4",
            f"--model.intermediate_size={4 * hidden}", "--tokenizer.vocab_size=1000", f"--data.max_seq_length={seq}",
            f"--train.micro_batch_size={micro}", f"--train.mixed_precision={precision}", f"--run.output_dir={tmp_path}"]
    log = launch_script("tools/memory.py", args, nproc=2, backend=backend, timeout=600)
    result = json.loads(out.read_text())
    print(log[log.find("[memory]"):])
    plan = backend_rows()[backend].plan   # the row's launch files: what the planner reads
    assert result["backend"] == plan.name and result["world"] == 2
    assert len(result["measured_per_rank"]) == 2
    for rank, measured in enumerate(result["measured_per_rank"]):
        for key in ("parameters", "gradients", "optimizer", "activations"):
            estimate = result["estimate"][key]
            assert abs(measured[key] - estimate) <= TOLERANCE * max(measured[key], 1), (rank, key, measured, estimate)
    # Sharding shows in the numbers: ZeRO-3 and FSDP hold about half the parameter bytes per rank.
    if plan.kind == "fsdp" or plan.zero_stage == 3:
        bytes_per_param = 2 if (precision == "bf16" and plan.kind == "deepspeed") else 4
        full = result["full_param_numel"] * bytes_per_param
        assert all(m["parameters"] < 0.6 * full for m in result["measured_per_rank"]), (full, result)


def test_bert_base_width_at_sequence_512_matches_a_real_step(tmp_path):
    """BERT-base's width (hidden 768, 12 heads, MLP 3072, vocabulary 30522) at sequence 512, bf16 autocast,
    one process (the CPU analogue of comparing against torch.cuda.max_memory_allocated on a GPU), with 2
    of its 12 layers: every term of the planner is per layer or per model, so 2 layers check each of them
    at full width. Micro batch 1: the batch dimension multiplies every term, and the tests above vary it
    (1 to 8) at smaller widths; each sequence here costs about 50 s of CPU (bf16 GEMMs on a CPU without
    native bf16 take torch's reference kernels). All 12 layers, against a GPU's measured peak at the
    automatic micro batch: the GPU session (tools/gpu_session.py)."""
    out = tmp_path / "base.json"
    proc = subprocess.run([sys.executable, "tools/memory.py", "--measure", "--recipe", "recipes/bert-base-mlm-phase1.yaml",
                           "--data.max_seq_length=512", "--train.micro_batch_size=1", "--train.mixed_precision=bf16",
                           "--model.num_hidden_layers=2", f"--run.output_dir={tmp_path}", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["full_param_numel"] > 37e6   # 23.8M of embeddings and head, 2 x 7.1M of layers
    measured = result["measured_per_rank"][0]
    for key in ("parameters", "gradients", "optimizer", "activations"):
        assert abs(measured[key] - result["estimate"][key]) <= 0.001 * measured[key], (key, measured, result["estimate"])


# ----------------------------------------------------------------------------- the planner
def planner(*args) -> subprocess.CompletedProcess:
    """tools/memory.py's main on these arguments, in this process (its planning needs no launcher; a
    process would spend its seconds importing torch and transformers): exit code, stdout, stderr."""
    import contextlib
    import importlib.util
    import io
    if "memory_tool" not in sys.modules:
        spec = importlib.util.spec_from_file_location("memory_tool", REPO / "tools/memory.py")
        sys.modules["memory_tool"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["memory_tool"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = sys.modules["memory_tool"].main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_planner_table_and_fit_verdict(tmp_path):
    out = tmp_path / "plan.json"
    proc = planner("--recipe", "recipes/bert-base-mlm-phase1.yaml", "--world", "8", "--gpu-memory", "24",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = result["backends"]
    from bert_recipes.backends.plan import backend_rows   # every one-node row, planned from its own files
    assert list(rows) == [name for name, row in backend_rows().items() if row.nodes == 1]
    assert {"ddp", "zero1", "zero2", "zero3", "zero3-offload"} <= set(rows)
    # Sharding order: each ZeRO stage needs less per device than the one before.
    peak = {b: rows[b]["peak"] for b in rows}
    assert peak["ddp"] > peak["zero1"] > peak["zero2"] > peak["zero3"] > peak["zero3-offload"]
    offloaded = rows["zero3-offload"]
    assert offloaded["parameters"] == offloaded["gradients"] == offloaded["optimizer"] == 0
    assert all(rows[b]["activations_checkpointed"] < rows[b]["activations"] for b in rows)
    assert result["verdict"][0].startswith("fits on 24 GiB with ddp at micro batch 32: needs")
    header = next(line for line in proc.stdout.splitlines() if line.startswith("backend"))
    assert header.split() == ["backend", "params", "grads", "optimizer", "activations", "act", "(ckpt)", "temp",
                              "peak", "peak", "(ckpt)"]


def suggestion_fits(args: list[str], change: str) -> str:
    """Apply the verdict's change (an override or a backend switch) and plan again."""
    if change.startswith("switch to "):   # a row of the table: its launch config
        from bert_recipes.backends.plan import backend_rows
        args = args + ["--config", backend_rows()[change.split()[2]].config]
    else:
        args = args + [change.split()[0]]
    again = planner(*args)
    assert again.returncode == 0, again.stderr
    return again.stdout[again.stdout.index("verdict:"):]


@pytest.mark.parametrize("setting, expected", [
    # one 16 GiB GPU at sequence 512: a smaller micro batch with more accumulation
    (["--config", "accelerate_configs/1gpu.yaml", "--gpu-memory", "16", "--train.micro_batch_size=64",
      "--data.max_seq_length=512", "--train.global_batch_size=256"], "--train.micro_batch_size="),
    # 8 GPUs under DDP at 10 GiB: sharding the optimizer states is enough (with AdamW: ZeRO refuses LAMB)
    (["--config", "accelerate_configs/8gpu.yaml", "--gpu-memory", "10", "--optim.name=adamw"], "switch to zero1"),
    # the same with the recipe's LAMB: no ZeRO switch (training refuses it), a smaller micro batch instead
    (["--config", "accelerate_configs/8gpu.yaml", "--gpu-memory", "10"], "--train.micro_batch_size="),
])
def test_planner_names_a_change_that_fits(setting, expected):
    args = ["--recipe", "recipes/bert-large-mlm.yaml"] + setting
    proc = planner(*args)
    assert proc.returncode == 0, proc.stderr
    verdict = proc.stdout[proc.stdout.index("verdict:"):]
    assert "does NOT fit on" in verdict, verdict
    change = verdict.split("cheapest fix: ")[1].split(":")[0]
    assert change.startswith(expected), verdict
    assert "verdict: fits on" in suggestion_fits(args, change)


def test_planner_suggests_checkpointing_when_the_micro_batch_cannot_shrink(tmp_path):
    """Micro batch 1 per rank: only checkpointing (or ZeRO-3) is left; memory set between the two."""
    args = ["--recipe", "recipes/bert-large-mlm.yaml", "--config", "accelerate_configs/zero2.yaml", "--optim.name=adamw",
            "--data.max_seq_length=512", "--train.micro_batch_size=1", "--train.global_batch_size=8"]
    assert planner(*args, "--gpu-memory", "80", "--out", str(tmp_path / "p.json")).returncode == 0
    row = json.loads((tmp_path / "p.json").read_text())["backends"]["zero2"]
    memory = (row["peak"] + row["peak_checkpointed"]) / 2 / 2 ** 30 + 1   # + the CUDA context reserve
    proc = planner(*args, "--gpu-memory", f"{memory:.3f}")
    verdict = proc.stdout[proc.stdout.index("verdict:"):]
    assert "does NOT fit" in verdict and "cheapest fix: --model.gradient_checkpointing=true" in verdict, verdict
    assert "verdict: fits on" in suggestion_fits(args + ["--gpu-memory", f"{memory:.3f}"],
                                                 "--model.gradient_checkpointing=true")


def test_planner_uses_the_recipes_checkpointing():
    args = ["--recipe", "recipes/bert-large-mlm.yaml", "--config", "accelerate_configs/1gpu.yaml", "--gpu-memory",
            "16", "--data.max_seq_length=512", "--train.micro_batch_size=32", "--train.global_batch_size=256"]
    off, on = planner(*args), planner(*args, "--model.gradient_checkpointing=true")
    assert "does NOT fit" in off.stdout and "fits on 16 GiB with ddp at micro batch 32 with checkpointing" in on.stdout


def test_planner_runs_every_recipe_on_every_launch_config(capsys):
    """Each recipe x accelerate config plans, or stops with a config error (batch arithmetic that
    train.py would refuse, a model that an earlier recipe writes): never a traceback."""
    sys.path.insert(0, str(REPO / "tools"))
    import memory as tool
    planned = set()
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        for config in sorted((REPO / "accelerate_configs").glob("*.yaml")):
            rc = tool.main(["--recipe", str(recipe), "--config", str(config), "--gpu-memory", "80"])
            err = capsys.readouterr().err
            if rc == 0:
                planned.add(recipe.name)
            else:   # refusals train.py itself would give: batch arithmetic, a missing model, the launch checks
                assert rc == 2 and err.startswith("config error: ") and any(
                    why in err for why in ("not divisible", "does not exist yet", "conflicts with the recipe")), (
                    recipe.name, config.name, err)
    # every recipe plans somewhere; chained ones once their model exists (here: a fresh-model override)
    chained = {r.name for r in (REPO / "recipes").glob("*.yaml") if starts_from_a_run(yaml.safe_load(r.read_text()))}
    assert {"tiny-classify.yaml", "bert-base-mlm-phase2.yaml"} <= chained, chained
    assert planned | chained == {r.name for r in (REPO / "recipes").glob("*.yaml")}, planned
    for name in chained:   # a fresh model needs its tokenizer named, as train.py says (config.validate)
        assert tool.main(["--recipe", str(REPO / "recipes" / name), "--model.name_or_path=null",
                          f"--tokenizer.name_or_path={REPO / 'tests/data/wordpiece-1000'}"]) == 0


def starts_from_a_run(recipe):
    """Does the recipe start from what an earlier recipe writes (its export, or its checkpoint)?"""
    model = str(recipe["model"].get("name_or_path") or "")
    return model.startswith("runs/") or bool((recipe.get("checkpoint") or {}).get("init_from"))


def test_planner_rejects_bad_input(tmp_path):
    proc = planner("--recipe", "recipes/tiny-mlm.yaml", "--world", "0")
    assert proc.returncode == 2 and "--world must be at least 1" in proc.stderr
    proc = planner("--recipe", "recipes/tiny-mlm.yaml", "--model.hidden_sise=3")
    assert proc.returncode == 2 and "hidden_sise" in proc.stderr
    proc = planner("--recipe", "recipes/tiny-mlm.yaml", "--gpu-memory", "-1")
    assert proc.returncode == 2 and "--gpu-memory must be positive" in proc.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: [DEEPSPEED\n")
    proc = planner("--recipe", "recipes/tiny-mlm.yaml", "--config", str(broken))
    assert proc.returncode == 2 and "is not valid YAML" in proc.stderr
    proc = planner("--recipe", "recipes/tiny-classify.yaml", "--model.name_or_path=runs/missing/model")
    assert proc.returncode == 2 and "does not exist yet" in proc.stderr
    proc = planner("--recipe", "recipes/tiny-mlm.yaml", "--world", "3")
    assert proc.returncode == 2 and "not divisible" in proc.stderr


def test_planner_refuses_what_a_launch_refuses_in_the_same_line(tmp_path):
    """make memory runs a launch's checks (backends.consistency.resolve_run): the recipe's LAMB under ZeRO-2 is the
    launch's one config error line, exit code 2, and no plan is written."""
    out = tmp_path / "plan.json"
    args = ("--recipe", "recipes/bert-large-mlm.yaml", "--config", "accelerate_configs/zero2.yaml", "--world", "8")
    proc = planner(*args, "--out", str(out))
    from bert_recipes.config import load_config
    from bert_recipes.preflight import launch_plan, preflight
    with pytest.raises(ConfigError) as launch:
        preflight(load_config(REPO / "recipes/bert-large-mlm.yaml"), launch_plan("accelerate_configs/zero2.yaml"), 8)
    assert proc.returncode == 2 and proc.stderr == f"config error: {launch.value}\n" and not proc.stdout, proc
    assert "optim.name=lamb" in proc.stderr and not out.exists()
    assert planner(*args, "--optim.name=adamw", "--out", str(out)).returncode == 0 and out.exists()


def test_the_planner_counts_the_runs_vocabulary_and_marks_what_a_launch_refuses(tmp_path):
    """recipes/modernbert-base-mlm.yaml (StableAdamW, ModernBERT) on 8 x 80 GiB: its tokenizer unreadable here
    (offline), the plan says which vocabulary it assumed; given the tokenizer's size, the count is its header's
    149.7M; a local tokenizer of 1,000 ids is counted as it is. Every ZeRO and FSDP row and the pipeline say
    `refused`, with the launch's own reason, and the verdict lists none of them. Control: BERT with AdamW, zero2 is
    planned and listed."""
    import re
    params = lambda proc: float(re.search(r": ([\d.]+)M parameters", proc.stdout).group(1))  # noqa: E731
    common = ("--recipe", "recipes/modernbert-base-mlm.yaml", "--world", "8", "--gpu-memory", "80")
    assumed = planner(*common, "--out", str(tmp_path / "plan.json"))
    assert assumed.returncode == 0, assumed.stderr
    assert ("note: assumed vocabulary: tokenizer.name_or_path=answerdotai/ModernBERT-base cannot be read here" in
            assumed.stdout and "give --tokenizer.vocab_size=<its size>" in assumed.stdout)
    given = planner(*common, "--tokenizer.vocab_size=50368")
    assert params(given) == 149.7 and params(assumed) < 149.7
    local = planner(*common, f"--tokenizer.name_or_path={REPO / 'tests/data/wordpiece-1000'}")
    assert "assumed vocabulary" not in local.stdout and params(local) < params(assumed)
    result = json.loads((tmp_path / "plan.json").read_text())
    for name, row in result["backends"].items():
        if name == "ddp":
            assert row["refused"] is None
        elif name == "pipeline":
            assert row["refused"] and "under the pipeline engine" in row["refused"]
        else:
            assert "optim.name=stable_adamw needs whole parameter tensors" in row["refused"], (name, row["refused"])
    assert re.search(r"^fsdp .* refused$", assumed.stdout, re.M) and not any(
        word in line for line in result["verdict"] for word in ("zero", "fsdp", "pipeline"))
    bert = planner("--recipe", "recipes/bert-base-mlm-phase1.yaml", "--world", "8", "--gpu-memory", "80",
                   "--out", str(tmp_path / "bert.json"))
    plain = json.loads((tmp_path / "bert.json").read_text())
    assert plain["backends"]["zero2"]["refused"] is None and any("zero2 needs" in line for line in plain["verdict"])
