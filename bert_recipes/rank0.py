"""Rank 0 first: it builds, downloads and tokenizes, the other ranks then read its cache or receive its
result; an error of rank 0 is raised on every rank, so nobody is left waiting in a barrier."""
from __future__ import annotations

import contextlib

from .config import ConfigError


@contextlib.contextmanager
def main_first(is_main: bool, barrier, broadcast=lambda obj: obj):
    """Rank 0 runs the block first (build, download, tokenize); the others then read its cache. If
    rank 0 fails, every rank raises its error: nobody is left waiting in the barrier."""
    if not is_main:
        barrier()
        raise_shared(broadcast(None))
    try:
        yield
    except Exception as err:
        if is_main:
            barrier()
            broadcast(shared_error(err))
        raise
    if is_main:
        barrier()
        broadcast(None)


def shared_error(err: BaseException) -> tuple[str, str]:
    """An error of rank 0 as the other ranks will raise it: (config | disk full | other, its message)."""
    from .guard import DiskFull
    if isinstance(err, ConfigError):
        return "config", str(err)
    return ("disk full", "") if isinstance(err, DiskFull) else ("other", f"{type(err).__name__}: {err}")


def raise_shared(error: tuple[str, str] | None) -> None:
    """A config error is said again by the first rank of every other node (cli.say_config_error); a full disk
    only by rank 0, which saw it."""
    if error is not None:
        kind, message = error
        if kind == "config":
            raise ConfigError(message)
        if kind == "disk full":
            from .guard import DiskFull
            raise DiskFull("")
        raise RuntimeError(f"rank 0 failed: {message}")


def on_rank0(is_main: bool, broadcast, compute):
    """compute() on rank 0 and its result on every rank; an error of rank 0 is raised on every rank."""
    result, error = None, None
    if is_main:
        try:
            result = compute()
        except Exception as err:
            error = shared_error(err)
            broadcast((None, error))
            raise
    result, error = broadcast((result, error))
    raise_shared(error)
    return result
