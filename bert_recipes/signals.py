"""The signals that stop a run on purpose, and every rank's agreement on them.

- Preemption: SIGTERM (what SLURM and Kubernetes send, and what `accelerate launch` / `torchrun`
  forward to their workers) or SIGUSR1 (SLURM's `--signal=USR1@120`); in the loop a Ctrl-C (SIGINT) too.
  The handler only records the signal; the ranks agree on it over a small gloo group without waiting each
  step (StopAgreement: every rank learns of it one or two steps later, at the same step), save a checkpoint
  there, and the process exits with 128 + the signal number (exits.py): 143 after SIGTERM, 138 after SIGUSR1,
  130 after SIGINT. A second signal is ignored: the save is atomic either way (bert_recipes/checkpoint.py).
- A Ctrl-C outside the loop (Interruption): one line saying where the run was, exit code 130.
"""
from __future__ import annotations

import signal
import threading

import torch

# In the loop a Ctrl-C is a stop signal like a preemption's: finish the step, save, exit 130 (train.finish)
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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
