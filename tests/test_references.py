"""Checked against implementations nobody here wrote.

StableAdamW against torch-optimi's (requirements-references.txt, as timm): step by step with a gradient spike
that engages the clip, and the count of host reads (ours none, theirs one a tensor).

LAMB against timm's Lamb (requirements-references.txt: installed by `make setup` with pip --no-deps into
.venv/references, outside sys.path, because accelerate's CLI imports timm whenever it is importable and
timm needs torchvision; only timm/optim/lamb.py and the two files it imports are loaded, by path).
timm's Lamb is "a pure pytorch variant of apex's FusedLAMB": with always_adapt=False (apex's
use_nvlamb=False) and its own clipping off (max_grad_norm=None; our engine clips before the step, as
apex does inside it), it is the rule NVIDIA trains BERT with. What still differs from apex, and why it
does not matter here: apex's multi_tensor_lamb computes in fp32 registers (here both sides compute in
the parameters' float32, in another order: the comparison allows float32 rounding, 1e-6 relative);
apex clips by dividing by max(||g|| / max_norm, 1), torch's clip_grad_norm_ (our engine) multiplies by
max_norm / (||g|| + 1e-6), a relative difference of 1e-6 / ||g||, not tested here because neither side
clips. The step counts: apex and timm keep one per group that advances on every call; ours keeps one
per tensor that a skipped step does not advance (torch's fused AdamW's contract): equal when nothing is
skipped, and after a skip ours equals a reference that never saw the skipped step.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TIMM_OPTIM = REPO / ".venv/references/timm/optim"


def timm_lamb():
    """timm's Lamb class from timm/optim/lamb.py, loaded by path under a package of its own (lamb.py's
    relative imports: _helpers.py and _types.py, which import only torch), so timm is never importable."""
    if not (TIMM_OPTIM / "lamb.py").exists():
        pytest.fail(f"{TIMM_OPTIM / 'lamb.py'} is missing: run `make setup` (requirements-references.txt)")
    name = "_reference_timm_optim"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(TIMM_OPTIM)]
        sys.modules[name] = package
        for module in ("_types", "_helpers", "lamb"):
            spec = importlib.util.spec_from_file_location(f"{name}.{module}", TIMM_OPTIM / f"{module}.py")
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = loaded
            spec.loader.exec_module(loaded)
    assert "timm" not in sys.modules
    return sys.modules[f"{name}.lamb"].Lamb


def tiny_bert(layers: int = 2, seed: int = 0):
    """A tiny BERT for MLM whose biases and LayerNorm parameters are not their initial 0 and 1: the
    no-decay tensors then have norms, so a trust ratio on them would change their steps."""
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    model = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_and_timm(trust_ratio: str):
    """Two copies of the tiny BERT: one under the recipe's LAMB (optim.build_optimizer's groups), one
    under timm's Lamb with the same groups and settings."""
    from bert_recipes.config import OptimConfig
    from bert_recipes.optim import build_optimizer
    cfg = OptimConfig(name="lamb", lr=2e-2, eps=1e-6, weight_decay=0.01, lamb_trust_ratio=trust_ratio)
    ours, theirs = tiny_bert(), tiny_bert()
    optimizer = build_optimizer(ours, cfg)
    names = {id(p): n for n, p in ours.named_parameters()}
    by_name = dict(theirs.named_parameters())
    groups = [{"params": [by_name[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
              for g in optimizer.param_groups]
    assert groups[1]["weight_decay"] == 0 and all(p.norm() > 0 for p in groups[1]["params"])
    reference = timm_lamb()(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                            max_grad_norm=None, always_adapt=trust_ratio == "all")
    return ours, optimizer, theirs, reference


def assert_a_skipped_step_changes_nothing(optimizer, params: list, steps_before: int) -> None:
    """A step with NaN gradients and found_inf = 1 (what the engine sets for a non-finite step): no weight moves,
    the moments stay finite and no step count advances."""
    before = [p.clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    optimizer.found_inf = torch.zeros(())
    assert all(torch.equal(a, b) for a, b in zip(params, before)), "a skipped step moved a weight"
    assert all(torch.isfinite(s["exp_avg"]).all() and torch.isfinite(s["exp_avg_sq"]).all()
               and s["step"].item() == steps_before for s in optimizer.state.values())


@pytest.mark.parametrize("trust_ratio", ["decayed", "all"])
def test_lamb_matches_timms_lamb_on_bert_parameter_groups(trust_ratio):
    """8 steps on a tiny BERT's two groups (weights with decay 0.01; biases and LayerNorm, non-zero, with
    none), the same random gradients on both sides: every parameter equal to float32 rounding after each
    step. decayed = timm's always_adapt=False (apex's default); all = always_adapt=True (the old rule).
    Step 5 is skipped (found_inf = 1, NaN gradients): nothing moves, and the reference never sees it."""
    ours, optimizer, theirs, reference = ours_and_timm(trust_ratio)
    optimizer.found_inf = torch.zeros(())
    g = torch.Generator().manual_seed(1)
    mine, ref = list(ours.parameters()), list(theirs.parameters())
    for step in range(8):
        grads = [torch.randn(p.shape, generator=g) * 0.1 for p in mine]
        if step == 5:
            assert_a_skipped_step_changes_nothing(optimizer, mine, steps_before=5)
            continue
        for a, b, grad in zip(mine, ref, grads):
            a.grad, b.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    moved = [(a - b).abs().max().item() for a, b in zip(mine, tiny_bert().parameters())]
    assert min(moved) > 1e-4   # every tensor moved: the comparison is not of idle weights


def test_the_two_rules_differ_where_weight_decay_is_zero():
    """The old rule (all) against the references' (decayed) from the same start: the weights with decay
    take the same steps; the biases and LayerNorm parameters do not."""
    runs = {}
    for rule in ("decayed", "all"):
        model, optimizer, _, _ = ours_and_timm(rule)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g) * 0.1
            optimizer.step()
        runs[rule] = (optimizer.param_groups, dict(model.named_parameters()))
    groups, decayed = runs["decayed"]
    _, every = runs["all"]
    names = {id(p): n for n, p in decayed.items()}
    for group in groups:
        for p in group["params"]:
            same = torch.equal(p, every[names[id(p)]])
            assert same == bool(group["weight_decay"]), names[id(p)]


# ----------------------------------------------------------------------------- StableAdamW against torch-optimi's
OPTIMI = REPO / ".venv/references/optimi"


def optimi_stableadamw():
    """torch-optimi's StableAdamW (what ModernBERT imports), its package registered by path without its __init__
    (which imports every optimizer it has): only optimi/stableadamw.py and the modules it imports load."""
    if not (OPTIMI / "stableadamw.py").exists():
        pytest.fail(f"{OPTIMI / 'stableadamw.py'} is missing: run `make setup` (requirements-references.txt)")
    if "optimi.stableadamw" not in sys.modules:
        package = types.ModuleType("optimi")
        package.__path__ = [str(OPTIMI)]
        sys.modules["optimi"] = package
        __import__("optimi.stableadamw")
    return sys.modules["optimi.stableadamw"].StableAdamW


def ours_and_optimi():
    """The tiny BERT under the recipe's StableAdamW (build_optimizer's groups, ModernBERT's settings) and a copy
    under torch-optimi's, as ModernBERT builds it (decouple_lr=True, max_lr = the recipe's lr, one loop a tensor)."""
    from bert_recipes.config import OptimConfig
    from bert_recipes.optim import build_optimizer
    cfg = OptimConfig(name="stable_adamw", lr=1e-2, betas=[0.9, 0.98], eps=1e-6, weight_decay=0.01)
    ours, theirs = tiny_bert(), tiny_bert()
    optimizer = build_optimizer(ours, cfg)
    names = {id(p): n for n, p in ours.named_parameters()}
    by_name = dict(theirs.named_parameters())
    groups = [{"params": [by_name[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
              for g in optimizer.param_groups]
    with warnings.catch_warnings():   # torch-optimi warns that 0.01 is a high decay for decouple_lr: here it shows
        warnings.simplefilter("ignore")
        reference = optimi_stableadamw()(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                         weight_decay=cfg.weight_decay, decouple_lr=True, max_lr=cfg.lr,
                                         foreach=False, kahan_sum=False, triton=False)
    return ours, optimizer, theirs, reference


def adamw_debiased(p, grad, state, step, lr, betas, eps, weight_decay):
    """The control: StableAdamW's step without its clip (lr_t = lr whatever the RMS)."""
    (b1, b2), t = betas, step
    h1, h2 = (b1 ** t - b1) / (b1 ** t - 1), (b2 ** t - b2) / (b2 ** t - 1)
    state["m"] = state.get("m", torch.zeros_like(p)) * h1 + grad * (1 - h1)
    state["v"] = state.get("v", torch.zeros_like(p)) * h2 + grad * grad * (1 - h2)
    p.mul_(1 - weight_decay).sub_(lr * state["m"] / (state["v"].sqrt() + eps))


def test_stable_adamw_matches_torch_optimis_with_a_spike_that_engages_the_clip():
    """8 steps on the tiny BERT's two groups (decay 0.01 and none), the same gradients on both sides: every
    parameter equal to float32 rounding after each step. Steps 0-3 repeat one gradient, so v = g^2 and the RMS is
    exactly 1: the clip is idle, and the control (the same rule without the clip) keeps up; a run of such steps
    alone could not tell the clip is there. Step 4's gradients of two tensors are 300x: their RMS passes 1, the clip
    shrinks their step, and the control misses the reference. Step 6 is skipped (found_inf = 1, NaN gradients):
    nothing moves, and the reference never sees it."""
    ours, optimizer, theirs, reference = ours_and_optimi()
    control_model = tiny_bert()
    control, control_state = list(control_model.parameters()), [{} for _ in control_model.parameters()]
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    optimizer.found_inf = torch.zeros(())
    g = torch.Generator().manual_seed(1)
    mine, ref = list(ours.parameters()), list(theirs.parameters())
    spiked = [i for i, p in enumerate(mine) if p.ndim == 2][:2]
    counted = 0
    steady = [torch.randn(p.shape, generator=g) * 0.1 for p in mine]
    for step in range(8):   # steps 0-3: the same gradients (v = g^2, the RMS exactly 1); then a spike, then noise
        grads = [x.clone() for x in steady] if step < 4 else [torch.randn(p.shape, generator=g) * 0.1 for p in mine]
        if step == 6:
            assert_a_skipped_step_changes_nothing(optimizer, mine, steps_before=6)
            continue
        if step == 4:
            for i in spiked:
                grads[i] = grads[i] * 300
        counted += 1
        for a, b, grad in zip(mine, ref, grads):
            a.grad, b.grad = grad.clone(), grad.clone()
        for i, (c, grad) in enumerate(zip(control, grads)):
            adamw_debiased(c.data, grad, control_state[i], counted, 1e-2, (0.9, 0.98), 1e-6,
                           0.01 if decays[id(mine[i])] else 0.0)
        optimizer.step()
        reference.step()
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        missed = max((c - b).abs().max().item() for c, b in zip(control, ref))
        if step < 4:   # the same gradients: the RMS is 1, the clip idle, and the control keeps up
            assert missed < 1e-6, (step, missed)
        if step == 4:   # the spike: the clip engages (RMS about 2.2), and a rule without it is far off
            assert missed > 1e-3, missed


class OperatorCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator call at the top of the dispatcher: a foreach op is one call here, whatever the
    number of tensors it takes (a CPU kernel may then loop over them below this level)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def lamb_step_calls(layers: int) -> tuple[int, int, collections.Counter]:
    """(tensors, operator calls, by operator) of one LAMB step (the second: state exists) with a found_inf
    flag, on a BERT of `layers` layers (12: BERT-base's parameter list, 202 tensors, at hidden 32)."""
    from bert_recipes.config import OptimConfig
    from bert_recipes.optim import build_optimizer
    model = tiny_bert(layers)
    optimizer = build_optimizer(model, OptimConfig(name="lamb"))
    optimizer.found_inf = torch.zeros(())
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        mode = OperatorCalls()
        with mode:
            optimizer.step()
    return len(list(model.parameters())), sum(mode.calls.values()), mode.calls


def test_a_lamb_step_makes_as_many_operator_calls_for_bert_base_as_for_two_layers():
    """docs/speed.md's count: 33 calls for BERT-base's 202 tensors in 2 groups (the per-tensor loop before
    2026-12-03 made 6,138). The count depends on the groups only, and no call reads a value on the host."""
    tensors_2, calls_2, _ = lamb_step_calls(2)
    tensors_12, calls_12, by_op = lamb_step_calls(12)
    assert (tensors_2, tensors_12) == (42, 202)
    assert calls_12 == calls_2 <= 40, by_op
    assert "aten._local_scalar_dense.default" not in by_op and "aten.item.default" not in by_op, by_op
    print(f"LAMB step on BERT-base's parameter list ({tensors_12} tensors, 2 groups): {calls_12} operator calls")


def test_a_stable_adamw_step_reads_nothing_on_the_host_and_torch_optimis_does():
    """The whole step on the device: no operator of ours reads a value on the host (torch-optimi's reads each
    tensor's RMS with .item(): the positive control that the count sees a host read); the rule is multi-tensor, its
    one per-tensor call the skip's select of the gradients (found_inf set, as the engine sets it every step)."""
    ours, optimizer, theirs, reference = ours_and_optimi()
    optimizer.found_inf = torch.zeros(())
    counts = []
    for model, step in ((ours, optimizer.step), (theirs, reference.step)):
        for _ in range(2):   # the second step: the state exists
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            mode = OperatorCalls()
            with mode:
                step()
        counts.append(mode.calls)
    host = ("aten._local_scalar_dense.default", "aten.item.default")
    assert not any(op in counts[0] for op in host), counts[0]
    assert any(op in counts[1] for op in host), counts[1]
    tensors = len(list(ours.parameters()))
    assert counts[0]["aten.where.self"] == tensors + 3 * 2 and sum(counts[0].values()) <= tensors + 60 * 2, counts[0]


def test_a_float64_step_count_from_an_old_checkpoint_resumes():
    """The per-tensor loop before 2026-12-03 saved each step count as a float64 tensor; loading it gives
    float32 counts on the parameters' device (what the fused kernel reads), and the step continues."""
    from bert_recipes.config import OptimConfig
    from bert_recipes.optim import build_optimizer
    model = tiny_bert()
    optimizer = build_optimizer(model, OptimConfig(name="lamb"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = optimizer.state_dict()
    for state in saved["state"].values():
        state["step"] = state["step"].to(torch.float64)
    for group in saved["param_groups"]:   # the old Lamb's groups had neither key
        del group["fused"]
    fresh = build_optimizer(model, OptimConfig(name="lamb"))
    fresh.load_state_dict(saved)
    fresh.step()
    assert {(s["step"].dtype, s["step"].item()) for s in fresh.state.values()} == {(torch.float32, 2.0)}


def test_a_deepspeed_json_with_its_own_lamb_is_refused_in_one_line():
    """DeepSpeed's FusedLamb scales every tensor by a ratio clamped to [0.01, 10]: not the recipe's LAMB. A
    JSON whose optimizer block names it is one line (ZeRO-0 here, where LAMB itself would run)."""
    from bert_recipes.backends.consistency import check_consistency
    from bert_recipes.backends.plan import LaunchPlan
    from bert_recipes.config import ConfigError, load_config
    cfg = load_config(REPO / "recipes/bert-base-mlm-phase1-lamb.yaml")
    ds = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}
    with pytest.raises(ConfigError) as err:
        check_consistency(cfg, LaunchPlan(deepspeed=True, ds_config=ds, ds_config_path="lamb.json"), 8, 16,
                          has_cuda=False)
    line = str(err.value)
    assert "\n" not in line and "lamb.json optimizer.type=Lamb is DeepSpeed's FusedLamb" in line, line
    del ds["optimizer"]
    check_consistency(cfg, LaunchPlan(deepspeed=True, ds_config=ds, ds_config_path="lamb.json"), 8, 16, has_cuda=False)


def test_train_py_learns_what_the_trainer_learns_and_its_worse_controls_do_not(tmp_path, sample_dir):
    """tools/quality.py, the suite's form: seed 1, paired (the same initial weights and the same micro
    batches in the same order on both sides, the same maths: micro 8 x accumulation 2, the Trainer's loss
    divided by the accumulation as train.py's is), 500 MLM steps of the tiny BERT, past the unigram plateau
    (~5.97 at 100 steps; ~5.6 here). Per seed d = train.py's MLM eval loss - the Trainer's, scored by one
    evaluator over the same masks, must lie in quality.BAND = [-0.030, +0.035]: the mean +- 4 standard
    deviations of d measured over seeds 1-6 on 2026-12-03 (mean +0.004, sd 0.0074; seed 1 gave +0.010; the
    comment at BAND has every figure; one seed keeps the test near 2 minutes, the band being a per-seed rule).
    The positive controls run the same comparison on seed 1 and must fail it on the worse side: train.py with
    its lr quartered (d = +0.212 measured), and train.py whose loss sees the labels of only half the masked
    positions (+0.105). 4 runs of 500 steps, in two processes of one thread each. A
    comparison that passes them has no power (the test this replaced, 100 steps on the plateau with a band of
    at least 0.1 nats, passed with train.py's lr halved).
    The tagger (tiny-ner's task) the same way, from the seed-0 initial weights (no make demo): 264 steps, d = its
    entity F1 - the Trainer's within quality.NER_BAND = [-0.025, +0.030] (measured over 12 seeds; seed 1 gave
    +0.005), and its quarter-lr control below it (-0.158 measured).
    The span head (tiny-squad's questions) from the same start: 240 steps, d = its SQuAD F1 - the Trainer's within
    quality.QA_BAND = [-6.6, +4.9] (6 seeds; seed 1 gave -0.97). Its quarter-lr control scores below train.py (d -7.20
    measured) but is not asserted outside the band: 0.6 points beyond it is a third of one seed's spread.
    The embedding model (tiny-retrieval's pairs) against sentence-transformers' own trainer with
    MultipleNegativesRankingLoss, from the same start without dropout: 174 steps, d = its nDCG@10 - theirs within
    quality.RETRIEVAL_BAND = [-0.005, +0.004] (6 seeds; seed 1 gave +0.0002), and its temperature-10x control (a
    softmax at 0.5, not 0.05) below it (-0.022 measured)."""
    import json
    import subprocess
    sys.path.insert(0, str(REPO / "tools"))
    from quality import BAND, NER_BAND, PLATEAU, QA_BAND, RETRIEVAL_BAND
    out = tmp_path / "quality"
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "tools/quality.py", "--seeds", "1", "--controls",
                           "quarter-lr,half-labels,temperature-10x", "--control-seeds", "1", "--ner-steps", "264",
                           "--qa-steps", "240", "--retrieval-steps", "174", "--classify-from", "init",
                           "--out", str(out),
                           "--sample-dir", str(sample_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "quality.json").read_text())
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("|")))
    results, verdicts = report["results"], report["verdicts"]
    for side in ("train.py", "Trainer"):   # both left the plateau: the comparison is of learning, not of noise
        assert all(m["mlm_loss"] < PLATEAU - 0.2 for m in results[side].values()), results
    assert verdicts["train.py"]["passes"], verdicts["train.py"]
    for control in ("quarter-lr", "half-labels"):
        d = verdicts[f"train.py {control}"]["d"]
        assert list(d) == ["1"] and d["1"] > BAND[1], (control, d, BAND)
    tagger = report["ner_verdicts"]
    assert all(m["ner_f1"] > 0.3 for side in ("train.py", "Trainer") for m in results[side].values()), results
    assert tagger["train.py"]["passes"], tagger["train.py"]
    d = tagger["train.py quarter-lr"]["d"]
    assert list(d) == ["1"] and d["1"] < NER_BAND[0], (d, NER_BAND)
    answerer = report["qa_verdicts"]
    assert all(m["qa_f1"] > 10 for side in ("train.py", "Trainer") for m in results[side].values()), results
    assert QA_BAND[0] <= answerer["train.py"]["d"]["1"] <= QA_BAND[1], answerer["train.py"]
    assert answerer["train.py quarter-lr"]["d"]["1"] < answerer["train.py"]["d"]["1"], answerer
    embedder = report["retrieval_verdicts"]
    assert all(m["retrieval_ndcg"] > 0.25 for side in ("train.py", "Trainer") for m in results[side].values()), results
    assert embedder["train.py"]["passes"], embedder["train.py"]
    d = embedder["train.py temperature-10x"]["d"]
    assert list(d) == ["1"] and d["1"] < RETRIEVAL_BAND[0], (d, RETRIEVAL_BAND)
    assert "train.py quarter-lr" not in embedder   # the span head's and the tagger's control only


def test_the_shifted_end_control_moves_each_held_answers_last_token():
    """tools/quality.py's shifted-end control (the span head's): each answer's last token one to the right, clamped to
    the window; a window whose labels point at [CLS] (no answer in it) keeps them; the window number stays."""
    import torch
    sys.path.insert(0, str(REPO / "tools"))
    from quality import shifted_end
    batch = {"input_ids": torch.zeros(3, 8, dtype=torch.long),
             "labels": torch.tensor([[2, 4, 0], [0, 0, 1], [5, 7, 2]])}
    out = shifted_end(batch)
    assert out["labels"].tolist() == [[2, 5, 0], [0, 0, 1], [5, 7, 2]]
    assert batch["labels"].tolist() == [[2, 4, 0], [0, 0, 1], [5, 7, 2]]   # the batch itself untouched


def test_a_stable_adamw_run_resumes_bit_exact(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """train.py with optim.name=stable_adamw (ModernBERT's betas and eps), halted at step 6 and resumed: the
    uninterrupted run's losses and weights, bit for bit (the moments, step counts and max_lr travel in the
    checkpoint); and the loss falls."""
    import json

    from conftest import run_in_process, tiny_args
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **{  # noqa: E731
        "tokenizer.name_or_path": shared_tokenizer, "optim.name": "stable_adamw", "optim.betas": "[0.9, 0.98]",
        "optim.eps": 1e-6, "train.max_steps": 12, "checkpoint.save_every": 6, "logging.log_every": 2,
        "model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0, **more})
    run_in_process(args(tmp_path / "full"))
    run_in_process(args(tmp_path / "split", **{"train.halt_at_step": 6}))
    run_in_process(args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    losses = [[r["loss"] for r in json.loads((tmp_path / name / "metrics.json").read_text())["history"]["train"]]
              for name in ("full", "split")]
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0] - 0.3, losses
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "full/model/model.safetensors"), load_file(tmp_path / "split/model/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_every_recipe_that_names_a_reference_keeps_its_values_or_says_why():
    """recipes/references.tsv: each value of the ModernBERT and BERT phase recipes against the reference's own file
    (tools/fidelity.py, offline): every row holds, and docs/recipes.md shows the table the tool prints. Controls: a
    `same` row whose reference is another value, and a `different` row whose recipe has the reference's value, each
    fail with a line naming the recipe and the key."""
    sys.path.insert(0, str(REPO / "tools"))
    import fidelity
    table = fidelity.rows()
    assert fidelity.check(table) == []
    assert fidelity.markdown(table) in (REPO / "docs/recipes.md").read_text()
    assert {row["recipe"] for row in table} >= {f"recipes/{name}.yaml" for name in (
        "modernbert-base-mlm", "modernbert-base-context", "modernbert-base-decay", "bert-base-mlm-phase1",
        "bert-base-mlm-phase2")}
    same = next(i for i, row in enumerate(table) if row["key"] == "optim.lr" and row["verdict"] == "same")
    different = next(i for i, row in enumerate(table) if row["verdict"] != "same")
    drifted = [dict(row) for row in table]
    drifted[same]["reference"] = "0.123"
    from bert_recipes.config import load_config
    recipe_value = fidelity.effective(load_config(REPO / table[different]["recipe"]), table[different]["key"])
    drifted[different]["reference"] = json.dumps(recipe_value)
    problems = fidelity.check(drifted)
    assert len(problems) == 2, problems
    lr = next(p for p in problems if p.startswith(f"{table[same]['recipe']}: optim.lr="))
    assert "says 0.123: set it, or say why it differs" in lr
    assert any(p.startswith(f"{table[different]['recipe']}: {table[different]['key']}=") and "make the row `same`" in p
               for p in problems)


def test_stable_adamw_clips_nothing_unless_a_recipe_says_and_then_warns_as_modernbert():
    """optim.max_grad_norm unset: 1.0, and 0 (no clipping) under optim.name=stable_adamw, as ModernBERT trains; set
    with StableAdamW, it clips, and ModernBERT's own warning is one line. Control: AdamW with a clip: no warning."""
    from bert_recipes.config import load_config
    from bert_recipes.config.rules import schedule_warnings
    assert load_config(None, []).optim.max_grad_norm == 1.0
    assert load_config(None, ["optim.name=stable_adamw"]).optim.max_grad_norm == 0.0
    told = load_config(None, ["optim.name=stable_adamw", "optim.max_grad_norm=1.0"])
    assert told.optim.max_grad_norm == 1.0
    said = [line for line in schedule_warnings(told, 1000) if "StableAdamW" in line]
    assert said == ['[warning] optim.max_grad_norm=1.0 with optim.name=stable_adamw: "The StableAdamW optimizer '
                    'replaces gradient clipping" (ModernBERT\'s main.py, which warns the same): leave it unset (no '
                    'clipping under StableAdamW) or set 0']
    assert not [line for line in schedule_warnings(load_config(None, ["optim.max_grad_norm=1.0"]), 1000)
                if "StableAdamW" in line]
