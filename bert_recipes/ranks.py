"""What the ranks of a job do together, the same under every engine: print on global rank 0, wait for every
rank, rank 0's object on every rank, sums and maxima over ranks, a flag true on every rank where it is true on
any; rank 0 first (it builds, downloads and tokenizes, the others then read its cache), with an error of rank 0
raised on every rank; and a write every rank agrees on (written_by_all), so one rank's failure never leaves the
others in a barrier.

Plain functions over torch.distributed's default group (the one Accelerate or DeepSpeed started), or over the
control group (control_group: gloo, on the host, with its own timeout) for the loop's host-side agreements
(stop signals: signals.StopAgreement) and the data-preparation barrier. In a single process each is the
identity. No torch at import time.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta

from .config import ConfigError, first_line
from .disk import DiskFull

def distributed() -> bool:
    """More than one rank in a started process group."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (the launcher's RANK before the group starts)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def print0(*args) -> None:
    """Print on global rank 0 only (Accelerate's own print is per node)."""
    if rank() == 0:
        print(*args, flush=True)


def barrier() -> None:
    """Every rank waits for every other."""
    if distributed():
        import torch.distributed as dist
        dist.barrier()


def broadcast(obj):
    """Rank 0's `obj` (picklable) on every rank."""
    if not distributed():
        return obj
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_sum(tensor):
    """The sum over ranks of `tensor` (on the group's device: the GPU under NCCL), on every rank; a new tensor."""
    total = tensor.clone()
    if distributed():
        import torch.distributed as dist
        dist.all_reduce(total)
    return total


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
    import torch
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


def on_any_rank(flag):
    """A bool tensor, true on every rank where it is true on any: one all-reduce of one element on
    the batch's device (the default process group), queued like the gradients' own, so the host does
    not wait for it."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    import torch
    votes = flag.to(torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    return votes.bool()


# ---------------------------------------------------------------------------- rank 0 first
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
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    return is_local_main if local < num_processes else None


def shared_error(err: BaseException) -> tuple[str, str]:
    """An error of rank 0 as the other ranks will raise it: (config | disk full | other, its message)."""
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


# ---------------------------------------------------------------------------- a write every rank agrees on
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
