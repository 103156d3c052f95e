"""optim.decay: wsd (warmup-stable-decay), checked against transformers' get_wsd_schedule step by step, and
resumed from a stable-phase checkpoint into a longer run: every step before the checkpoint keeps its lr, and
the weights equal those of the run that was that long from the start.

Where the definitions differ, by name:
- warmup: ours gives step k (0-based) the factor (k + 1) / warmup, as this repository's other schedules do (step
  0 trains); transformers' gives k / warmup, and starts it at min_lr_ratio (k / warmup x (1 - min) + min). From
  the end of the warmup on the two agree exactly: the stable phase at 1, the decay at min + (1 - min) x shape(p),
  p = (k - first decay step) / decay steps, the last step at p = (n - 1) / n.
- torchtitan's warmup_stable_decay decays one step ahead: p = (k + 1 - first decay step) / decay steps, so its
  last step is at p = 1 (min_lr exactly) and its first decay step already below the peak; its "sqrt" is our
  and transformers' "1-sqrt". Not compared here: torchtitan is not installed (no reference by hand)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bert_recipes.config import ConfigError, OptimConfig, load_config, validate
from bert_recipes.optim import build_scheduler, schedule, schedule_change, wsd_decay_start
from conftest import run_in_process, tiny_args


def lrs(scheduler, steps: int) -> list[float]:
    """The lr of optimizer steps 0..steps-1, as the optimizer sees it."""
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("warmup,min_ratio,decay_ratio", [(0, 0.0, 0.2), (10, 0.1, 0.3), (7, 0.0, 1.0)])
def test_wsd_matches_transformers_get_wsd_schedule_step_by_step(shape, warmup, min_ratio, decay_ratio):
    from transformers import get_wsd_schedule
    total, lr = 100, 3e-4
    cfg = OptimConfig(lr=lr, decay="wsd", warmup_steps=warmup, min_lr_ratio=min_ratio, wsd_decay_ratio=decay_ratio,
                      wsd_decay_shape=shape)
    start = wsd_decay_start(cfg, total)
    assert start == max(warmup, total - round(decay_ratio * total))
    ours = lrs(build_scheduler(optimizer(lr), cfg, total), total)
    theirs = lrs(get_wsd_schedule(optimizer(lr), num_warmup_steps=warmup, num_decay_steps=total - start,
                                  num_training_steps=total, decay_type=shape, min_lr_ratio=min_ratio), total)
    for k in range(warmup):   # the named difference: (k + 1) / warmup against min + (1 - min) x k / warmup
        assert ours[k] == pytest.approx(lr * (k + 1) / warmup, rel=1e-12)
        assert theirs[k] == pytest.approx(lr * (min_ratio + (1 - min_ratio) * k / warmup), rel=1e-12)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12, abs=0)
    assert ours[start - 1] == lr and ours[start] == lr and ours[start + 1] < lr   # the decay starts at `start`
    assert ours[-1] < lr * (min_ratio + 0.5 * (1 - min_ratio))   # and goes most of the way down


def test_a_longer_run_keeps_the_past_only_under_wsd():
    """The schedules of a 16-step and a 24-step run: under wsd (warmup_steps) equal up to the 16-step run's
    decay; under linear, cosine and polynomial they differ from the first step after warmup: the positive
    control, and the [resume] line says so."""
    wsd = OptimConfig(decay="wsd", warmup_steps=2, wsd_decay_ratio=0.25)
    short, long = schedule(wsd, 16), schedule(wsd, 24)
    assert [short(k) for k in range(13)] == [long(k) for k in range(13)] and short(13) < long(13) == 1.0
    line = schedule_change(wsd, 8, 16, 24)
    assert line.startswith("[resume] the run's length changed, 16 -> 24") and "through step 18" in line, line
    assert "over steps 19-24 (was 13-16)" in line and "steps 1-8, up to this checkpoint, is unchanged" in line
    assert schedule_change(wsd, 8, 24, 24) is None
    for decay in ("linear", "cosine", "polynomial"):
        cfg = OptimConfig(decay=decay, warmup_steps=2, poly_power=0.5)
        short, long = schedule(cfg, 16), schedule(cfg, 24)
        assert short(1) == long(1) and short(2) == long(2) == 1.0 and short(3) != long(3)
        line = schedule_change(cfg, 8, 16, 24)
        assert f"optim.decay={decay} is shaped by the run's length, so step 9 trains at lr" in line, line
        assert "steps 4-8 trained on the old one" in line
    ratio = OptimConfig(decay="wsd", warmup_ratio=0.25)   # a warmup that scales with the run: its past moves too
    assert "is shaped by the run's length" in schedule_change(ratio, 8, 16, 24)


def test_wsd_decay_start_is_checked_against_the_warmup():
    cfg = load_config(None, ["train.max_steps=10", "optim.decay=wsd", "optim.warmup_steps=5",
                             "optim.wsd_decay_start=3"])
    with pytest.raises(ConfigError, match=r"optim.wsd_decay_start=3 falls inside the warmup \(optim.warmup_steps=5\)"):
        validate(cfg)


def test_a_stable_phase_checkpoint_resumes_into_a_longer_run_as_if_it_had_been_planned(
        tmp_path, sample_dir, datasets_cache, shared_tokenizer, capfd):
    """24 steps of wsd at once, against 16 planned (decay from step 13), halted at step 8 in the stable phase and
    resumed with train.max_steps=24 (decay from step 19): every step's lr is the same, side by side, and so are
    the final weights, exactly (CPU is deterministic). The lrs after warmup are transformers' get_wsd_schedule's."""
    from transformers import get_wsd_schedule
    common = {"data.max_train_samples": 160, "train.micro_batch_size": 8, "train.global_batch_size": 16,
              "tokenizer.name_or_path": shared_tokenizer, "optim.decay": "wsd", "optim.wsd_decay_ratio": 0.25,
              "optim.wsd_decay_shape": "1-sqrt", "optim.min_lr_ratio": 0.1, "logging.log_every": 1,
              "checkpoint.save_every": 8, "train.eval_final": False}
    full = run_in_process(tiny_args(tmp_path / "full", sample_dir, datasets_cache, **common, **{"train.max_steps": 24}))
    halted = run_in_process(tiny_args(tmp_path / "split", sample_dir, datasets_cache, **common,
                                      **{"train.max_steps": 16, "train.halt_at_step": 8}))
    assert halted == {"steps": 8, "halted": True}
    capfd.readouterr()
    resumed = run_in_process(tiny_args(tmp_path / "split", sample_dir, datasets_cache, **common,
                                       **{"train.max_steps": 24, "checkpoint.resume": "auto"}))
    log = capfd.readouterr().out
    lines = [line for line in log.splitlines() if line.startswith("[resume] the run's length changed")]
    assert len(lines) == 1 and "through step 18" in lines[0] and "(was 13-16)" in lines[0], log
    assert resumed["steps"] == full["steps"] == 24
    rows = lambda name: json.loads((tmp_path / name / "metrics.json").read_text())["history"]["train"]   # noqa: E731
    side_by_side = [(a["step"], a["lr"], b["lr"]) for a, b in zip(rows("full"), rows("split"))]
    print("step  uninterrupted (24)  halted at 8 of 16, resumed to 24")
    for step, a, b in side_by_side:
        print(f"{step:4d}  {a:.6e}        {b:.6e}")
    assert [s for s, _, _ in side_by_side] == list(range(1, 25))
    assert all(a == b for _, a, b in side_by_side), side_by_side
    # the lr logged after step s is the one step s + 1 trains with: transformers' factor at index s
    reference = lrs(get_wsd_schedule(optimizer(3e-3), num_warmup_steps=2, num_decay_steps=6, num_training_steps=24,
                                     decay_type="1-sqrt", min_lr_ratio=0.1), 25)
    assert [lr for _, lr, _ in side_by_side][1:] == pytest.approx(reference[2:25], rel=1e-12)
    a, b = load_file(tmp_path / "full/model/model.safetensors"), load_file(tmp_path / "split/model/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
