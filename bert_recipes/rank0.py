"""Rank 0 first: it builds, downloads and tokenizes, the other ranks then read its cache or receive its
result; an error of rank 0 is raised on every rank, so nobody is left waiting in a barrier."""
from __future__ import annotations

import contextlib

from .config import ConfigError


@contextlib.contextmanager
def main_first(is_main: bool, barrier, broadcast=lambda obj: obj, first_on_node: bool | None = None):
    """Rank 0 runs the block first (build, download, tokenize); the others then read its cache. If
    rank 0 fails, every rank raises its error: nobody is left waiting in the barrier.
    On several nodes (first_on_node not None: see on_nodes) a second round follows, for node-local caches: the first
    rank of each other node runs the block while its node's other ranks wait, then those read their node's cache.
    A shared cache makes that round a cache hit."""
    if not is_main:
        barrier()
        raise_shared(broadcast(None))
        if first_on_node is not None:
            yield from node_round(first_on_node, barrier)
            return
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
        if first_on_node is not None:
            barrier()   # rank 0 already ran the block: the second round's end


def node_round(first_on_node: bool, barrier):
    """The second round: every rank meets the barrier once, each node's first rank after its block (even a failed
    one: its node's other ranks then run the block and meet the error themselves)."""
    if not first_on_node:
        barrier()
    try:
        yield
    finally:
        if first_on_node:
            barrier()


def on_nodes(is_local_main: bool, num_processes: int) -> bool | None:
    """first_on_node for main_first: this rank's local rank is 0, when the job spans several nodes (the launcher's
    LOCAL_WORLD_SIZE is less than the world); None on one node."""
    import os
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    return is_local_main if local < num_processes else None


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
