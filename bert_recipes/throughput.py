"""How fast a run goes: what passed through the model in each log window (Throughput: tokens, sequences, padding,
the data wait, per-step times) and the [train] line that shows it; MFU's terms (BERT FLOPs per token, the
device's peak: mfu_terms, the [mfu] line); the data-loader verdict; the ranks' extremes at a log step; peak
memory and the profiler.

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs counted from the architecture (the
PaLM-paper convention: matmuls only, backward = 2 x forward, recomputation not counted).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from .ranks import all_max

# ----------------------------------------------------------------------------- what passed through the model
class Throughput:
    """Counts what passed through the model since the last `read()`, on this rank.

    tokens_real counts non-pad tokens (attention_mask), tokens_padded every position fed to the
    model, so their ratio shows how much compute padding wastes. Counts and losses stay tensors on
    the batch's device until `read()`, so a GPU never waits for the host between log steps.
    `counts_data=False` (a middle or last pipeline stage) times its steps but counts no data, so
    every sequence is counted once. `shapes` collects every batch shape this rank fed the model.
    step_times (logging.step_times): each step's end is marked (a CUDA event on a GPU, recorded on the
    stream without waiting; the host clock on a CPU), and `read()` turns the marks into per-step times:
    on a GPU the device's time from one step's end to the next, which includes the time it sat idle
    waiting for the host."""

    def __init__(self, counts_data: bool = True, step_times: bool = False, on_gpu: bool = False,
                 shapes: set | None = None):
        self.counts_data, self.step_times, self.on_gpu = counts_data, step_times, on_gpu
        self.shapes = shapes if shapes is not None else set()
        self.marks: list = []
        self.last_mark = self._mark() if step_times else None
        self.reset()

    def _mark(self):
        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def reset(self):
        self.t0 = time.perf_counter()
        self.wait_s = 0.0
        self.excluded_s = 0.0
        self.samples = 0
        self.tokens_real = 0
        self.tokens_padded = 0
        self.loss_sum = 0.0
        self.steps = 0
        self.marks = []

    def feed(self, batches: Iterator[dict]) -> Iterator[dict]:
        """Pass micro-batches through, timing the wait for each (the data-loader verdict) and
        counting what it holds."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - t0
            if self.counts_data:
                ids = batch["input_ids"]
                self.shapes.add(tuple(ids.shape))
                self.samples += len(batch["sequence_starts"]) if "sequence_starts" in batch else ids.shape[0]
                self.tokens_padded += ids.numel()
                self.tokens_real = self.tokens_real + (batch["attention_mask"].sum() if "attention_mask" in batch
                                                       else ids.numel())
            yield batch

    def add_step(self, loss):
        """One optimizer step done; `loss` is its mean over micro batches (a tensor or a float)."""
        self.steps += 1
        if self.counts_data:
            self.loss_sum = self.loss_sum + loss
        if self.step_times:   # (start, end): from the previous step's end, or the end of what was set aside
            end = self._mark()
            self.marks.append((self.last_mark, end))
            self.last_mark = end

    def exclude(self, seconds: float):
        """Take time spent outside training (eval, checkpoints) out of the window."""
        self.excluded_s += seconds
        if self.step_times:   # the next step is timed from here
            self.last_mark = self._mark()

    def _step_times_ms(self) -> list[float]:
        if not self.marks:
            return []
        if self.on_gpu:
            self.marks[-1][1].synchronize()
            return [start.elapsed_time(end) for start, end in self.marks]
        return [(end - start) * 1000 for start, end in self.marks]

    def read(self, all_sum: Callable, device) -> dict[str, float]:
        """Sums over ranks (one small all-reduce, `all_sum`), then rates over the window's wall time."""
        elapsed = max(time.perf_counter() - self.t0 - self.excluded_s, 1e-9)
        ranks = 1.0 if self.counts_data else 0.0
        local = torch.tensor([float(self.samples), float(self.tokens_real), float(self.tokens_padded),
                              float(self.loss_sum), ranks * self.steps, self.wait_s * ranks, ranks],
                             dtype=torch.float64, device=device)
        samples, real, padded, loss_sum, steps, wait, ranks = all_sum(local).tolist()
        out = {"loss": loss_sum / max(steps, 1),
               "samples_per_sec": samples / elapsed,
               "tokens_per_sec": real / elapsed,
               "padded_tokens_per_sec": padded / elapsed,
               "step_time_s": elapsed / max(self.steps, 1),
               "data_wait_share": wait / (elapsed * max(ranks, 1)),
               "local_data_wait_share": self.wait_s / elapsed if self.counts_data else 0.0,
               "window_s": elapsed, "window_steps": self.steps, "window_tokens": real}
        if self.step_times:
            out["step_times_ms"] = self._step_times_ms()
        self.reset()
        return out


def train_line(row: dict, total_steps: int, predicted_peak_gb: float | None, warn_share: float) -> str:
    """The [train] line of a log step: loss, lr, grad norm, throughput, MFU, data wait; on GPUs the peak memory
    (max over ranks) beside the planner's prediction, and the GPU sampler's part."""
    memory = "" if predicted_peak_gb is None else \
        f" peak mem {row['peak_memory_gb']:.2f} GB (max over ranks; predicted {predicted_peak_gb:.2f})"
    return (f"[train] step {row['step']}/{total_steps} loss {row['loss']:.4f} lr {row['lr']:.3e} "
            f"grad_norm {row['grad_norm']:.3f} | {row['tokens_per_sec']:.0f} tok/s "
            f"({row['padded_tokens_per_sec']:.0f} padded) {row['samples_per_sec']:.1f} samples/s "
            f"{row['step_time_s'] * 1000:.0f} ms/step MFU {row['mfu']:.1%} "
            f"data-wait {row['data_wait_share']:.0%} (worst rank {row['data_wait_worst']:.0%})" + memory
            + utilisation_text(row, warn_share))


# ----------------------------------------------------------------------------- MFU's terms
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
    """Training FLOPs per input token of the model's architecture (bert_recipes/architectures/<name>.py)."""
    from .architectures import module, of_config
    return module(of_config(config)).flops_per_token(config, seq_len, mlm_fraction)


def _cpu_cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bert-recipes"
    return root / "cpu_peak.json"


def measured_cpu_peak(dtype=torch.float32, size: int = 1024, repeats: int = 5, fresh: bool = False) -> float:
    """Best matmul FLOP/s of this CPU with the current thread count, measured once and cached (key:
    processor, threads, dtype). fresh: measure now whatever the cache holds (make bench, whose MFU is
    against the peak of its own run). The cache keeps the best figure seen: one measured while the
    machine was busy would otherwise stay, and every MFU after it would be too high."""
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}"
    cache = _cpu_cache_file()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known and not fresh:
        return known[key]
    # its own generator: a draw from the global one would shift every dropout mask of the run that measured
    # (a seed must fix the run whatever the cache holds; tests/test_train.py)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(dtype) for _ in range(2))
    a @ b   # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    peak = 2 * size ** 3 / best
    known[key] = max(peak, known.get(key, 0.0))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    except OSError:
        pass
    return peak


def measured_matmul_peak(device: torch.device, dtype=torch.float32) -> float:
    """Best matmul FLOP/s of one device now: the cached CPU figure, or on a GPU 8192^3 matmuls in `dtype`
    (fp32 runs on TF32 tensor cores when torch allows it, as train.tf32 does)."""
    if device.type != "cuda":
        return measured_cpu_peak(dtype)
    n = 8192
    g = torch.Generator(device=device).manual_seed(0)   # not the global stream: see measured_cpu_peak
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=g) for _ in range(2))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        a @ b
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * n ** 3 / best


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

    SHORTEST_WINDOW_S = 1.0   # a shorter window's waits are the loader's first batches and the host's jitter: a
    # 3-step demo run of 11 ms steps once waited 20% of its 0.1 s (fresh-clone suite, 2026-12-07)

    def __init__(self, threshold: float = 0.2):
        self.threshold = threshold
        self.warned = False

    def verdict(self, share: float, steps: int, window_s: float, busy: float | None = None) -> tuple[float, str | None]:
        """share: of the window's time the rank that waited most spent waiting for batches (one slow rank
        holds the others back at the next collective); busy: the least busy GPU's busy share (%), where
        sampled. -> (share, warning text the first time it exceeds the threshold over a window of at least
        SHORTEST_WINDOW_S, else None)."""
        if share <= self.threshold or self.warned or window_s < self.SHORTEST_WINDOW_S:
            return share, None
        self.warned = True
        gpu = f"; the least busy GPU was busy {busy:.0f}% of the time: input-bound" if busy is not None else ""
        lines = [f"[data] WARNING: the data loader is starving the model: {share:.0%} of the last {steps} steps "
                 f"({window_s:.1f}s) was spent waiting for batches on the rank that waited most (threshold "
                 f"{self.threshold:.0%}){gpu}. Remedies, cheapest first:"]
        lines += [f"         {n}. {r}" for n, r in enumerate(self.REMEDIES, 1)]
        return share, "\n".join(lines)


def rank_extremes(local_wait: float, gpu: dict | None, peak_gb: float | None, group) -> dict:
    """At a log step: the worst rank's data wait, the largest allocator peak (peak_gb: this rank's, on GPUs) and,
    where the GPU sampler runs (bert_recipes/doctor/nvml.Sampler), the least busy GPU, the hottest, and whether
    any rank saw a hardware slowdown: one small all-reduce (MAX) on the control group, every rank taking part
    with the same five values."""
    from .doctor.gpu import THROTTLE_FAIL, THROTTLE_WARN
    bad = sum(THROTTLE_FAIL) + sum(THROTTLE_WARN)
    worst_wait, least_busy, hottest, throttled, peak = all_max(
        [local_wait, -gpu["busy_mean"] if gpu else -101.0, gpu["temp_max"] if gpu else 0.0,
         float(gpu["throttle"] & bad) if gpu else 0.0, peak_gb or 0.0], group)
    out = {"data_wait_worst": worst_wait, **({"peak_memory_gb": peak} if peak_gb is not None else {})}
    if gpu:
        names = [text for bit, text in {**THROTTLE_FAIL, **THROTTLE_WARN}.items() if int(throttled) & bit]
        out.update(gpu_busy=gpu["busy_mean"], gpu_busy_min=gpu["busy_min"], gpu_busy_least_rank=-least_busy,
                   gpu_mem_busy=gpu["mem_busy_mean"], gpu_temp_max=hottest, gpu_sm_clock_min=gpu["sm_clock_min"],
                   gpu_throttle=gpu["throttle"], gpu_throttled=", ".join(names))
    return out


def utilisation_text(row: dict, threshold: float) -> str:
    """The log line's part for the GPU sampler: busy share, a verdict, any throttling."""
    if "gpu_busy" not in row:
        return ""
    bound = ("input-bound" if row["data_wait_worst"] > threshold else
             "GPU-bound" if row["gpu_busy_least_rank"] >= 90 else "neither input- nor GPU-bound")
    text = f" GPU busy {row['gpu_busy']:.0f}% (least busy rank {row['gpu_busy_least_rank']:.0f}%, {bound})"
    return text + (f" THROTTLED: {row['gpu_throttled']}" if row["gpu_throttled"] else "")


def start_profiler(output_dir, on_gpu: bool, say=print):
    """torch.profiler over optimizer steps 2-4 (wait 1, warmup 1, active 3), TensorBoard trace. A diagnostic:
    where it cannot start (no CUPTI in a container, say), one line, and the run trains without it."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    try:
        profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                           on_trace_ready=tensorboard_trace_handler(str(output_dir / "profile")))
        profiler.start()
    except Exception as err:   # noqa: BLE001 (whatever the profiler raises: the run is the point)
        say(f"[profile] logging.profile: the profiler did not start ({type(err).__name__}: {str(err)[:120]}); "
            "training goes on without it")
        return None
    return profiler


def profile_table(profiler, output_dir, on_gpu: bool) -> str:
    """The top 10 operators by self time over the profiled steps."""
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    try:
        table = profiler.key_averages().table(sort_by=key, row_limit=10)
    except Exception as err:   # noqa: BLE001
        return f"[profile] no table: {type(err).__name__}: {str(err)[:120]}"
    return f"[profile] top 10 operators by self time (trace: tensorboard --logdir {output_dir / 'profile'})\n{table}"


def peak_memory_gb(all_sum, rank: int, world: int, device, on_gpu: bool) -> list[float] | None:
    """torch.cuda.max_memory_allocated of every rank, in GB (None on CPU). Collective."""
    if not on_gpu:
        return None
    local = torch.zeros(world, dtype=torch.float64, device=device)
    local[rank] = torch.cuda.max_memory_allocated() / 1e9
    return all_sum(local).tolist()


def mfu_terms(model_config, data, model, task_kind: str, train, device, pipeline: bool) -> tuple[float, float, str]:
    """MFU's terms for this run: training FLOPs per token (an MLM head over the masked tokens only when
    model.sparse_mlm_head) and one device's peak. -> (FLOPs per token, peak FLOP/s, the [mfu] line)."""
    from .tasks import TASKS
    mlm_fraction = (data.mlm_probability if model.sparse_mlm_head else 1.0) if TASKS[task_kind].masked_lm else None
    flops_token = flops_per_token(model_config, data.max_seq_length, mlm_fraction)
    peak, peak_source = peak_flops(device, train.mixed_precision, train.tf32)
    return flops_token, peak, (f"[mfu] {flops_token / 1e6:.1f} MFLOP per token (train), peak {peak / 1e12:.2f} "
                               f"TFLOP/s per device ({peak_source}); MFU counts every device"
                               + (", idle pipeline bubbles included" if pipeline else ""))
