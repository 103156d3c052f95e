"""Throughput accounting, metrics.json and the loss/eval plot."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch


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
                self.samples += ids.shape[0]
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
    from .perf import utilisation_text
    memory = "" if predicted_peak_gb is None else \
        f" peak mem {row['peak_memory_gb']:.2f} GB (max over ranks; predicted {predicted_peak_gb:.2f})"
    return (f"[train] step {row['step']}/{total_steps} loss {row['loss']:.4f} lr {row['lr']:.3e} "
            f"grad_norm {row['grad_norm']:.3f} | {row['tokens_per_sec']:.0f} tok/s "
            f"({row['padded_tokens_per_sec']:.0f} padded) {row['samples_per_sec']:.1f} samples/s "
            f"{row['step_time_s'] * 1000:.0f} ms/step MFU {row['mfu']:.1%} "
            f"data-wait {row['data_wait_share']:.0%} (worst rank {row['data_wait_worst']:.0%})" + memory
            + utilisation_text(row, warn_share))


def write_metrics(path: Path, final: dict, history: dict, extra: dict) -> None:
    path.write_text(json.dumps({"final": final, "history": history, **extra}, indent=2, default=str))


def plot_curves(path: Path, history: dict, title: str) -> None:
    """Training loss (left) and every eval metric (right) against optimizer steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = history.get("train", []), history.get("eval", [])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    loss_evals = [r for r in evals if "eval_loss" in r]
    if loss_evals:
        ax1.plot([r["step"] for r in loss_evals], [r["eval_loss"] for r in loss_evals], "o-", label="eval loss")
    ax1.set_xlabel("optimizer step"), ax1.set_ylabel("loss"), ax1.legend(), ax1.grid(alpha=0.3)
    keys = sorted({k for r in evals for k, v in r.items()
                   if k not in ("step", "eval_loss", "eval_samples", "perplexity") and isinstance(v, float)
                   and math.isfinite(v)})
    for k in keys:
        ax2.plot([r["step"] for r in evals if k in r], [r[k] for r in evals if k in r], "o-", label=k)
    if keys:
        ax2.legend()
    ax2.set_xlabel("optimizer step"), ax2.set_title("eval metrics"), ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Trackers:
    """logging.trackers (tensorboard, wandb, mlflow) for every engine: Accelerate's own tracker
    classes, opened on global rank 0 only, so they need no Accelerator (the pipeline has none), every
    backend writes the same files and each point is logged once. Where they write:
    - tensorboard: <output_dir>/logs/<run.name>/;
    - mlflow: the server (or store) of MLFLOW_TRACKING_URI, else a local SQLite store,
      <output_dir>/logs/mlflow.db (experiment run.name);
    - wandb: project run.name, its files in <output_dir>/logs/wandb (WANDB_MODE=offline: nothing leaves the
      machine; `wandb sync` uploads them later).
    A resumed run continues the MLflow run and the W&B run id its checkpoint names (`ids`)."""

    def __init__(self, names: list[str], is_main: bool, logging_dir: Path):
        self.names, self.is_main, self.logging_dir, self.open = list(names), is_main, logging_dir, []

    def start(self, run_name: str, config: dict, ids: dict | None = None) -> dict:
        """Open each tracker (rank 0); ids: {tracker: run id} from the checkpoint resumed, continued.
        -> {tracker: run id} now, for the next checkpoints (empty on other ranks and for TensorBoard)."""
        if not self.is_main:
            return {}
        ids, now = dict(ids or {}), {}
        for name in self.names:
            tracker = self._open(name, run_name, ids.get(name))
            tracker.main_process_only = False   # this is rank 0 already: no Accelerator state to ask
            tracker.start()
            if name == "mlflow":
                now[name] = tracker.active_run.info.run_id
                _mlflow_params(tracker, config, resumed=name in ids)
            else:
                tracker.store_init_configuration(config)   # W&B: a resume may change values (allow_val_change)
                if name == "wandb":
                    now[name] = tracker.run.id
            self.open.append(tracker)
        return now

    def _open(self, name: str, run_name: str, run_id: str | None):
        from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker
        if name == "tensorboard":
            return TensorBoardTracker(run_name, str(self.logging_dir))
        if name == "mlflow":
            import mlflow
            if not os.environ.get("MLFLOW_TRACKING_URI"):   # MLflow's local store: SQLite (its ./mlruns is retired)
                self.logging_dir.mkdir(parents=True, exist_ok=True)
                mlflow.set_tracking_uri(f"sqlite:///{(self.logging_dir / 'mlflow.db').resolve()}")
            return MLflowTracker(run_name, logging_dir=str((self.logging_dir / "mlflow-artifacts").resolve()),
                                 run_id=run_id, run_name=run_name)
        (self.logging_dir / "wandb").mkdir(parents=True, exist_ok=True)
        resume = {"id": run_id, "resume": "allow"} if run_id else {}   # a new run: W&B draws its id
        return WandBTracker(run_name, name=run_name, dir=str(self.logging_dir / "wandb"), **resume)

    def log(self, values: dict, step: int) -> None:
        for tracker in self.open:
            tracker.log(values, step=step)

    def finish(self) -> None:
        for tracker in self.open:
            tracker.finish()
        self.open = []


def _mlflow_params(tracker, config: dict, resumed: bool) -> None:
    """The config as MLflow params. A param, once logged, cannot change: a resumed run logs the ones its run
    lacks, and a value the resume changed (train.max_steps, say) as the tag resumed/<key> (the latest)."""
    if not resumed:
        tracker.store_init_configuration(config)
        return
    import mlflow
    logged = mlflow.get_run(tracker.active_run.info.run_id).data.params
    tracker.store_init_configuration({k: v for k, v in config.items() if k not in logged})
    changed = {f"resumed/{k}": str(v) for k, v in config.items() if k in logged and logged[k] != str(v)}
    if changed:
        mlflow.set_tags(changed)
