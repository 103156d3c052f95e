"""How a run ends: each way's exit code and its one line, around train.py's `main(cfg) -> metrics` (run_train,
which train.run_cli wraps), and how a finished process leaves (leave). The codes and the lines' starts are
bert_recipes/exit_codes.py's list:

    0 done (or halted at train.halt_at_step)      3 diverged (divergence.Diverged)
    2 a config or input error (cli.py)            4 a collective timed out, or a rank was lost
    5 a disk full (disk.DiskFull)                 128 + signal: preempted or interrupted (signals.py)

Above cli.py (the command line read before torch loads), signals.py, divergence.py, disk.py and checkpoint.py
(where a Ctrl-C's line finds the checkpoint to continue from), so that none of them imports another back.
"""
from __future__ import annotations

import os
import signal
import sys

from .checkpoint import complete_checkpoints
from .cli import quick_exit, say_config_error
from .config import Config, ConfigError, first_line, parse_train_args, to_yaml, validate
from .disk import DiskFull
from .divergence import Diverged
from .exit_codes import DISK_FULL, DIVERGED, TIMEOUT
from .signals import INTERRUPTION

EXIT_DIVERGED, = DIVERGED.codes
EXIT_TIMEOUT, = TIMEOUT.codes
EXIT_DISK_FULL, = DISK_FULL.codes
EXIT_INTERRUPTED = 128 + signal.SIGINT   # 130, as a shell reports a Ctrl-C (one of STOPPED.codes)


def preempted_exit_code(signum: int) -> int:
    return 128 + int(signum)


def run_train(argv: list[str] | None, main) -> int:
    """train.py's command line around `main(cfg) -> metrics`, and its exit codes: 0 done (or halted at
    train.halt_at_step), 2 a config or input error, 3 diverged (train.max_bad_steps), 4 a collective timed out or a
    rank was lost, 5 a disk full, 128 + signal when preempted (143 SIGTERM, 138 SIGUSR1, 130 SIGINT: Ctrl-C, also
    before the loop). Messages for 2-4 come once, from rank 0 (4: from the rank that saw it), without a traceback."""
    rank, cfg = int(os.environ.get("RANK", "0")), Config()
    INTERRUPTION.install()   # a Ctrl-C outside the loop: one line, exit 130 (in the loop: a stop signal, saved)
    try:
        cfg, print_only = parse_train_args(argv)
        if print_only:
            validate(cfg)
            print(to_yaml(cfg), end="")
            return 0
        return main(cfg).get("exit_code", 0)
    except ConfigError as e:   # once, from rank 0 (and the first rank of every other node)
        return say_config_error(e)
    except Diverged as e:
        if rank == 0:
            print(str(e), file=sys.stderr)
        return EXIT_DIVERGED
    except DiskFull as e:   # once, from the rank whose write ran out of space (the others raise it silent)
        if str(e):
            print(str(e), file=sys.stderr)
        return EXIT_DISK_FULL
    except KeyboardInterrupt:
        return interrupted(rank, cfg.run.output_dir, cfg.checkpoint.resume)
    except (RuntimeError, TimeoutError) as e:
        if INTERRUPTION.received:   # a peer left on the same Ctrl-C: gloo's error is the interruption's
            return interrupted(rank, cfg.run.output_dir, cfg.checkpoint.resume)
        if not is_collective_timeout(e):
            raise
        print(f"[rank {rank}] a collective gave up: {first_line(e)}. A rank is stuck or was lost: every collective "
              f"waits at most train.collective_timeout_s={cfg.train.collective_timeout_s:g}s (data preparation at most "
              f"data.prepare_timeout_s={cfg.data.prepare_timeout_s:g}s). Check the other ranks' logs and their nodes; "
              "continue with --resume auto", file=sys.stderr)
        return EXIT_TIMEOUT


def interrupted(rank: int, output_dir: str | None, resume: str | None) -> int:
    """A Ctrl-C outside the loop: one line, from rank 0 (signals.Interruption), and exit code 130 on every rank.
    What was being written is a .partial or a library's temporary file, so the same command runs again."""
    if rank == 0:
        saved = (complete_checkpoints(output_dir)[-1:] or [None])[0] if output_dir else None
        # on a line of its own: a progress bar the Ctrl-C cut off has not ended its line
        print("\n" + INTERRUPTION.line(saved, resume), file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def halted_line(stop_signal: int, step: int, total_steps: int, saved: bool, output_dir) -> tuple[dict, str]:
    """A run that stopped before its last step, on a stop signal (preempted: exit 128 + signal) or at
    train.halt_at_step (exit 0). -> (what metrics.json records, the [preempt] or [halt] line)."""
    said = "checkpoint saved" if saved else "no checkpoint (the last steps were not finite)"
    halted = {"steps": step, "halted": True}
    if not stop_signal:
        return halted, (f"[halt] stopped at step {step}/{total_steps} as train.halt_at_step asks; {said}, continue "
                        "with --resume auto")
    name = signal.Signals(stop_signal).name
    halted.update(preempted=name, exit_code=preempted_exit_code(stop_signal))
    return halted, (f"[preempt] {name} received: every rank stopped after step {step}/{total_steps}, {said}; exiting "
                    f"with code {halted['exit_code']}; continue" + (f" from {complete_checkpoints(output_dir)[-1]}"
                                                                    if saved else "") + " with --resume auto")


def leave(code: int):
    """Exit a distributed process without tearing gloo down: its worker threads, in
    destroy_process_group as in the interpreter's finalization, can abort a finished run ("terminate
    called without an active exception", SIGABRT; seen in CI, and under ZeRO-3 in tools/memory.py
    --measure). A finished run first waits for every rank. Not distributed: cli.quick_exit (the exit
    handlers run; the interpreter's teardown, about 1.2 s, is skipped)."""
    import torch
    if torch.distributed.is_available() and torch.distributed.is_initialized():
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
