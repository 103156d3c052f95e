"""GPU-only settings run right or are refused in one line (issue 38, item 3): CUDA graphs with accumulation
refused; torch.compile under DDP's no_sync and under DeepSpeed ZeRO-2 run on CPU processes (gloo, dynamo's eager
backend: the same tracing, guards and graph breaks as inductor, no kernels), with their recompiles counted;
train.micro_batch_size=auto's trial step backs off on an out-of-memory error, and every rank agrees."""
from __future__ import annotations

import json
import os
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from conftest import REPO, launch_script, refused_in_process, tiny_args


# ----------------------------------------------------------------------------- compile under DDP and ZeRO
def compiled_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, backend: str, **extra):
    """2 processes, global 16 = micro 4 x accumulation 2 x 2 ranks, compiled with the eager backend, under
    tests/compile_harness.py. -> (metrics.json's final, each rank's compile report, the log)."""
    out, reports = tmp_path / backend, tmp_path / f"{backend}.compile"
    args = tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.compile": True, "train.compile_backend": "eager",
        "train.micro_batch_size": 4, "train.max_steps": 6, "train.eval_every": 3, "logging.log_every": 3, **extra})
    log = launch_script("tests/compile_harness.py", [f"--{a}" for a in args], 2, backend=backend)
    final = json.loads((out / "metrics.json").read_text())["final"]
    return final, [json.loads((reports / f"rank{r}.json").read_text()) for r in (0, 1)], log



def test_compile_runs_under_ddp_no_sync(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """DDP, 2 gloo processes, accumulation 2 (the first micro batch of each step under no_sync): no recompile in
    6 steps and 2 (eager) evaluations, on either rank, with logging.sync_audit's torch-function mode entered
    around every step (sync_audit._AuditMode: a mode class made anew each step recompiled every step)."""
    final, reports, _ = compiled_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, "ddp",
                                     **{"logging.sync_audit": True})
    assert final["num_processes"] == 2 and final["backend"]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert final["backend"]["compile"] == {"backend": "eager", "mode": "default", "dynamic": False}
    for report in reports:
        assert report["steps_seen"] == 6 and report["recompiles"] == [] and report["unique_graphs"] >= 1, report
    assert final["last_train_loss"] < final["first_train_loss"] and "sync_audit" in final


def test_compile_runs_under_zero2(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """DeepSpeed ZeRO-2, 2 gloo processes, accumulation 2: compiled, no recompile after the first step."""
    final, reports, _ = compiled_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, "zero2")
    assert final["num_processes"] == 2 and final["backend"]["distributed_type"] == "DistributedType.DEEPSPEED"
    assert final["backend"]["zero_stage"] == 2 and final["backend"]["compile"]["backend"] == "eager"
    for report in reports:
        assert report["steps_seen"] == 6 and report["recompiles"] == [] and report["unique_graphs"] >= 1, report
    assert final["last_train_loss"] < final["first_train_loss"]


# ----------------------------------------------------------------------------- refused in one line
def test_cuda_graphs_with_accumulation_are_refused(tmp_path, sample_dir, datasets_cache, capsys):
    """reduce-overhead with accumulation 2: one config error line naming both fields and the fix, nothing written."""
    args = tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "train.compile": True, "train.compile_mode": "reduce-overhead"})
    line = refused_in_process(["--recipe", str(REPO / "recipes/tiny-mlm.yaml")] + [f"--{a}" for a in args],
                              tmp_path, capsys)
    assert "train.compile_mode=reduce-overhead" in line and "accumulation 2" in line, line
    assert "train.micro_batch_size=8" in line and "set train.micro_batch_size=16" in line, line


def test_compile_is_refused_where_dynamo_would_trace_partitioned_parameters(tmp_path, sample_dir, datasets_cache):
    """ZeRO-3 partitions the parameters dynamo traces (seen failing on the first step): refused before any rank
    starts (preflight, as the Make targets run it), one line naming the field, the JSON and the fix."""
    import subprocess
    args = tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{"train.compile": True})
    done = subprocess.run([sys.executable, "-m", "bert_recipes.preflight", "accelerate_configs/zero3.yaml",
                           "--num_processes", "2", "--",
                           "--recipe", "recipes/tiny-mlm.yaml"] + [f"--{a}" for a in args], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    lines = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "train.compile under ZeRO-3 (ds_configs/zero3.json)" in lines[0] and "train.compile=false" in lines[0]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- micro_batch_size=auto's trial
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which "
            "1.06 GiB is free. Of the allocated memory 136.10 GiB is allocated by PyTorch, and 1.20 GiB is reserved "
            "by PyTorch but unallocated.")


def trial_setup(monkeypatch, fits_up_to: int, planned: int = 16, global_batch: int = 32, world: int = 1):
    """A tiny MLM recipe whose planner chose `planned`, a DDP plan taken for a GPU's, an engine stand-in on the
    CPU, and the model's forward raising torch.OutOfMemoryError with CUDA's message for batches above
    `fits_up_to`, where CUDA raises it: after the forward has allocated its first activations (kept in `held`
    through weak references, to see them freed). -> (cfg, plan, engine, lines said, held)."""
    from bert_recipes.backends.consistency import resolve_run
    from bert_recipes.backends.plan import backend_rows
    from bert_recipes.config import load_config
    from bert_recipes.architectures.bert import RecipeBertForMaskedLM
    cfg = load_config(REPO / "recipes/tiny-mlm.yaml", [
        "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=64", "tokenizer.vocab_size=1000", "data.max_seq_length=32",
        f"train.global_batch_size={global_batch}", f"train.micro_batch_size={planned}"])
    plan = resolve_run(cfg, backend_rows()["ddp"].plan, world, capability=None)
    plan.on_gpu = True   # the trial's branch; the device stays the CPU
    lines, held, forward = [], [], RecipeBertForMaskedLM.forward

    def forward_or_oom(self, input_ids=None, **kwargs):
        if input_ids.shape[0] > fits_up_to:
            activation = self.bert.embeddings(input_ids=input_ids)
            held.append(weakref.ref(activation))
            raise torch.OutOfMemoryError(CUDA_OOM)
        return forward(self, input_ids=input_ids, **kwargs)
    monkeypatch.setattr(RecipeBertForMaskedLM, "forward", forward_or_oom)
    monkeypatch.setattr("bert_recipes.trial.print0", lines.append)   # the trial's lines (ranks.print0 in a run)
    engine = types.SimpleNamespace(device=torch.device("cpu"), control=None, accum=None)
    engine.set_accumulation = lambda accum: setattr(engine, "accum", accum)
    return cfg, plan, engine, lines, held


def test_trial_steps_down_on_out_of_memory(monkeypatch):
    """The planner chose 16 of a rank's 32; the forward runs out of memory above 4: 16 and 8 fail (a line each,
    with both sizes; the failed step's activations freed), 4 runs, and the accumulation follows (32 / 4 = 8)."""
    from bert_recipes.trial import confirm_micro_batch
    cfg, plan, engine, lines, held = trial_setup(monkeypatch, fits_up_to=4)
    confirm_micro_batch(cfg, plan, engine)
    assert cfg.train.micro_batch_size == 4 and plan.accum == 8 and engine.accum == 8
    assert lines[0].endswith("a trial step at micro batch 16 ran out of GPU memory; trying 8"), lines
    assert lines[1].endswith("at micro batch 8 ran out of GPU memory; trying 4"), lines
    assert "-> 4: a whole step (optimizer states included) ran at 4 on every rank (the planner chose 16" in lines[2]
    assert len(held) == 2 and all(ref() is None for ref in held), "a failed trial step's tensors are still alive"


def test_trial_out_of_memory_in_the_optimizer_step(monkeypatch):
    """The optimizer's first step allocates its states: an out-of-memory error there steps down too."""
    from bert_recipes.trial import confirm_micro_batch
    cfg, plan, engine, lines, _ = trial_setup(monkeypatch, fits_up_to=32)
    from bert_recipes.optim import build_optimizer
    probe = build_optimizer(torch.nn.Linear(2, 2), cfg.optim)
    step, calls = type(probe).step, []

    def step_or_oom(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return step(self, *args, **kwargs)
    monkeypatch.setattr(type(probe), "step", step_or_oom)
    confirm_micro_batch(cfg, plan, engine)
    assert cfg.train.micro_batch_size == 8 and engine.accum == 4 and len(calls) == 2, (lines, calls)
    assert "micro batch 16 ran out of GPU memory; trying 8" in lines[0]


def test_trial_refuses_when_nothing_fits(monkeypatch, capsys):
    from bert_recipes.config import ConfigError
    from bert_recipes.trial import confirm_micro_batch
    cfg, plan, engine, lines, _ = trial_setup(monkeypatch, fits_up_to=0, planned=2, global_batch=4)
    with pytest.raises(ConfigError, match="ran out of GPU memory even at micro batch 1"):
        confirm_micro_batch(cfg, plan, engine)
    assert lines[-1].endswith("micro batch 1 ran out of GPU memory; no smaller size divides the batch"), lines


def test_trial_is_skipped_on_cpu_and_under_sharding(monkeypatch):
    """On CPU processes (and under ZeRO / FSDP: an unsharded trial would overstate a sharded step) the planner's
    choice stands, unchanged, and nothing is tried."""
    from bert_recipes.trial import confirm_micro_batch
    cfg, plan, engine, lines, held = trial_setup(monkeypatch, fits_up_to=0)
    plan.on_gpu = False
    confirm_micro_batch(cfg, plan, engine)
    assert cfg.train.micro_batch_size == 16 and lines == [] and held == [] and engine.accum is None


def test_ranks_agree_on_the_smallest(tmp_path):
    """2 processes (gloo): rank 0's trial fits up to 8, rank 1's up to 2; both set 2, accumulation 8."""
    out = launch_script("tests/test_gpu_settings.py", [str(tmp_path)], 2, launcher="torchrun")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results == [{"micro": 2, "accum": 8, "world": 2}] * 2, (results, out[-3000:])
    assert "micro batch 4 ran out of GPU memory; trying 2" in out


def _rank_main(out_dir: str) -> None:
    """One rank of test_ranks_agree_on_the_smallest."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    patch = pytest.MonkeyPatch()
    cfg, plan, engine, lines, _ = trial_setup(patch, fits_up_to=8 if rank == 0 else 2, planned=8, world=2)
    engine.control = dist.group.WORLD
    patch.setattr("bert_recipes.trial.print0", print)
    from bert_recipes.trial import confirm_micro_batch
    confirm_micro_batch(cfg, plan, engine)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"micro": cfg.train.micro_batch_size, "accum": engine.accum, "world": dist.get_world_size()}))
    patch.undo()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
