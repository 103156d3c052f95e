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
from .exit_codes import CONFIG

EXIT_CONFIG, = CONFIG.codes
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
