"""train.py's command line, read before torch loads, and how a config error is told.

Importing torch and transformers takes about 5 s a process; the recipe, its overrides and their ranges
need neither. So `python train.py` (and every rank under a launcher) parses and validates its command
line first: a typo is one line and exit code 2 in well under a second, and `--print-config` prints at
once. What needs the launch plan, the data or the devices is checked later (bert_recipes/preflight.py).

A finished command exits without the interpreter's teardown (quick_exit): with torch and transformers loaded,
freeing every module's objects takes about 1.2 s a process, for nothing.

A config error is told once: by rank 0, and by the first rank of every other node (prefixed), so that
a mistake only one node sees (a node-local path) is not lost. Standard library and PyYAML only.
"""
from __future__ import annotations

import atexit
import os
import sys
import time

from .config import ConfigError, parse_train_args, to_yaml, validate

EXIT_CONFIG = 2
LINE_GRACE_S = 10   # how long a silent rank waits after a config error before it exits


def say_config_error(error: Exception) -> int:
    """Print `config error: <error>` on the ranks that speak; -> the exit code (2)."""
    rank = int(os.environ.get("RANK", "0"))
    speaks = rank == 0 or os.environ.get("LOCAL_RANK") == "0"
    if not speaks and os.environ.get("WORLD_SIZE", "1") != "1":
        # The same mistake is usually seen by every rank: leave rank 0 time to say it before this
        # rank's exit makes the launcher stop it (seen in CI: the line was lost that way).
        time.sleep(LINE_GRACE_S)
    if speaks:
        prefix = "" if rank == 0 else f"[rank {rank}] "
        print(f"{prefix}config error: {error}", file=sys.stderr)
    return EXIT_CONFIG


def check_command_line(argv: list[str]) -> None:
    """Parse and validate train.py's command line: a ConfigError is its line and exit 2; --print-config
    prints the resolved config and exits 0; anything else returns (and train.py goes on)."""
    try:
        cfg, print_only = parse_train_args(argv)
        validate(cfg)
    except ConfigError as e:
        sys.exit(say_config_error(e))
    if print_only:
        print(to_yaml(cfg), end="")
        sys.exit(0)


def quick_exit(code: int | None) -> None:
    """Exit now with `code`: the exit handlers run (atexit: loggers, temporary directories), the standard
    streams are flushed, and the interpreter's teardown is skipped (about 1.2 s once transformers is
    imported). Every file this repository writes is closed by then (written whole, then renamed)."""
    if not isinstance(code, (int, type(None))):   # sys.exit's other meaning: a message, exit code 1
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_train(argv: list[str] | None, main) -> int:
    """train.py's command line around `main(cfg) -> metrics`, and its exit codes: 0 done (or halted at
    train.halt_at_step), 2 a config or input error, 3 diverged (train.max_bad_steps), 4 a collective timed out or a
    rank was lost, 5 a disk full, 128 + signal when preempted (143 SIGTERM, 138 SIGUSR1, 130 SIGINT: Ctrl-C, also
    before the loop). Messages for 2-4 come once, from rank 0 (4: from the rank that saw it), without a traceback."""
    from .config import Config, first_line
    from .guard import (EXIT_DISK_FULL, EXIT_DIVERGED, EXIT_TIMEOUT, INTERRUPTION, DiskFull, Diverged,
                        is_collective_timeout)
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
        return interrupted(rank, cfg)
    except (RuntimeError, TimeoutError) as e:
        if INTERRUPTION.received:   # a peer left on the same Ctrl-C: gloo's error is the interruption's
            return interrupted(rank, cfg)
        if not is_collective_timeout(e):
            raise
        print(f"[rank {rank}] a collective gave up: {first_line(e)}. A rank is stuck or was lost: every collective "
              f"waits at most train.collective_timeout_s={cfg.train.collective_timeout_s:g}s (data preparation at most "
              f"data.prepare_timeout_s={cfg.data.prepare_timeout_s:g}s). Check the other ranks' logs and their nodes; "
              "continue with --resume auto", file=sys.stderr)
        return EXIT_TIMEOUT


def interrupted(rank: int, cfg) -> int:
    """A Ctrl-C outside the loop: one line, from rank 0 (guard.Interruption), and exit code 130 on every rank.
    What was being written is a .partial or a library's temporary file, so the same command runs again."""
    from .guard import EXIT_INTERRUPTED, INTERRUPTION
    if rank == 0:
        # on a line of its own: a progress bar the Ctrl-C cut off has not ended its line
        print("\n" + INTERRUPTION.line(cfg.run.output_dir, cfg.checkpoint.resume), file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
