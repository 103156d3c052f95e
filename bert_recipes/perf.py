"""Throughput accounting: BERT FLOPs per token, the device's peak, and the data-loader verdict.

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs counted from the architecture (the
PaLM-paper convention: matmuls only, backward = 2 x forward, recomputation not counted).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# Dense peak FLOP/s per device from the vendors' datasheets (no sparsity): (16-bit tensor cores,
# TF32 tensor cores, plain FP32). Matched as whole words of torch.cuda.get_device_name(), most
# specific first, so "L4" is not "L40S" and an H100 PCIe is not an H100 SXM. Pre-Ampere GPUs have no
# TF32: their middle column is the FP32 figure.
GPU_PEAK_FLOPS = [
    ("H200 NVL", (835e12, 418e12, 60e12)),
    ("H200", (989e12, 494e12, 67e12)),        # SXM
    ("H100 NVL", (835e12, 418e12, 60e12)),
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100", (989e12, 494e12, 67e12)),        # SXM
    ("A100", (312e12, 156e12, 19.5e12)),      # SXM and PCIe alike
    ("A10G", (70e12, 35e12, 31.2e12)),
    ("A10", (125e12, 62.5e12, 31.2e12)),
    ("L40S", (362e12, 183e12, 91.6e12)),
    ("L40", (181e12, 90.5e12, 90.5e12)),
    ("L4", (121e12, 60e12, 30.3e12)),
    ("V100", (125e12, 15.7e12, 15.7e12)),
    ("T4", (65e12, 8.1e12, 8.1e12)),
    ("RTX 4090", (165e12, 82.6e12, 82.6e12)),
    ("RTX 3090", (71e12, 35.6e12, 35.6e12)),
]


def gpu_peak(name: str, mixed_precision: str, tf32: bool) -> tuple[float, str]:
    """(peak FLOP/s, its source) for a GPU name: the 16-bit peak under bf16/fp16, else TF32 or FP32
    as the run's matmuls use (train.tf32)."""
    import re
    for key, (half, tf32_peak, fp32) in GPU_PEAK_FLOPS:
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", name):
            if mixed_precision in ("bf16", "fp16"):
                return half, f"datasheet {key}, 16-bit"
            return (tf32_peak, f"datasheet {key}, TF32") if tf32 else (fp32, f"datasheet {key}, FP32")
    return float("nan"), f"unknown GPU {name!r}: add it to GPU_PEAK_FLOPS"


def flops_per_token(config, seq_len: int, mlm_fraction: float | None) -> float:
    """Training FLOPs per input token of BERT (forward + backward = 3 x forward).

    Per layer and token, forward: 2 x (4h^2 attention projections + 2 h i MLP) plus the attention
    itself, 2 x 2 s h (QK^T and AV). MLM head on the predicted share of tokens: 2 x (h^2 + h V);
    a sequence-classification head is negligible. Embedding lookups are not FLOPs."""
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    per_layer = 2 * (4 * h * h + 2 * h * i) + 4 * seq_len * h
    head = 2 * (h * h + h * vocab) * mlm_fraction if mlm_fraction else 0.0
    return 3.0 * (layers * per_layer + head)


def _cpu_cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bert-recipes"
    return root / "cpu_peak.json"


def measured_cpu_peak(dtype=torch.float32, size: int = 1024, repeats: int = 5) -> float:
    """Best matmul FLOP/s of this CPU with the current thread count, measured once and cached
    (key: processor, threads, dtype)."""
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}"
    cache = _cpu_cache_file()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b   # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    peak = 2 * size ** 3 / best
    known[key] = peak
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    except OSError:
        pass
    return peak


def peak_flops(device: torch.device, mixed_precision: str, tf32: bool = True) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), mixed_precision, tf32)
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    return measured_cpu_peak(dtype), "measured CPU matmul peak"


class DataLoaderWatch:
    """How long each step waits for its batch. When the wait exceeds `threshold` of the step time
    over a window, warn once, with the figures and the remedies in order of cost."""

    REMEDIES = ("raise data.num_workers (DataLoader worker processes per rank)",
                "keep data.pin_memory on (faster host-to-GPU copies)",
                "persistent workers: data.persistent_workers: true, so workers are not re-spawned each epoch",
                "pre-tokenize: the datasets.map cache makes the second run skip tokenization; keep data.num_proc high",
                "pack sequences (data.packing: true) so no compute and no collation is spent on padding")

    def __init__(self, threshold: float = 0.2):
        self.threshold = threshold
        self.warned = False

    def verdict(self, share: float, steps: int, window_s: float) -> tuple[float, str | None]:
        """share: of the window's time spent waiting for batches (all ranks). -> (share, warning
        text the first time it exceeds the threshold, else None)."""
        if share <= self.threshold or self.warned:
            return share, None
        self.warned = True
        lines = [f"[data] WARNING: the data loader is starving the model: {share:.0%} of the last {steps} steps "
                 f"({window_s:.1f}s) was spent waiting for batches (threshold {self.threshold:.0%}). Remedies, "
                 "cheapest first:"]
        lines += [f"         {n}. {r}" for n, r in enumerate(self.REMEDIES, 1)]
        return share, "\n".join(lines)


def start_profiler(output_dir):
    """torch.profiler over optimizer steps 2-4 (wait 1, warmup 1, active 3), TensorBoard trace."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                       on_trace_ready=tensorboard_trace_handler(str(output_dir / "profile")))
    profiler.start()
    return profiler


def profile_table(profiler, output_dir) -> str:
    """The top 10 operators by self time over the profiled steps."""
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=key, row_limit=10)
    return f"[profile] top 10 operators by self time (trace: tensorboard --logdir {output_dir / 'profile'})\n{table}"


def peak_memory_gb(all_sum, rank: int, world: int, device, on_gpu: bool) -> list[float] | None:
    """torch.cuda.max_memory_allocated of every rank, in GB (None on CPU). Collective."""
    if not on_gpu:
        return None
    local = torch.zeros(world, dtype=torch.float64, device=device)
    local[rank] = torch.cuda.max_memory_allocated() / 1e9
    return all_sum(local).tolist()
