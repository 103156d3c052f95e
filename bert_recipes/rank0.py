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


def shared_error(err: BaseException) -> tuple[bool, str]:
    """An error of rank 0 as the other ranks will raise it: (was it a ConfigError, its message)."""
    return isinstance(err, ConfigError), str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"


def raise_shared(error: tuple[bool, str] | None) -> None:
    if error is not None:
        is_config, message = error
        raise ConfigError(message) if is_config else RuntimeError(f"rank 0 failed: {message}")


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
