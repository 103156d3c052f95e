"""Non-finite steps: an update whose loss (on any rank) or gradient norm is NaN/Inf is skipped on the device
(fused AdamW's found_inf; fp16: the loss scaler, which also lowers its scale: optim.skip_update_if). StepGuard
keeps the counts on the device and reads them at log steps: after `train.max_bad_steps` in a row the run stops
with a diagnosis (Diverged, exit code 3: exits.py), at most `logging.log_every` - 1 steps later; no checkpoint is
written while a streak lasts, so the last good one is never overwritten by a diverged state.
"""
from __future__ import annotations

import torch


class Diverged(RuntimeError):
    """train.max_bad_steps non-finite steps in a row; the message is the diagnosis."""


class StepGuard:
    """Counts skipped (non-finite) updates and stops a run that keeps producing them, without reading
    the device each step, nor writing to it from Python: `add` keeps the counts where the skip was
    decided, and `check`, called at log steps and before a checkpoint, reads them. So a streak of
    train.max_bad_steps is noticed at the next log step: up to logging.log_every - 1 steps after it was
    reached (those steps' updates are skipped too, if they are not finite, and no checkpoint is written
    meanwhile).

    A skip decided on the device (a bool tensor: the Accelerate engine's found_inf path) is counted in
    one small float64 tensor on that device, updated by kernels whose Python values (the step, NaN)
    are scalar arguments: nothing is built on the host and copied over, which on a GPU would be a
    pageable copy followed by a stream synchronize. A skip decided on the host (a bool: DeepSpeed's own
    overflow check) is counted on the host; its loss stays the device tensor it is, read at check."""

    # the device counters, one float64 tensor: skipped in the window, streak, and the last good / last bad step
    SKIPPED, STREAK, GOOD_STEP, GOOD_LOSS, BAD_STEP, BAD_LOSS, BAD_NORM, FIRST_BAD = range(8)

    def __init__(self, max_bad_steps: int, skipped_total: int = 0):
        self.max_bad_steps = max_bad_steps
        self.skipped_total = skipped_total   # as of the last check
        self.streak = 0                      # as of the last check
        self.state = None                    # the device counters (skips decided on the device)
        self.host = None                     # the host counters (skips decided on the host)
        self.last_good: tuple[int, float] | None = None   # (step, loss), as of the last check

    def add(self, step: int, loss, grad_norm, skipped, overflow=False) -> None:
        """One step's outcome. skipped: the update was not applied (the same on every rank), a bool
        tensor on the device or a bool the host decided; overflow: an fp16 loss-scale overflow with
        finite losses, which the scaler handles (skipped, but not a divergence: it ends a streak)."""
        if isinstance(skipped, torch.Tensor):
            self._add_on_device(step, loss, grad_norm, skipped, overflow)
        else:
            self._add_on_host(step, loss, grad_norm, bool(skipped), bool(overflow))

    def _add_on_device(self, step: int, loss, grad_norm, skipped: torch.Tensor, overflow) -> None:
        s = self.state
        if s is None:   # a fill on the device, no copy
            s = self.state = torch.zeros(8, dtype=torch.float64, device=skipped.device)
            s[self.FIRST_BAD] = -1
        bad = skipped.to(torch.float64)
        counts = bad if overflow is False else bad * (~overflow).to(torch.float64)   # an overflow ends a streak
        loss = loss.detach().to(torch.float64)
        norm = float("nan") if grad_norm is None else grad_norm.detach().to(torch.float64) \
            if isinstance(grad_norm, torch.Tensor) else float(grad_norm)
        is_bad = bad > 0
        s[self.SKIPPED] += bad
        s[self.STREAK] = (s[self.STREAK] + 1) * counts
        for index, value, when in ((self.GOOD_STEP, step, ~is_bad), (self.GOOD_LOSS, loss, ~is_bad),
                                   (self.BAD_STEP, step, is_bad), (self.BAD_LOSS, loss, is_bad),
                                   (self.BAD_NORM, norm, is_bad)):
            s[index] = torch.where(when, value, s[index])   # a Python value is a kernel argument
        s[self.FIRST_BAD] = torch.where(is_bad & (s[self.FIRST_BAD] < 0), step, s[self.FIRST_BAD])

    def _add_on_host(self, step: int, loss, grad_norm, skipped: bool, overflow: bool) -> None:
        h = self.host = self.host or {"skipped": 0, "streak": 0, "good": None, "bad": None, "first_bad": -1}
        if not skipped:
            h["streak"], h["good"] = 0, (step, loss)
            return
        h["skipped"] += 1
        h["streak"] = 0 if overflow else h["streak"] + 1
        h["bad"] = (step, loss, grad_norm)
        if h["first_bad"] < 0:
            h["first_bad"] = step

    def _read(self) -> tuple | None:
        """The counters as host numbers: (skipped, streak, good step, good loss, bad step, bad loss,
        bad norm, first bad), then cleared for the next window; None before the first step."""
        if self.state is not None:
            values = self.state.tolist()
            self.state[self.SKIPPED], self.state[self.FIRST_BAD] = 0, -1
            return tuple(values)
        h = self.host
        if h is None:
            return None
        good_step, good_loss = h["good"] or (0, float("nan"))
        bad_step, bad_loss, bad_norm = h["bad"] or (0, float("nan"), None)
        values = (h["skipped"], h["streak"], good_step, _number(good_loss), bad_step, _number(bad_loss),
                  _number(bad_norm), h["first_bad"])
        h["skipped"], h["first_bad"], h["good"] = 0, -1, None
        return values

    def check(self, step: int, lr: float) -> str | None:
        """Read the counters (a log or checkpoint step). -> a one-line note when updates were skipped
        since the last check; raises Diverged once max_bad_steps in a row were reached."""
        read = self._read()
        if read is None:
            return None
        skipped, streak, good_step, good_loss, bad_step, bad_loss, bad_norm, first_bad = read
        if good_step > 0:
            self.last_good = (int(good_step), good_loss)
        self.streak, skipped = int(streak), int(skipped)
        self.skipped_total += skipped
        if self.streak >= self.max_bad_steps:
            raise Diverged(self.diagnosis(step, bad_loss, bad_norm, lr))
        if not skipped:
            return None
        steps = f"step {int(bad_step)}" if skipped == 1 else f"steps {int(first_bad)}-{int(bad_step)}"
        return (f"[skip] {skipped} update{'s' * (skipped > 1)} skipped ({steps}; last: loss {bad_loss:.4g}, grad norm "
                f"{_fmt(bad_norm)}): not finite ({self.streak} in a row; the run stops at train.max_bad_steps="
                f"{self.max_bad_steps})")

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


def _number(value) -> float:
    """A host float of a loss or norm (a device tensor is read here, at a log step); NaN for None."""
    return float("nan") if value is None else float(value)
