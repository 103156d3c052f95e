"""What stops a run on purpose, and how it tells the caller: the same decision on every rank.

- Preemption: SIGTERM (what SLURM and Kubernetes send, and what `accelerate launch` / `torchrun`
  forward to their workers) or SIGUSR1 (SLURM's `--signal=USR1@120`). The handler only records the
  signal; after each optimizer step the ranks agree (one all-reduce over a small gloo group), so
  every rank stops after the same step, the run saves a checkpoint there, and the process exits with
  128 + the signal number: 143 after SIGTERM, 138 after SIGUSR1. A second signal is ignored: the
  save is atomic either way (bert_recipes/checkpoint.py).
- Non-finite steps: an update whose loss or gradient norm is NaN/Inf is skipped by the engine
  (fp16: by the loss scaler, which also lowers its scale). After `train.max_bad_steps` in a row the
  run stops with a diagnosis and exit code 3; no checkpoint is written while a streak lasts, so the
  last good one is never overwritten by a diverged state.
- A stuck or lost rank: every collective waits at most `train.collective_timeout_s`; the run then
  ends with exit code 4 and a message naming the setting.
- A user mistake (config, data, paths): one `config error:` line from rank 0, exit code 2.
"""
from __future__ import annotations

import signal
import threading
from datetime import timedelta

import torch

from .config import first_line

EXIT_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_TIMEOUT = 4
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def preempted_exit_code(signum: int) -> int:
    return 128 + int(signum)


class Diverged(RuntimeError):
    """train.max_bad_steps non-finite steps in a row; the message is the diagnosis."""


# ---------------------------------------------------------------------------- the control group
def control_group(timeout_s: float):
    """A gloo group over all ranks for the loop's small CPU-side agreements (stop signals) and the
    data-preparation barrier: no GPU sync, and its own timeout. None when not distributed."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def all_max(values: list[float], group) -> list[float]:
    """Element-wise maximum over the ranks of `group` (the values themselves without one)."""
    if group is None:
        return list(values)
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def slow_barrier(group, timeout_s: float, what: str):
    """A barrier for waits that can be long by design (rank 0 downloads or tokenizes while the
    others wait): gloo's monitored barrier with its own timeout, which names the rank that never
    arrived instead of tripping the short collective timeout."""
    def barrier():
        if group is None:
            return
        import torch.distributed as dist
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as err:
            raise TimeoutError(f"{what} took longer than data.prepare_timeout_s={timeout_s:g}s ({first_line(err)}); "
                               "raise data.prepare_timeout_s, or tokenize once ahead of the run") from None
    return barrier


def update_is_finite(loss, grad_norm, group) -> bool:
    """Is this optimizer step safe to apply? Every rank's loss and the (global) gradient norm are
    finite; one small all-reduce makes the answer the same on every rank. Under fp16 the norm is
    taken after the loss scaler unscaled the gradients, so it is not finite exactly when the scaler
    finds an overflow and skips the step itself (tests/test_gpu_paths.py checks this with a real
    GradScaler)."""
    local_bad = not (torch.isfinite(torch.as_tensor(loss)).all() and torch.isfinite(torch.as_tensor(grad_norm)).all())
    return all_max([float(local_bad)], group)[0] == 0


# ---------------------------------------------------------------------------- preemption
class Preemption:
    """Records SIGTERM / SIGUSR1 while installed; `agreed(group)` is the signal any rank got (0 if none)."""

    def __init__(self):
        self.received = 0
        self.previous = {}

    def _handler(self, signum, frame):
        if not self.received:   # the first signal decides; later ones (e.g. during the save) are ignored
            self.received = signum

    def install(self):
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPT_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self, ignore_from_now: bool = False):
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore_from_now else handler)
        self.previous = {}


# ---------------------------------------------------------------------------- non-finite steps
class StepGuard:
    """Counts skipped (non-finite) updates and stops a run that keeps producing them."""

    def __init__(self, max_bad_steps: int, skipped_total: int = 0):
        self.max_bad_steps = max_bad_steps
        self.skipped_total = skipped_total
        self.streak = 0
        self.last_good: tuple[int, float] | None = None   # (step, loss)

    def after_step(self, step: int, applied: bool, bad_loss: bool, overflow: bool, loss: float,
                   grad_norm: float | None, lr: float) -> str | None:
        """applied: the engine updated the weights (the same on every rank); bad_loss: some rank's loss
        was not finite; overflow: an fp16 loss-scale overflow, which the scaler handles (not a
        divergence). -> a one-line note for a bad step; raises Diverged after max_bad_steps in a row."""
        self.skipped_total += not applied
        if overflow or (applied and not bad_loss):
            self.streak = 0
            if applied:
                self.last_good = (step, loss)
            return None
        self.streak += 1
        if self.streak >= self.max_bad_steps:
            raise Diverged(self.diagnosis(step, loss, grad_norm, lr))
        what = "update skipped" if not applied else "applied by DeepSpeed (its check looks at the gradients only)"
        return (f"[skip] step {step}: loss {loss:.4g}, grad norm {_fmt(grad_norm)}: not finite, {what} "
                f"({self.streak} in a row; the run stops at train.max_bad_steps={self.max_bad_steps})")

    def diagnosis(self, step: int, loss: float, grad_norm: float | None, lr: float) -> str:
        last = (f"last finite loss {self.last_good[1]:.4f} at step {self.last_good[0]}" if self.last_good
                else "no finite step since the run (re)started")
        return (f"[diverged] {self.streak} steps in a row had a non-finite loss or gradient norm (train.max_bad_steps="
                f"{self.max_bad_steps}); stopped at step {step}, lr {lr:.3e}, loss {loss:.4g}, grad norm "
                f"{_fmt(grad_norm)}; {last}. Non-finite updates were skipped and no checkpoint was written during "
                "the streak: the latest checkpoint is the last good state. Likely causes, most likely first:\n"
                "  1. the learning rate is too high for this batch size: lower optim.lr or lengthen optim.warmup_steps;\n"
                "  2. extreme or corrupt examples (a regression target of 1e20, a broken label): check the data;\n"
                "  3. fp16 overflow: use bf16 where the hardware has it (train.mixed_precision=bf16);\n"
                "  4. clipping is off (optim.max_grad_norm=0): set it to 1.0.")


def _fmt(value) -> str:
    return "n/a" if value is None else f"{float(value):.4g}"


def is_collective_timeout(err: BaseException) -> bool:
    """A collective that gave up waiting for a peer: gloo's "Timed out waiting ...", NCCL's watchdog
    timeout, a peer's socket closing under gloo, or our own data-preparation barrier."""
    text = str(err)
    return isinstance(err, TimeoutError) or (isinstance(err, RuntimeError) and any(
        marker in text for marker in ("Timed out waiting", "Watchdog caught collective operation timeout",
                                      "Connection closed by peer", "Connection reset by peer")))
