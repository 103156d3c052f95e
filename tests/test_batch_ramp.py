"""A batch that grows (train.global_batch_size_start -> train.global_batch_size over train.batch_rampup_tokens),
bert_recipes/batch_ramp.py: the stages and where each step's micro batches come from (no step crosses an epoch's
end, whatever the stages); a run logs its batch, and its lr is the run without a ramp's (the schedule counts
steps); one halt inside a batch stage, a masking level, a mix of two sources (data.mixture) and an epoch, resumed
bit-exact on the same process count and within the suite's band on another (DDP 2 -> 1, ZeRO-2 1 -> 2); each bad
value one line."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from bert_recipes.batch_ramp import batch_plan
from bert_recipes.config import load_config
from conftest import assert_same_weights, launch, refused_in_process, run_in_process, tiny_args

TOL = 1e-5   # fp32, dropout off: another process count sums in another order


def plan_of(tmp_path, sequences: int, steps: int = 1000, seq: int | None = None, **train):
    cfg = load_config(None, [f"run.output_dir={tmp_path}"] + [f"train.{k}={v}" for k, v in train.items()])
    return batch_plan(cfg.train, seq or cfg.data.max_seq_length, sequences, steps)


def test_the_stages_divide_the_full_batch_and_no_step_crosses_an_epoch(tmp_path):
    p = plan_of(tmp_path, 100_000, global_batch_size=4608, micro_batch_size=96, global_batch_size_start=768,
                batch_rampup_tokens=300_000_000)
    assert [s.batch for s in p.stages] == [768, 1536, 2304, 4608]      # ModernBERT's 768 -> 4608: the divisors
    assert all(s.steps % (4608 // s.batch) == 0 for s in p.stages[:-1])  # whole full-size steps a stage
    assert p.stages[0].steps * 768 * 128 >= 100_000_000 > (p.stages[0].steps - 6) * 768 * 128   # a third of the tokens
    for cfg in (p, plan_of(tmp_path, 1000, global_batch_size=32, micro_batch_size=4, global_batch_size_start=8,
                           batch_rampup_tokens=2048)):
        for step in range(400):
            epoch, taken = cfg.where(step)
            batch, _ = cfg.at(step)
            assert taken + batch // cfg.micro <= cfg.epoch_batches, step
            assert cfg.position(step + 1) - cfg.position(step) == batch // cfg.micro
    flat = plan_of(tmp_path, 1000, global_batch_size=32, micro_batch_size=4)
    assert len(flat.stages) == 1 and flat.where(40) == divmod(40 * 8, 31 * 8) and flat.line(32, 1) is None
    epochs = plan_of(tmp_path, 1000, 62, global_batch_size=32, micro_batch_size=4, global_batch_size_start=8,
                     batch_rampup_tokens=2048, epochs=2, max_steps="null")
    assert epochs.position(epochs.total_steps) == 2 * epochs.epoch_batches   # the ramp's smaller steps: more steps
    assert epochs.total_steps > 62


def test_modernberts_stages_add_a_micro_batch_a_device_each_for_the_same_steps(tmp_path):
    """train.batch_rampup_stages=multiples on ModernBERT-base's own values (yamls/modernbert/modernbert-base-pretrain
    .yaml: 4,608 x 1,024 tokens, micro 96 on 8 GPUs, warmup from 768 over 50B tokens): every multiple of the start,
    each but the last the same steps. ModernBERT's BatchSizeWarmupScheduler (src/sequence_packer.py:40-50) gives each
    of its 5 ramp stages 50e9 / 8 / 15 tokens a device per micro batch a device = 4,238.6 steps of 96 x 1,024; here
    4,240 (rounded up to even). No step crosses an epoch's end, an epoch is whole steps of every stage, and the
    divisors' shape stays the default."""
    p = plan_of(tmp_path, 1_000_000, 30_000, 1024, global_batch_size=4608, micro_batch_size=96, global_batch_size_start=768,
                batch_rampup_tokens=50_000_000_000, batch_rampup_stages="multiples")
    assert [s.batch for s in p.stages] == [768, 1536, 2304, 3072, 3840, 4608]
    theirs = 50e9 / 8 / sum(range(1, 6)) / (96 * 1024)
    assert {s.steps for s in p.stages[:-1]} == {4240} and abs(4240 - theirs) < 2
    assert (p.epoch_batches * 96) % (60 * 768) == 0 and 1_000_000 - p.epoch_batches * 96 < 60 * 768   # lcm(1..6) = 60
    odd = plan_of(tmp_path, 1000, 1000, 32, global_batch_size=40, micro_batch_size=4, global_batch_size_start=8,
                  batch_rampup_tokens=7680, batch_rampup_stages="multiples")   # 7,680 / (32 x 8 x 10): 3 steps, made 4
    assert [(s.batch, s.steps) for s in odd.stages] == [(8, 4), (16, 4), (24, 4), (32, 4), (40, None)]
    for cfg in (p, odd):
        for step in range(0, 30_000 if cfg is p else 600, 7 if cfg is p else 1):
            epoch, taken = cfg.where(step)
            batch, _ = cfg.at(step)
            assert taken % (batch // cfg.micro) == 0 and taken + batch // cfg.micro <= cfg.epoch_batches, step
    assert "an epoch is 960 sequences, whole steps of every stage" in odd.line(32, 1)
    assert plan_of(tmp_path, 1000, global_batch_size=32, micro_batch_size=4, global_batch_size_start=8,
                   batch_rampup_tokens=2048).stages[2].batch == 32   # divisors: 8, 16, 32


# ----------------------------------------------------------------------------- runs
def mixture(sample_dir: Path) -> str:
    """data.mixture over the sample's two kinds of text, the language reference at 3 of 4 positions."""
    return (f"[{{name: reference, files: [{sample_dir}/pretrain/reference.txt], weight: 3}}, "
            f"{{name: docstrings, files: [{sample_dir}/pretrain/docstrings.txt], weight: 1}}]")


def common(shared_tokenizer, sample_dir, **extra):
    """16 steps: the batch 8 for steps 0-3, 16 for 4-5, then 32; the masking rate in 8 levels of 2 steps; a mixture
    of two sources (60 lines each) whose epoch is 11 full-size steps, so the run crosses an epoch's end, and whose
    language reference, at 3 of 4 positions, runs out at step 15."""
    return {"tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 16, "checkpoint.save_every": 8,
            "data.source": "files", "data.mixture": mixture(sample_dir),
            "logging.log_every": 1, "data.max_train_samples": 60, "train.micro_batch_size": 4,
            "train.global_batch_size": 32, "train.global_batch_size_start": 8, "train.batch_rampup_tokens": 2048,
            "data.mlm_probability": 0.3, "data.mlm_probability_end": 0.1, "model.hidden_dropout_prob": 0.0,
            "model.attention_probs_dropout_prob": 0.0, **extra}


def history(path: Path) -> list[dict]:
    return json.loads((path / "metrics.json").read_text())["history"]["train"]


def test_a_halt_inside_a_stage_a_level_and_an_epoch_resumes_bit_exact(tmp_path, sample_dir, datasets_cache,
                                                                     shared_tokenizer):
    """One process, halted at step 5 (the batch-16 stage's second step, the masking rate's third level, the first
    epoch), resumed: the uninterrupted run's losses and weights, bit for bit. The log shows the ramp and each
    step's batch; the lr is the lr of the same run without a ramp (the schedule counts steps)."""
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, sample_dir, **more))  # noqa: E731
    run_in_process(args(tmp_path / "full"))
    run_in_process(args(tmp_path / "split", **{"train.halt_at_step": 5}))
    resumed = run_in_process(args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    full = history(tmp_path / "full")
    assert [r["loss"] for r in history(tmp_path / "split")] == [r["loss"] for r in full] and resumed["steps"] == 16
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "full/model/model.safetensors"), load_file(tmp_path / "split/model/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["global_batch_size"] for r in full] == [8] * 4 + [16] * 2 + [32] * 10
    mixed = json.loads((tmp_path / "full/metrics.json").read_text())["final"]["mixture"]
    assert resumed["mixture"] == mixed and mixed["reference"]["passes"] > 1   # the reference ran out after the halt
    assert full[-1]["epoch"] > 1 > full[5]["epoch"]   # the run crossed an epoch's end after the halt
    run_in_process(args(tmp_path / "flat", **{"train.global_batch_size_start": "null",
                                              "train.batch_rampup_tokens": "null"}))
    assert [r["lr"] for r in history(tmp_path / "flat")] == [r["lr"] for r in full]


def test_a_halt_mid_ramp_resumes_on_another_process_count(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """The same halt on real processes: DDP on 2 processes halted at step 5 and resumed on 1 (accumulation 1, 2, 4
    becomes 2, 4, 8), and ZeRO-2 on 1 process halted and resumed on 2: each ends with the uninterrupted 2-process
    run's weights within 1e-5, having read what it read from each source, and says where the reference ran out."""
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, sample_dir, **more))  # noqa: E731
    full = launch(2, args(tmp_path / "full"))
    assert full["final"]["num_processes"] == 2 and full["final"]["backend"]["name"] == "ddp"
    assert "8 (accum 1) for steps 0-3, 16 (accum 2) for steps 4-5, 32 (accum 4) from step 6" in (
        tmp_path / "full.log").read_text()
    launch(2, args(tmp_path / "ddp", **{"train.halt_at_step": 5}))
    one = launch(1, args(tmp_path / "ddp", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 16
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "ddp/model/model.safetensors", TOL)
    assert one["final"]["mixture"] == full["final"]["mixture"]
    ran_out = "[data] source reference ran out: its pass 2 starts at step 15 (data.mixture)"
    assert ran_out in (tmp_path / "full.log").read_text() and ran_out in (tmp_path / "ddp.log").read_text()
    launch(1, args(tmp_path / "zero2", **{"train.halt_at_step": 5}), backend="zero2")
    two = launch(2, args(tmp_path / "zero2", **{"checkpoint.resume": "auto"}), backend="zero2")
    assert two["final"]["num_processes"] == 2 and two["final"]["backend"]["name"] == "zero2"
    assert "DEEPSPEED" in two["final"]["backend"]["distributed_type"]
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "zero2/model/model.safetensors", TOL)


def test_bad_values_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    cases = [({"train.global_batch_size_start": 8}, "train.global_batch_size_start is set and "
                                                    "train.batch_rampup_tokens is not"),
             ({"train.batch_rampup_tokens": 1000}, "train.batch_rampup_tokens is set and "
                                                   "train.global_batch_size_start is not"),
             ({"train.global_batch_size_start": 12, "train.batch_rampup_tokens": 1000},
              "train.global_batch_size_start=12 must divide train.global_batch_size=16"),
             ({"train.global_batch_size_start": 4, "train.batch_rampup_tokens": 1000},
              "train.global_batch_size_start=4 is not divisible by train.micro_batch_size=8 x world_size=1 = 8: every "
              "stage of the ramp (a multiple of the start) must be whole micro batches on every rank; the nearest that "
              "are: 8")]
    for extra, said in cases:
        argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache,
                                            **{"tokenizer.name_or_path": shared_tokenizer, **extra})]
        assert said in refused_in_process(argv, tmp_path, capsys)
    from bert_recipes.backends.deepspeed import pipeline_conflicts
    from bert_recipes.backends.plan import LaunchPlan
    cfg = load_config(None, tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "train.global_batch_size_start": 8, "train.batch_rampup_tokens": 1000}))
    plan = LaunchPlan(deepspeed=True, ds_config={"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}})
    assert any("train.global_batch_size_start under the pipeline engine" in c for c in pipeline_conflicts(cfg, plan, "x"))


def test_the_modern_recipe_runs_on_2_processes(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """recipes/tiny-mlm-modern.yaml as shipped (its ramp, masking levels, mix of sources, document mask and WSD), cut
    to 8 steps and a tenth of each source (the recipe's mixture, its files in the suite's sample): 2 processes train,
    and the run says what it does in its [schedule] and [data] lines."""
    import yaml
    out, recipe = tmp_path / "modern", Path(__file__).resolve().parent.parent / "recipes/tiny-mlm-modern.yaml"
    sources = yaml.safe_load(recipe.read_text())["data"]["mixture"]
    for source in sources:
        source["files"] = [str(sample_dir / Path(f).relative_to("data/sample")) for f in source["files"]]
    result = launch(2, [f"run.output_dir={out}", f"data.sample_dir={sample_dir}", f"data.cache_dir={datasets_cache}",
                        f"tokenizer.name_or_path={shared_tokenizer}", "train.max_steps=8", "logging.log_every=4",
                        "data.max_train_samples=400", "data.max_eval_samples=64", "logging.trackers=[]",
                        f"data.mixture={json.dumps(sources)}",
                        "logging.progress_bar=false", "logging.plot=false"], recipe=str(recipe))
    assert result["final"]["num_processes"] == 2 and result["final"]["steps"] == 8
    log = (tmp_path / "modern.log").read_text()
    assert "[schedule] the global batch (sequences) ramps over 1,048,576 tokens" in log
    assert "16 (accum 1) for steps 0-255, 32 (accum 2) for steps 256-383, 64 (accum 4) from step 384" in log
    assert "[schedule] the masking rate moves in 8 levels: 0.3 (K 38) from step 0" in log
    assert [r["global_batch_size"] for r in result["history"]["train"]] == [16, 16]
    assert "[data] data.mixture: 2 sources" in log and "500 of each 1000 positions (target 50.0%" in log
    assert sum(s["sequences"] for s in result["final"]["mixture"].values()) == 8 * 16


def test_modernberts_stages_resume_on_another_process_count(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """train.batch_rampup_stages=multiples (8, 16, 24, 32, two steps each): DDP on 2 processes halted at step 5, in the
    24-sequence stage (accumulation 3, which 1 process runs as 6), resumed on 1: the uninterrupted 2-process run's
    weights within 1e-5, with the same batches and the same mixture reads, across an epoch's end (416 sequences in
    16 steps, an epoch cut to 288: whole steps of every stage, as the log says)."""
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **common(  # noqa: E731
        shared_tokenizer, sample_dir, **{"train.batch_rampup_stages": "multiples", **more}))
    full = launch(2, args(tmp_path / "full"))
    assert full["final"]["num_processes"] == 2 and full["final"]["backend"]["name"] == "ddp"
    assert ("8 (accum 1) for steps 0-1, 16 (accum 2) for steps 2-3, 24 (accum 3) for steps 4-5, 32 (accum 4) from "
            "step 6; an epoch is 288 sequences, whole steps of every stage") in (tmp_path / "full.log").read_text()
    launch(2, args(tmp_path / "ddp", **{"train.halt_at_step": 5}))
    one = launch(1, args(tmp_path / "ddp", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 16
    assert [r["global_batch_size"] for r in history(tmp_path / "ddp")] == [8] * 2 + [16] * 2 + [24] * 2 + [32] * 10
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "ddp/model/model.safetensors", TOL)
    assert one["final"]["mixture"] == full["final"]["mixture"]
