"""train.py's exit codes and the one line each comes with: the one list. bert_recipes/exits.py ends a run with these
codes, bert_recipes/launch.py (the Make targets' wrapper) keeps a rank's code and drops torch's launcher report when
a rank has said one of these lines, and docs/cluster.md's table lists them (tests/test_first_hour.py compares).
Data only: launch.py starts in a few milliseconds, without torch.
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class ExitCode:
    """One way a run ends: its code(s), how the one line a rank prints for it starts (`[rank N]` stands for any
    rank; empty: the run printed its own summary), and what it means, as docs/cluster.md's table says it."""
    codes: tuple[int, ...]
    starts: tuple[str, ...]
    meaning: str


# the signals a run stops on (signals.Preemption, exits.interrupted): SIGTERM and SIGUSR1 from a scheduler, SIGINT a
# Ctrl-C, SIGHUP and SIGQUIT a terminal's; each exits with 128 + its number, as a shell reports it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

DONE = ExitCode((0,), (), "finished, or stopped at `train.halt_at_step` after saving")
CONFIG = ExitCode((2,), ("config error:",), "a config or input error: one `config error:` line from rank 0, nothing "
                  "written")
DIVERGED = ExitCode((3,), ("[diverged]",), "diverged: `train.max_bad_steps` non-finite steps in a row")
TIMEOUT = ExitCode((4,), ("[rank N] a collective gave up",), "a collective timed out (a stuck rank, a lost node) or "
                   "a peer vanished")
DISK_FULL = ExitCode((5,), ("[disk full]",), "a disk filled while the run wrote")
STOPPED = ExitCode(tuple(128 + int(s) for s in STOP_SIGNALS), ("[preempt]", "interrupted at"),
                   "stopped by a signal (128 + its number): preempted, or a Ctrl-C outside the loop")

EXIT_CODES = (DONE, CONFIG, DIVERGED, TIMEOUT, DISK_FULL, STOPPED)


def _pattern(start: str) -> str:
    return re.escape(start).replace(re.escape("[rank N]"), r"\[rank \d+\]")


# A rank's own codes and lines, for the launcher wrapper: a line counts at its start or after a launcher's
# `[rank N]:` prefix
RANK_CODES = {code for way in EXIT_CODES if way.starts for code in way.codes}
RANK_LINE = re.compile(r"(^|\] )(" + "|".join(_pattern(s) for way in EXIT_CODES for s in way.starts) + ")")
