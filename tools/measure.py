"""What a real step holds, counted for the memory planner's tests and tools/memory.py --measure (a tool, not part
of a training run): the
tensors autograd saves for backward (measure_activations, with torch.autograd.graph.saved_tensors_hooks,
parameters and their views excluded) and the model states after a step (measure_states: parameters,
gradients, optimizer states, each storage counted once)."""
from __future__ import annotations

import contextlib

import torch


_VIEWS = {"TBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0", "ExpandBackward0"}


def _parameter_origin(t) -> str | None:
    """'parameter' for a parameter or a view of one (however it is sharded or gathered: FSDP2 and
    ZeRO-3 swap gathered tensors in during forward); 'cast' for autocast's copy of a parameter (a
    temporary, not an activation); None for an activation."""
    if t.is_leaf:
        return "parameter" if t.requires_grad else None
    grad_fn, cast = t.grad_fn, False
    for _ in range(4):
        if grad_fn is None:
            return None
        name = grad_fn.name()
        if "AccumulateGrad" in name:
            return "cast" if cast else "parameter"
        if name == "ToCopyBackward0" and not cast:
            cast = True
        elif name not in _VIEWS:
            return None
        grad_fn = grad_fn.next_functions[0][0]
    return None


def measure_activations(model, batch: dict, autocast_dtype=None) -> dict[str, int]:
    """Bytes autograd saves during one forward: every saved tensor's storage counted once,
    parameters and buffers excluded; autocast's casts of the weights reported apart."""
    device_type = next(model.parameters()).device.type
    skip = set(_storages([*model.parameters(), *model.buffers()]))
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        origin = _parameter_origin(t)
        storage = t.untyped_storage()
        if origin != "parameter" and storage.data_ptr() not in skip and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (storage.nbytes(), origin == "cast")
        return t

    autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())   # a prepared model applies its own autocast
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = model(**batch).loss
    return {"activations": sum(n for n, cast in seen.values() if not cast),
            "weight_casts": sum(n for n, cast in seen.values() if cast), "loss": loss}


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and hasattr(t, "to_local"):   # FSDP2: a DTensor's local shard
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def _flatten(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)


def measure_states(model, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank, from the tensors
    themselves (each storage once). Works on the prepared objects of DDP, FSDP and DeepSpeed:
    ZeRO-3's partitions are `ds_tensor`; ZeRO's gradient partitions and fp32 master partitions
    are attributes of its optimizer; the torch optimizer inside keeps the moments."""
    params = list(model.parameters())
    zero = getattr(model, "optimizer", None) if hasattr(model, "zero_optimization_stage") else None
    inner = getattr(zero, "optimizer", None) or getattr(optimizer, "optimizer", optimizer)
    local = [getattr(p, "ds_tensor", None) if getattr(p, "ds_tensor", None) is not None else p for p in params]
    local += list(_flatten(getattr(zero, "bit16_groups_flat", [])))
    local += list(_flatten(getattr(zero, "fp16_partitioned_groups_flat", [])))
    param_bytes = _storages([*params, *local])
    masters = [p for group in inner.param_groups for p in group["params"]]
    masters += list(_flatten(getattr(zero, "fp32_partitioned_groups_flat", [])))   # ZeRO-3 swaps them in per step
    state = list(_flatten([dict(s) for s in inner.state.values()]))
    optim_bytes = {k: v for k, v in _storages([*masters, *state]).items() if k not in param_bytes}
    grads = [p.grad for p in params] + [p.grad for p in masters]
    for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
        grads += list(_flatten(getattr(zero, name, None)))
    grad_bytes = {k: v for k, v in _storages(grads).items() if k not in param_bytes and k not in optim_bytes}
    return {"parameters": sum(param_bytes.values()), "gradients": sum(grad_bytes.values()),
            "optimizer": sum(optim_bytes.values())}
