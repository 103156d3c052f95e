"""The Make targets' launcher wrapper: `python -m bert_recipes.launch <command ...>`.

When a rank stops on purpose it says why in one line (`config error: ...`, `[diverged] ...`, `a
collective gave up ...`, `[disk full] ...`, `[preempt] ... exiting with code N`) and exits with train.py's code (2, 3,
4, 5, 128 + signal: bert_recipes/exit_codes.py, the one list). torch's elastic launcher, under `accelerate launch` and `torchrun`, then adds its
own report: a `Sending process ... closing signal` warning, a `failed (exitcode: N)` line, a
25-line `ChildFailedError` traceback, and exit code 1. This wrapper runs the command, passes its
output through as it comes, and when the launcher's report follows such a rank line it drops the
report and exits with the rank's code. Anything else (a crash, a launcher failure of its own) is
passed through whole, with the launcher's exit code.

Signals: the command runs in a session of its own, and the wrapper forwards SIGINT, SIGTERM,
SIGHUP, SIGQUIT and SIGUSR1 to it, once each (a terminal's Ctrl-C reaches the wrapper and make,
not the launcher directly, so the launcher is not signalled twice). The launcher passes them on to
the ranks (PET_SIGNALS_TO_HANDLE, exported by the Makefile), which save a checkpoint and exit.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

from .exit_codes import RANK_CODES, RANK_LINE   # train.py's own exit codes and their lines

PREEMPT_CODE = re.compile(r"^\[preempt\] .*exiting with code (\d+)")
# Where the launcher's report starts: torch.distributed.elastic's log lines about stopping workers,
# a failed worker, or a signal it received; and what its report says about the first failure.
# ("Received 15 death signal" or "Received Signals.SIGTERM death signal": the agent logs the signal as it got it; the
# SignalException traceback that follows is part of the report)
REPORT_START = re.compile(r"torch/distributed/elastic/.*\] (Sending process \d+ closing signal|failed \(exitcode: "
                          r"|Received (Signals\.\w+|\d+) death signal)")
DEATH_SIGNAL = re.compile(r"torch/distributed/elastic/.*\] Received (Signals\.\w+|\d+) death signal")
# The launcher stopped by the signal it was passed: on a node whose ranks print nothing (only rank 0 says
# [preempt]) this is the whole story, and the code is the ranks' own (128 + signal).
SIGNAL_EXCEPTION = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
ROOT_CAUSE_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


class Filter:
    """Reads one of the command's streams and writes it on ours, holding back the launcher's report."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rank_said = False         # a rank printed its one-line reason
        self.rank_code = None          # the code a [preempt] line announced
        self.held: list[tuple] = []    # (stream, line) from the start of the launcher's report
        self.holding = False
        self.root_code = None          # exitcode of the report's root cause (its last "exitcode :" line)
        self.signalled = False         # we got a signal to pass on: the launcher's report starts now
        self.signal_code = None        # 128 + the signal the launcher says stopped it

    def line(self, text: str, out) -> None:
        with self.lock:
            plain = text.rstrip("\r\n")
            if RANK_LINE.search(plain):
                self.rank_said = True
                found = PREEMPT_CODE.search(plain)
                if found:
                    self.rank_code = int(found.group(1))
            # a signal starts the launcher's report before any rank has said why (they save first): from the
            # wrapper's own signal, or the agent's line when it was signalled directly. Under srun (proctrack) the
            # launcher gets the signal twice, directly and from us, and its report is a traceback or two.
            if not self.holding and (self.signalled or (self.rank_said or DEATH_SIGNAL.search(plain))
                                     and REPORT_START.search(plain)):
                self.holding = True
            # the launcher reports on stderr; stdout and a rank's own line always go through
            if self.holding and out is not sys.stdout and not RANK_LINE.search(plain):
                found = ROOT_CAUSE_CODE.search(plain)
                if found:
                    self.root_code = int(found.group(1))
                found = SIGNAL_EXCEPTION.search(plain)
                if found and self.signalled:
                    self.signal_code = 128 + int(found.group(1))
                self.held.append((out, text))
                return
            out.write(text)
            out.flush()

    def pump(self, stream, out) -> None:
        """Line by line as the bytes come; a carriage return ends a line too, so a progress bar
        still moves."""
        import codecs
        decode, pending = codecs.getincrementaldecoder("utf-8")(errors="replace").decode, ""
        while chunk := os.read(stream.fileno(), 65536):
            pending += decode(chunk)
            *lines, pending = re.split(r"(?<=[\r\n])", pending)
            for text in lines:
                self.line(text, out)
        if pending + decode(b"", final=True):
            self.line(pending + decode(b"", final=True), out)
        stream.close()

    def exit_code(self, launcher_code: int) -> int:
        """The rank's code when the launcher's report only repeats what a rank already said; else the
        launcher's own, with its report printed."""
        code = self.rank_code if self.rank_code is not None else self.root_code
        if self.rank_said and code in RANK_CODES:
            return code
        if self.rank_said and launcher_code == 0:
            return 0
        if self.signal_code in RANK_CODES:
            return self.signal_code
        for out, text in self.held:
            out.write(text)
            out.flush()
        return launcher_code


def run(command: list[str]) -> int:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    forwarded, filt = set(), Filter()

    def forward(signum, frame):
        filt.signalled = True
        if signum not in forwarded and proc.poll() is None:
            forwarded.add(signum)
            proc.send_signal(signum)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    threads = [threading.Thread(target=filt.pump, args=(stream, out), daemon=True)
               for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for t in threads:
        t.start()
    for t in threads:   # until every writer (the launcher and its ranks) has closed the pipes
        t.join()
    return filt.exit_code(proc.wait())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m bert_recipes.launch <command ...>", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(sys.argv[1:]))
