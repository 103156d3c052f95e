"""The full fp32 weights of a checkpoint saved by any backend, read with each format's own tool, for a phase that
starts from the weights alone (checkpoint.init_from without init_optimizer) under any backend and process count,
as a start from the run's export would:

| saved by | in the checkpoint | read with |
|---|---|---|
| DDP (Accelerate) | model.safetensors | safetensors |
| FSDP2 (Accelerate, SHARDED_STATE_DICT) | pytorch_model_fsdp_0/ | torch's distributed checkpoint (dcp_to_torch_save) |
| ZeRO-1/2/3, offloaded to CPU | pytorch_model/ | DeepSpeed's zero_to_fp32 (the optimizer's fp32 partitions) |
| ZeRO-3 offloaded to NVMe | the same, where the partitions were not swapped out | else one line: the export |
| the pipeline (ZeRO-1 per stage) | engine/ | DeepSpeed's universal checkpoint (fp32), its layer names mapped back |

Measured 2026-12-07 (tests/test_backends.py, every row): each gives the run's export bit for bit at the step it was
saved; a ZeRO-3 NVMe checkpoint whose optimizer was swapped to the disk is the one line.
No torch or deepspeed at import time."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from ..config import ConfigError


def saved_weights(checkpoint: Path, model, task_kind: str) -> dict:
    """{Hugging Face name: fp32 tensor} of `checkpoint`, keyed as `model` (of the checkpoint's architecture and
    task kind: the pipeline's layer names are mapped back through its cut of it)."""
    checkpoint = Path(checkpoint)
    for reader in READERS:
        weights = reader(checkpoint, model, task_kind)
        if weights is not None:
            return {k.removeprefix("_orig_mod."): v.float() if v.is_floating_point() else v for k, v in weights.items()}
    raise ConfigError(f"checkpoint.init_from: {checkpoint} holds no weights this package can read (none of "
                      "model.safetensors, pytorch_model_fsdp_0/, pytorch_model/, engine/); start from the run's "
                      "export with model.name_or_path=<its run.output_dir>/model")


def accelerate_ddp(checkpoint: Path, model, task_kind: str) -> dict | None:
    path = checkpoint / "model.safetensors"
    if not path.is_file():
        return None
    from safetensors.torch import load_file
    return load_file(str(path))


def fsdp_dcp(checkpoint: Path, model, task_kind: str) -> dict | None:
    shards = checkpoint / "pytorch_model_fsdp_0"
    if not shards.is_dir():
        return None
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(shards), f"{scratch}/weights.pt")
        return torch.load(f"{scratch}/weights.pt", weights_only=True)["model"]   # Accelerate saves {"model": ...}


def deepspeed_zero(checkpoint: Path, model, task_kind: str) -> dict | None:
    if not (checkpoint / "pytorch_model").is_dir():
        return None
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):   # its progress
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    except ValueError as err:   # its partitions' sizes do not add up: the fp32 partitions were swapped to NVMe
        if not (checkpoint / "pytorch_model/offloaded_tensors").is_dir():
            raise
        raise ConfigError(f"checkpoint.init_from: {checkpoint} keeps its fp32 weights in DeepSpeed's NVMe swap files "
                          "(pytorch_model/offloaded_tensors), which DeepSpeed 0.19.8's zero_to_fp32 does not read "
                          f"({str(err)[:80]}); start from the run's export (model.name_or_path=<its run.output_dir>/"
                          "model) or under zero3-nvme on its process count with checkpoint.init_optimizer=true") from None


def deepspeed_pipeline(checkpoint: Path, model, task_kind: str) -> dict | None:
    """The stages' fp32 master weights, from DeepSpeed's universal conversion (made once beside the checkpoint, as
    a resume on another number of replicas makes it; rank 0 has made it: convert_once. DeepSpeed 0.19.8's
    zero_to_fp32 does not read a pipeline's checkpoint)."""
    if not (checkpoint / "engine").is_dir():
        return None
    import torch

    from .deepspeed_universal import universal_checkpoint
    from .pipeline import layer_specs, to_hf_name
    names = layer_specs(model, task_kind)[1]
    weights = {}
    for tensor in sorted((universal_checkpoint(checkpoint, "engine") / "engine/zero").glob("*/fp32.pt")):
        name = to_hf_name(tensor.parent.name, names)
        if name is not None:
            weights[name] = torch.load(tensor, weights_only=False)["param"].detach()
    return weights


READERS = (accelerate_ddp, fsdp_dcp, deepspeed_zero, deepspeed_pipeline)


def convert_once(checkpoint: Path) -> None:
    """What a reader needs made on disk first, by rank 0 (ranks.on_rank0): a pipeline checkpoint's universal
    conversion."""
    if (Path(checkpoint) / "engine").is_dir():
        from .deepspeed_universal import universal_checkpoint
        universal_checkpoint(Path(checkpoint), "engine")


def load_saved_weights(model, checkpoint: Path, task_kind: str) -> None:
    """`model` (built, not yet prepared or cut into stages) takes the checkpoint's weights, every tensor: a name
    the model lacks, or one of the model's that the checkpoint lacks (other than a weight tied to one it has), is
    one line."""
    weights = saved_weights(checkpoint, model, task_kind)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {name for name in missing if is_tied(model, name, weights)}
    if set(missing) - tied or unexpected:
        raise ConfigError(f"checkpoint.init_from: {checkpoint} does not hold this model's weights (missing "
                          f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}); set the model "
                          "and task fields to the checkpoint's (its config.yaml)")


def is_tied(model, name: str, loaded: dict) -> bool:
    """`name` shares its storage with a tensor loaded under another name (the decoder's weight, tied to the word
    embeddings)."""
    state = model.state_dict()
    return any(other in loaded and state[other].data_ptr() == state[name].data_ptr() for other in state if other != name)
