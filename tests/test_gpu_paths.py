"""The GPU-only decisions, factored out and checked on CPU: which device a launch trains on, the
default process count, bf16 by compute capability, TF32 and the peak each MFU divides by, the
fp16 skip decision against a real GradScaler, the timeouts, and a node-local output_dir."""
from __future__ import annotations

import os
import subprocess
import time
from datetime import timedelta

import pytest
import torch

from bert_recipes.backends.consistency import check_consistency
from bert_recipes.backends.plan import LaunchPlan, backend_rows, bf16_supported, decide_on_gpu
from bert_recipes.config import ConfigError, load_config
from bert_recipes.optim import skip_update_if
from bert_recipes.ranks import slow_barrier
from bert_recipes.throughput import gpu_peak
from conftest import REPO, _port, tiny_args

RECIPE = REPO / "recipes/tiny-mlm.yaml"


# ----------------------------------------------------------------------------- the device decision
@pytest.mark.parametrize("cpu_flag, env, cuda, expected", [
    (False, {}, True, True),                                # a GPU launch
    (True, {}, True, False),                                # ACCELERATE_USE_CPU=1 on a GPU host: gloo, CPU
    (False, {}, False, False),                              # no GPU
    (False, {"DS_ACCELERATOR": "cpu"}, False, False),       # DeepSpeed on CPU with the GPUs hidden
    (False, {"DS_ACCELERATOR": "cpu"}, True, ConfigError),  # DeepSpeed on CPU, GPUs visible: refused
])
def test_one_decision_says_whether_the_run_is_on_gpu(cpu_flag, env, cuda, expected):
    plan = LaunchPlan(cpu=cpu_flag)
    if expected is ConfigError:
        with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES="):
            decide_on_gpu(plan, env, cuda_available=cuda)
    else:
        assert decide_on_gpu(plan, env, cuda_available=cuda) is expected


def test_every_cpu_launch_hides_the_gpus():
    """The table's CPU rule, used by make <mode> CPU=1, tools/ and the tests: GPUs hidden, and
    DeepSpeed rows never see ACCELERATE_USE_CPU."""
    for name, row in backend_rows().items():
        if row.gpu_only:   # no CPU launch at all (tests/test_first_hour.py)
            with pytest.raises(ConfigError, match="runs on GPUs only"):
                row.cpu_launch_env({})
            continue
        env = row.cpu_launch_env({"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "0,1"})
        assert env["CUDA_VISIBLE_DEVICES"] == "", name
        if row.plan.kind in ("deepspeed", "pipeline"):
            assert env["DS_ACCELERATOR"] == "cpu" and "ACCELERATE_USE_CPU" not in env, name
        else:
            assert env["ACCELERATE_USE_CPU"] == "1" and "DS_ACCELERATOR" not in env, name


@pytest.mark.parametrize("args, expected", [
    (["zero2", "GPUS=4"], "--num_processes 4"),       # one process per GPU present, not the YAML's 8
    (["zero2", "GPUS=4", "NPROC=3"], "--num_processes 3"),
    (["zero2", "GPUS=4", "CPU=1"], "--num_processes 2"),
    (["zero2", "GPUS=0"], None),                      # no GPU and no CPU=1: the YAML's own count
    (["multinode", "GPUS=4"], None),                  # multi-node: num_processes counts every node
])
def test_default_process_count(args, expected):
    line = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    if expected is None:
        assert "--num_processes" not in line, line
    else:
        assert expected in line, line


# ----------------------------------------------------------------------------- bf16, TF32, peaks
@pytest.mark.parametrize("capability, ok", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True),
                                            ((9, 0), True), (None, False)])
def test_bf16_needs_compute_capability_8(capability, ok):
    assert bf16_supported(capability) is ok
    cfg = load_config(RECIPE, ["train.mixed_precision=bf16"])
    if ok:
        check_consistency(cfg, LaunchPlan(), 1, 2, has_cuda=True, capability=capability)
    elif capability is not None:
        with pytest.raises(ConfigError, match=rf"compute capability {capability[0]}\.{capability[1]}\) has no "
                                              "native bf16"):
            check_consistency(cfg, LaunchPlan(), 1, 2, has_cuda=True, capability=capability)


@pytest.mark.parametrize("name, precision, tf32, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989e12),
    ("NVIDIA H100 80GB HBM3", "no", True, 494e12),      # TF32 tensor cores
    ("NVIDIA H100 80GB HBM3", "no", False, 67e12),      # full FP32: the FP32 peak, not the TF32 one
    ("NVIDIA H100 PCIe", "bf16", True, 756e12),         # not the SXM figure
    ("NVIDIA H100 NVL", "bf16", True, 835e12),
    ("NVIDIA H200", "bf16", True, 989e12),
    ("NVIDIA L4", "bf16", True, 121e12),                # "L4" is not "L40S"
    ("NVIDIA L40S", "bf16", True, 362e12),
    ("NVIDIA A100-SXM4-80GB", "no", True, 156e12),
    ("Tesla V100-SXM2-16GB", "fp16", True, 125e12),
])
def test_mfu_divides_by_the_peak_the_matmuls_use(name, precision, tf32, peak):
    assert gpu_peak(name, precision, tf32)[0] == peak


def test_an_unknown_gpu_reports_nan_mfu_not_a_wrong_one():
    value, source = gpu_peak("NVIDIA Future 9000", "bf16", True)
    assert value != value and "add it to GPU_PEAK_FLOPS" in source


# ----------------------------------------------------------------------------- skipped steps
def _scaled_step(init_scale: float, engine_path: bool):
    """One fp16-style step with a real GradScaler and torch's fused AdamW. engine_path: as
    train.train_step does it (its own non-finite flag folded into the scaler's, on the
    device); else the scaler alone decides inside step()."""
    from types import SimpleNamespace
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    before = [p.detach().clone() for p in model.parameters()]
    loss = (model(torch.full((8, 4), 3.0)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    skipped = ~torch.isfinite(loss.detach()) | ~torch.isfinite(grad_norm)
    if engine_path:
        assert skip_update_if(SimpleNamespace(optimizer=optimizer), scaler, skipped)
    scaler.step(optimizer)
    scaler.update()
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return not bool(skipped), moved, scaler.get_scale()


def test_the_skip_decision_agrees_with_the_loss_scaler():
    """An overflowing scale (2^127) makes the unscaled norm inf: the engine's decision skips the step,
    exactly as the scaler alone would have (weights unchanged), and the scale halves either way. A sane
    scale: applied, weights moved, scale kept."""
    for engine_path in (True, False):
        assert _scaled_step(2.0 ** 127, engine_path) == (False, False, 2.0 ** 126)
        assert _scaled_step(2.0 ** 10, engine_path) == (True, True, 2.0 ** 10)


def test_the_recipes_optimizers_skip_on_the_device():
    """LAMB and StableAdamW take the skip as found_inf, as fused AdamW does: step() is called, nothing moves, and
    the engine never reads the flag (a bool() of it would be a host wait every step)."""
    from types import SimpleNamespace

    from bert_recipes.optim import Lamb, StableAdamW, skip_update_if
    for kind in (Lamb, StableAdamW):
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.full((3,), float("nan"))
        optimizer = kind([p], lr=0.1)
        # True: step() runs and skips on the device; the host-read road returns False for a skipped step
        assert skip_update_if(SimpleNamespace(optimizer=optimizer), None, torch.tensor(True)) is True
        optimizer.step()
        assert torch.equal(p.detach(), torch.ones(3)), kind.__name__


@pytest.mark.parametrize("fused, expected_step_call", [(True, True), (False, False)])
def test_a_non_finite_step_updates_nothing(fused, expected_step_call):
    """Without a loss scaler: fused AdamW takes the skip as found_inf (weights, moments and step count
    unchanged, decided on the device: no host wait); the foreach kernel cannot, so the engine reads the
    flag and does not call step() (the one documented host wait, optim.fused=false)."""
    from types import SimpleNamespace
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), float("nan"))
    optimizer = torch.optim.AdamW([p], lr=0.1, fused=True if fused else None, foreach=None if fused else True)
    step = skip_update_if(SimpleNamespace(optimizer=optimizer), None, torch.tensor(True))
    assert step is expected_step_call
    if step:
        optimizer.step()
    assert torch.equal(p.detach(), torch.ones(3))
    assert not optimizer.state or float(optimizer.state[p]["step"]) == 0


# ----------------------------------------------------------------------------- timeouts
def _barrier_worker(rank: int, port: int, queue):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    if rank == 1:
        time.sleep(60)   # "tokenizing" far longer than the allowed wait (terminated once rank 0 has reported)
        return
    t0 = time.time()
    try:
        slow_barrier(group, 2, "rank 0's data preparation")()
        queue.put(("no error", time.time() - t0))
    except TimeoutError as err:
        queue.put((str(err), time.time() - t0))


def test_the_data_preparation_wait_has_its_own_timeout_and_names_it():
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_barrier_worker, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    message, seconds = queue.get(timeout=60)
    for p in procs:
        p.terminate()
        p.join(timeout=30)
    # the 2 s wait, not rank 1's 60 s: the bound leaves 18 s for a loaded host
    assert "took longer than data.prepare_timeout_s=2s" in message and 1.5 < seconds < 20, (message, seconds)


def test_collectives_get_the_recipes_timeout(monkeypatch):
    """build_accelerator hands train.collective_timeout_s to the process group (the stuck-rank test in
    tests/test_reliability.py shows it firing)."""
    from accelerate.utils import InitProcessGroupKwargs

    from bert_recipes.backends.accelerator import build_accelerator
    from bert_recipes.backends.consistency import resolve_run
    seen = {}

    class Stop(Exception):
        pass

    def fake_accelerator(**kwargs):
        seen.update({type(h).__name__: h for h in kwargs["kwargs_handlers"]})
        raise Stop
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("accelerate.Accelerator", fake_accelerator)
    cfg = load_config(RECIPE, ["train.collective_timeout_s=42", "train.global_batch_size=64",
                               "train.micro_batch_size=32"])
    with pytest.raises(Stop):
        build_accelerator(resolve_run(cfg, LaunchPlan(on_gpu=False), 2), REPO / "runs/unused", train=cfg.train,
                          optim=cfg.optim, pin_memory=cfg.data.pin_memory)
    handler = seen["InitProcessGroupKwargs"]
    assert isinstance(handler, InitProcessGroupKwargs) and handler.timeout == timedelta(seconds=42)
    assert handler.backend == "gloo"


# ----------------------------------------------------------------------------- node-local disks
def test_a_node_local_output_dir_is_refused(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Two "nodes" on 127.0.0.1 whose output_dir paths lie on different disks (two roots): every
    rank stops with the same message before writing anything."""
    import sys
    port = str(_port())
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    logs = [open(tmp_path / f"node{node}.log", "w+") for node in (0, 1)]
    procs = []
    for node in (0, 1):
        args = [f"--{a}" for a in tiny_args(tmp_path / f"disk{node}" / "run", sample_dir, datasets_cache,
                                            **{"tokenizer.name_or_path": shared_tokenizer})]
        cmd = [str(os.path.join(os.path.dirname(sys.executable), "accelerate")), "launch", "--config_file",
               str(REPO / "accelerate_configs/multinode.yaml"), "--num_machines", "2", "--num_processes", "2",
               "--machine_rank", str(node), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               str(REPO / "train.py"), *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logs[node], stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=300) for p in procs]
    text = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
    assert codes[0] != 0 and codes[1] != 0
    assert text[0].count("is not shared by every rank") == 1 and "on a filesystem every node mounts" in text[0]
    assert "exitcode  : 2" in text[0] and "exitcode  : 2" in text[1]
    assert not (tmp_path / "disk0/run").exists() and not (tmp_path / "disk1/run").exists()
    assert not list((tmp_path / "disk0").glob(".run.shared-check-*"))   # rank 0 removed its marker


# ----------------------------------------------------------------------------- train.micro_batch_size: auto
@pytest.mark.parametrize("free_gb, expected", [(140, 32), (19, None), (0.5, "error")])
def test_the_automatic_micro_batch_is_the_largest_divisor_the_planner_fits(free_gb, expected):
    """BERT-base at sequence 128 in bf16 under DDP on 8 GPUs, global batch 256: micro batches are the
    divisors of 32. With an H200's memory free the whole 32 fits; with less, the largest divisor whose
    predicted peak fits the free memory less the margin, and a one-line reason; with too little, a
    one-line error naming what to do. (The GPU run confirms the pick with a real step: make bench.)"""
    from bert_recipes.backends.plan import plan_from_config_file
    from bert_recipes.config import ConfigError
    from bert_recipes.memory import MARGIN_BYTES, MARGIN_SHARE, auto_micro_batch, predict_run
    from bert_recipes.models import model_config
    cfg = load_config(REPO / "recipes/bert-base-mlm-phase1.yaml", ["train.mixed_precision=bf16"])
    config = model_config(cfg.model, cfg.task, 30522, 0)
    plan = plan_from_config_file(REPO / "accelerate_configs/8gpu.yaml")
    total = 141 * 2 ** 30
    if expected == "error":
        with pytest.raises(ConfigError, match="even a micro batch of 1 is predicted to need"):
            auto_micro_batch(cfg, config, plan, 8, int(free_gb * 2 ** 30), total)
        return
    micro, note = auto_micro_batch(cfg, config, plan, 8, int(free_gb * 2 ** 30), total)
    budget = free_gb * 2 ** 30 - MARGIN_SHARE * total - MARGIN_BYTES
    assert 32 % micro == 0 and note.startswith(f"[config] train.micro_batch_size=auto -> {micro}:")

    def peak(m):
        cfg.train.micro_batch_size = m
        return predict_run(cfg, config, plan, 8, "cuda", 32 // m).peak
    assert peak(micro) <= budget
    if expected is not None:
        assert micro == expected
    else:   # the next larger divisor would not fit
        assert micro < 32 and peak(next(d for d in (1, 2, 4, 8, 16, 32) if d > micro)) > budget


# ----------------------------------------------------------------------------- kernels, compile, workers
@pytest.fixture
def kernel_flags():
    """torch's global kernel switches, restored after the test."""
    saved = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.enable_cudnn_sdp(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


@pytest.mark.parametrize("on_gpu, padded, cudnn_after, said", [
    (True, True, False, True),     # masked batches on a GPU: memory-efficient SDPA, never cuDNN's per-shape graphs
    (True, False, True, False),    # packed MLM (no mask): torch's choice
    (False, True, True, False),    # a CPU run: nothing is set
])
def test_masked_batches_on_a_gpu_never_take_cudnn_attention(kernel_flags, on_gpu, padded, cudnn_after, said):
    from bert_recipes.backends.accelerator import set_kernels
    torch.backends.cuda.enable_cudnn_sdp(True)
    line = set_kernels(LaunchPlan(on_gpu=on_gpu, padded=padded, tf32=True))
    assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_after
    assert (line is not None and "memory-efficient" in line) is said


@pytest.mark.parametrize("overrides, dynamic, mode", [
    (["train.compile=true"], False, "default"),                                      # packed MLM, K slots
    (["train.compile=true", "train.compile_mode=reduce-overhead", "train.micro_batch_size=64"], False,
     "reduce-overhead"),   # accumulation 1: with more, CUDA graphs are refused (tests/test_gpu_settings.py)
    (["train.compile=true", "data.max_predictions_per_seq=null"], None, "default"),  # the boolean head: dynamic
    (["train.compile=true", "train.compile_backend=eager", "train.compile_mode=reduce-overhead"], False, "default"),
])
def test_compile_is_static_where_the_shapes_repeat(overrides, dynamic, mode):
    """train.compile through Accelerate's TorchDynamoPlugin: dynamic=False where the batches take a fixed set
    of shapes, torch's automatic dynamic shapes otherwise; a mode for inductor only."""
    from bert_recipes.backends.accelerator import dynamo_plugin
    from bert_recipes.backends.consistency import resolve_run
    cfg = load_config(RECIPE, overrides)
    if cfg.data.max_predictions_per_seq == "auto":
        cfg.data.max_predictions_per_seq = 19
    plugin = dynamo_plugin(cfg.train, resolve_run(cfg, LaunchPlan(on_gpu=False), 1))
    assert (plugin.dynamic, plugin.mode) == (dynamic, mode)
    classify = load_config(REPO / "recipes/tiny-classify.yaml", ["train.compile=true"])
    for bins, expected in ((0, None), (8, False)):
        classify.data.length_bins = bins
        assert dynamo_plugin(classify.train, resolve_run(classify, LaunchPlan(on_gpu=False), 1)).dynamic is expected
    assert dynamo_plugin(load_config(RECIPE).train, LaunchPlan()) is None


@pytest.mark.parametrize("on_gpu, cores, ranks, workers, bins", [
    (False, 16, 1, 0, 0),    # CPU processes: the step's threads need the cores
    (True, 16, 1, 4, 8),     # one GPU, 16 cores: at most 4
    (True, 16, 8, 1, 8),     # 8 GPUs on 16 cores: 2 a rank, one kept for training
    (True, 8, 8, 0, 8),      # a core a rank: none to spare
])
def test_auto_workers_and_bins_follow_the_device_and_the_cores(monkeypatch, on_gpu, cores, ranks, workers, bins):
    from bert_recipes.preflight import choose_loader
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    cfg = load_config(REPO / "recipes/tiny-classify.yaml")
    notes = choose_loader(cfg.data, cfg.task, LaunchPlan(on_gpu=on_gpu), {"LOCAL_WORLD_SIZE": str(ranks)})
    assert (cfg.data.num_workers, cfg.data.length_bins) == (workers, bins)
    assert bool(notes) is on_gpu and all(note.startswith("[config] data.") for note in notes)
    cfg = load_config(REPO / "recipes/tiny-classify.yaml", ["data.num_workers=3", "data.length_bins=2"])
    assert choose_loader(cfg.data, cfg.task, LaunchPlan(on_gpu=on_gpu), {}) == [] and (cfg.data.num_workers, cfg.data.length_bins) == (3, 2)
