"""Everything FSDP-specific: FSDP runs on GPUs only (accelerate_configs/backends.tsv: on CPU processes
Accelerate would run DDP under its name: REPLACED), FSDP2's DTensor shards and FSDP1's flat
parameters (what a rank holds, the full weights gathered). The recipe's own rule for FSDP (LAMB needs whole
tensors) is in backends/consistency.py with ZeRO's."""
from __future__ import annotations

import contextlib


def is_fsdp1(accelerator) -> bool:
    from accelerate.utils import DistributedType
    return accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version == 1


# An FSDP config that Accelerate ran as something else (on CPU processes: plain DDP; accelerator.check_engaged).
REPLACED = ("the accelerate config asks for FSDP but Accelerate runs {got}: this run would be DDP under the name "
            "FSDP. Refusing. FSDP is a GPU-only row of accelerate_configs/backends.tsv: use a GPU machine, or a "
            "DDP/DeepSpeed config on CPU")


def dtensor_numel(p) -> int | None:
    """FSDP2: the rank's shard of a DTensor parameter; None for any other parameter."""
    return p.to_local().numel() if hasattr(p, "to_local") else None


def describe_fsdp(accelerator) -> dict:
    return {"fsdp_version": accelerator.state.fsdp_plugin.fsdp_version}


@contextlib.contextmanager
def fsdp1_full_weights(accelerator, model):
    """FSDP1's flat parameters summoned whole: {name: full tensor}. Collective."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model, writeback=False):
        yield {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def plain_norm(norm):
    """clip_grad_norm_'s total norm as a plain tensor: FSDP2 returns a DTensor, whose full_tensor() is the
    global norm (the same on every rank); any other backend's norm as it is."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
