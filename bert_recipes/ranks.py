"""The rank helpers every part uses, the same under every engine: print on global rank 0, wait for every
rank, rank 0's object on every rank, a sum over ranks. Plain functions over torch.distributed's default
group (the one Accelerate or DeepSpeed started); in a single process each is the identity. The loop's
host-side agreements (stop signals, the data-preparation barrier) use guard.control_group's gloo group."""
from __future__ import annotations

import os


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
