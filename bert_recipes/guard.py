"""What stops a run on purpose, and how it tells the caller: the same decision on every rank.

- Preemption: SIGTERM (what SLURM and Kubernetes send, and what `accelerate launch` / `torchrun`
  forward to their workers) or SIGUSR1 (SLURM's `--signal=USR1@120`). The handler only records the
  signal; the ranks agree on it over a small gloo group without waiting each step (StopAgreement:
  every rank learns of it one or two steps later, at the same step), save a checkpoint there, and the
  process exits with 128 + the signal number: 143 after SIGTERM, 138 after SIGUSR1. A second signal is
  ignored: the save is atomic either way (bert_recipes/checkpoint.py).
- Non-finite steps: an update whose loss (on any rank) or gradient norm is NaN/Inf is skipped on the
  device (fused AdamW's found_inf; fp16: the loss scaler, which also lowers its scale). The counts stay
  on the device and are read at log steps (StepGuard): after `train.max_bad_steps` in a row the run
  stops with a diagnosis and exit code 3, at most `logging.log_every` - 1 steps later; no checkpoint is
  written while a streak lasts, so the last good one is never overwritten by a diverged state.
- A stuck or lost rank: every collective waits at most `train.collective_timeout_s`; the run then
  ends with exit code 4 and a message naming the setting.
- A user mistake (config, data, paths): one `config error:` line from rank 0, exit code 2 (bert_recipes/cli.py).
- A full disk (a checkpoint, the export, the data cache, the tokenizer): one `[disk full]` line naming the
  path, the step, the bytes free and an estimate of the bytes needed, exit code 5. What every rank writes
  into (a checkpoint's .partial) is agreed on by every rank after the write (written_by_all), so one rank's
  failure never leaves the others in a barrier; the .partial is removed and the previous checkpoint stays.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from datetime import timedelta
from pathlib import Path

import torch

from .cli import quick_exit
from .config import first_line, nearest_existing

EXIT_DIVERGED = 3
EXIT_TIMEOUT = 4
EXIT_DISK_FULL = 5
EXIT_INTERRUPTED = 128 + signal.SIGINT   # 130, as a shell reports a Ctrl-C
# In the loop a Ctrl-C is a stop signal like a preemption's: finish the step, save, exit 130 (train.finish)
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def preempted_exit_code(signum: int) -> int:
    return 128 + int(signum)


class Diverged(RuntimeError):
    """train.max_bad_steps non-finite steps in a row; the message is the diagnosis."""


class DiskFull(RuntimeError):
    """A write ran out of space; the message is the line to print (empty on a rank that only learnt of it)."""


FULL_ERRNOS = (28, 122)   # ENOSPC, EDQUOT (a quota counts as full)
# the same errors as the Rust writers word them, in exceptions that carry no errno: safetensors' SafetensorError
# ("I/O error: No space left on device (os error 28)"), tokenizers' plain Exception
FULL_WORDS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def disk_full(err: BaseException, path: Path, what: str, step: int, needed: tuple[int, str] | None,
              then: str) -> DiskFull | None:
    """`err`, raised writing `what` into `path`, as a DiskFull with its line when the disk was full, else None.
    An OSError says so (ENOSPC, EDQUOT), and so does the text of the Rust writers' errors (FULL_WORDS);
    torch.save's RuntimeError ("unexpected pos", "file write failed") loses both, so an OSError or a
    RuntimeError counts as full when the filesystem has less free space than was needed
    (`needed`: (bytes, how they were estimated)), or under 1 MiB when that is not known. then: what
    became of the run and what to do, the line's end."""
    import shutil

    path = Path(getattr(err, "filename", None) or path)
    free = shutil.disk_usage(nearest_existing(path)).free
    need, how = needed or (0, "")
    said_full = any((isinstance(e, OSError) and e.errno in FULL_ERRNOS) or any(w in str(e) for w in FULL_WORDS)
                    for e in _causes(err))   # datasets wraps the OSError in its DatasetGenerationError
    if not said_full and not (isinstance(err, (OSError, RuntimeError)) and free < max(need, 1 << 20)):
        return None
    wanted = f"about {_size(need)} needed ({how})" if need else "the bytes needed are not known"
    return DiskFull(f"[disk full] {what} at step {step} could not be written to {path}: {_size(free)} free on its "
                    f"filesystem, {wanted}; {then}")


def fullest(*paths: Path) -> Path:
    """Of the places a block writes to, the one whose filesystem has the least free space."""
    import shutil
    return min(paths, key=lambda p: shutil.disk_usage(nearest_existing(p)).free)


def _causes(err: BaseException | None):
    """`err` and the exceptions it was raised from or during, innermost last."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


@contextlib.contextmanager
def full_disk_is_one_line(what: str, path: Path, step: int, needed, then: str):
    """The block's write error as a DiskFull with its line when the disk was full (disk_full), else as it
    was. For writes one rank makes while the others wait for its result (rank 0's data cache and
    tokenizer: rank0.main_first shares the error). needed: (bytes, how), or a callable giving it."""
    try:
        yield
    except Exception as err:   # noqa: BLE001 - disk_full tells a full disk from the rest, which is raised as it was
        if isinstance(err, DiskFull):
            raise
        full = disk_full(err, path, what, step, needed() if callable(needed) else needed, then)
        if full is None:
            raise
        raise full from None


def _size(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024


def written_by_all(write, group, is_main: bool, undo, full_error) -> None:
    """write() on every rank, then one agreement over the control group (gloo, on the host): did any rank
    fail? A rank whose write failed must not leave the others waiting in the next barrier (the collective
    timeout, minutes later). On a failure rank 0 runs undo() (removes the .partial; every rank has stopped
    writing by then) and every rank raises: DiskFull when the failing rank's disk was full (full_error(err)
    -> DiskFull or None; the lowest such rank says the line, the others raise it silent), else that rank's
    own error, and on the others a RuntimeError naming it."""
    import torch.distributed as dist
    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    error = None
    try:
        write()
    except Exception as err:   # every rank must reach the agreement below, whatever went wrong
        error = err
    full = full_error(error) if error is not None else None
    code = 2 if full else 1 if error is not None else 0
    worst, first_full, first_failed = all_max([code, world - rank if full else 0, world - rank if code else 0], group)
    if not worst:
        return
    if is_main:
        undo()
    if worst == 2:
        raise full if full and world - first_full == rank else DiskFull("")
    if error is not None:
        raise error
    raise RuntimeError(f"rank {world - int(first_failed)} failed to write (see its error above)")


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


def spread(value: float, group) -> tuple[float, float]:
    """(smallest, largest) of a value over the ranks of `group`, in one all-reduce: equal when every rank agrees."""
    high, low = all_max([value, -value], group)
    return -low, high


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


def on_any_rank(flag: torch.Tensor) -> torch.Tensor:
    """A bool tensor, true on every rank where it is true on any: one all-reduce of one element on
    the batch's device (the default process group), queued like the gradients' own, so the host does
    not wait for it."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    votes = flag.to(torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    return votes.bool()


class StopAgreement:
    """Every rank stops after the same step when any rank got a stop signal, without a per-step wait:
    after step k each rank starts a small asynchronous all-reduce (the gloo control group, on the host)
    of what it has received, and after step k + 1 it reads the one started after step k, which has
    long finished by then. So every rank learns of a signal at the same step, one or two steps after
    it arrived (two when it arrives after that step's all-reduce started)."""

    def __init__(self, group):
        self.group = group
        self.pending = None

    def after_step(self, received: int) -> int:
        """-> the signal some rank had received by the previous step (0: none), the same on every rank."""
        if self.group is None:
            return received
        import torch.distributed as dist
        agreed = self.close()
        flags = torch.tensor([received], dtype=torch.int64)
        self.pending = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flags
        return agreed

    def close(self) -> int:
        """Wait for the all-reduce in flight (before the process leaves, or another collective on the
        group that must not overtake it); -> what it agreed on."""
        if self.pending is None:
            return 0
        work, flags = self.pending
        self.pending = None
        work.wait()
        return int(flags[0])


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


# ---------------------------------------------------------------------------- Ctrl-C outside the loop
class Interruption:
    """Where a run is (`at`), for the one line a Ctrl-C outside the loop prints; `install` makes SIGINT raise
    KeyboardInterrupt as Python's default does, and remembers it: a rank then blocked in a collective whose
    peer left on the same Ctrl-C fails with gloo's error, which is this interruption too, not a lost rank."""

    def __init__(self):
        self.stage, self.received, self.hook = "start-up", False, None

    def at(self, stage: str) -> None:
        self.stage = stage

    def _handler(self, signum, frame):
        import sys
        self.received = True
        # The unwinding closes the libraries' generators half-way, and Python reports what their cleanup raised as
        # "Exception ignored in: <generator ...>" with a traceback (datasets 4's split writer: "generator ignored
        # GeneratorExit", seen 2026-12-03): consequences of this Ctrl-C, already said in one line.
        self.hook = self.hook or sys.unraisablehook
        sys.unraisablehook = lambda unraisable: None
        raise KeyboardInterrupt

    def install(self):
        import sys
        self.stage, self.received = "start-up", False   # a new run (tests run several in one process)
        if self.hook is not None:   # the previous run's Ctrl-C silenced the reports: this run's are heard again
            sys.unraisablehook, self.hook = self.hook, None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handler)
        return self

    def line(self, saved, resume: str | None) -> str:
        """What to do next: rerun the same command, or, where the run left a checkpoint (`saved`, the latest;
        the same command would then be refused: another run's checkpoints), continue from it with --resume auto."""
        if saved is not None and resume != "auto":
            return f"interrupted at {self.stage}; {saved} is saved: continue from it with --resume auto"
        return f"interrupted at {self.stage}; rerun the same command"


INTERRUPTION = Interruption()   # one per process: train.main sets its stage, exits.run_train says the line


# ---------------------------------------------------------------------------- non-finite steps
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


def leave(code: int):
    """Exit a distributed process without tearing gloo down: its worker threads, in
    destroy_process_group as in the interpreter's finalization, can abort a finished run ("terminate
    called without an active exception", SIGABRT; seen in CI, and under ZeRO-3 in tools/memory.py
    --measure). A finished run first waits for every rank. Not distributed: cli.quick_exit (the exit
    handlers run; the interpreter's teardown, about 1.2 s, is skipped)."""
    import sys
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        import os
        if code == 0:
            torch.distributed.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    quick_exit(code)


def is_collective_timeout(err: BaseException) -> bool:
    """A collective that gave up waiting for a peer: gloo's "Timed out waiting ...", NCCL's watchdog
    timeout, a peer's socket closing under gloo, or our own data-preparation barrier."""
    text = str(err)
    return isinstance(err, TimeoutError) or (isinstance(err, RuntimeError) and any(
        marker in text for marker in ("Timed out waiting", "Watchdog caught collective operation timeout",
                                      "Connection closed by peer", "Connection reset by peer")))
