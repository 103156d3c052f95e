"""The Accelerator a resolved plan asks for, the GPU kernels it sets, and what really engaged: the
optimizer that steps, the backend described. The backend
itself (DDP, DeepSpeed, FSDP) comes from the launch config; each one's own rules are in
backends/deepspeed.py and backends/fsdp.py."""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from ..config import ConfigError, OptimConfig, TrainConfig
from . import deepspeed as ds_rules
from . import fsdp as fsdp_rules
from .plan import LaunchPlan


def set_kernels(plan: LaunchPlan) -> str | None:
    """The GPU kernels the run's plan calls for, set once before the model runs (nothing on CPUs):
    - fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer; a no-op before), as
      NVIDIA's recipes train; MFU then divides by the TF32 peak (bert_recipes.throughput.gpu_peak);
    - padded batches (an attention mask) never take cuDNN's attention: on Hopper torch may pick it for
      a masked batch, and it builds an execution graph for every new shape, tens of milliseconds on
      the host (the fine-tuning spikes of 185-250 ms every 3-5 steps measured on an H200, 2026-11-30).
      They take the memory-efficient kernel, which takes the mask and dropout as inputs and needs no
      per-shape setup; flash attention takes no mask. Unpadded batches (packed MLM, no mask) keep
      torch's choice: flash, or cuDNN, whose one graph is then built once.
    -> a line saying which attention kernels a masked batch may take, or None."""
    if not plan.on_gpu:
        return None
    torch.backends.cuda.matmul.allow_tf32 = plan.tf32
    torch.backends.cudnn.allow_tf32 = plan.tf32
    if not plan.padded:
        return None
    torch.backends.cuda.enable_cudnn_sdp(False)
    return ("[attention] padded batches: scaled_dot_product_attention's memory-efficient kernel (it takes the mask "
            "and dropout; cuDNN's attention, off for this run, would build a graph for every new shape)")


def build_accelerator(plan: LaunchPlan, output_dir: Path, *, train: TrainConfig, optim: OptimConfig,
                      pin_memory: bool):
    """The Accelerator, with the settings the recipe owns (precision, accumulation), from a
    plan resolve_run has filled in (recipe and launch files already compared there). The backend
    itself (DDP, DeepSpeed, FSDP) comes from the launch config. optim: a DeepSpeed JSON's clipping
    "auto"; pin_memory: data.pin_memory, whether batches are copied without a host wait."""
    from accelerate import Accelerator
    from accelerate.utils import (DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs,
                                  ProjectConfiguration)

    if plan.accum is None:
        raise RuntimeError("build_accelerator needs a resolved plan: call backends.consistency.resolve_run first")
    world_size, on_gpu = plan.world, plan.on_gpu
    # Every collective gives up after train.collective_timeout_s (a stuck rank, a lost node). On CPU
    # the backend must be named: otherwise Accelerate leaves it unset for DeepSpeed and sees 1 process.
    handlers = [] if world_size == 1 else [InitProcessGroupKwargs(
        backend=None if on_gpu else "gloo", timeout=timedelta(seconds=train.collective_timeout_s))]
    if plan.deepspeed:
        ds_rules.ask_cpuinfo_once()
        ds_rules.ask_numa_once()
    if plan.ds_accelerator:
        # Accelerate imports DeepSpeed on every backend, whose accelerator search ends at the CPU on a host without
        # GPUs and says so on each rank ("[WARNING] ... Setting accelerator to CPU. If you have GPU ..."): named,
        # the same choice is silent (the plan names it only where no CUDA GPU is visible: plan.launch_plan_here)
        os.environ.setdefault("DS_ACCELERATOR", plan.ds_accelerator)
    accelerator = Accelerator(
        mixed_precision=plan.precision,
        # Every optimizer step takes exactly `accum` micro batches (train.py's loop), so the
        # gradients sync on the count alone, never on an epoch's end.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=plan.accum, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,   # train.py's step advances the schedule once per optimizer step
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        # non_blocking: pinned batches are copied to the GPU without making the host wait
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=pin_memory),
        kwargs_handlers=handlers,
        dynamo_plugin=dynamo_plugin(train, plan),   # train.compile: Accelerate compiles in prepare
    )
    check_engaged(accelerator, plan)
    accelerator.register_save_state_pre_hook(drop_tied_weights)
    ds_rules.fill_deepspeed_autos(accelerator, optim)
    accelerator.swap_dirs = ds_rules.private_swap_dirs(accelerator, output_dir)
    # a GPU launch config on a machine without GPUs and without ACCELERATE_USE_CPU=1: the launcher starts N processes
    # and Accelerate runs each alone (DistributedType.NO), N unsynchronised copies of one run
    alone = world_size > 1 and str(accelerator.distributed_type).endswith(".NO")
    if accelerator.num_processes != world_size or alone:
        raise ConfigError(f"the launcher started {world_size} processes but Accelerate runs "
                           f"{accelerator.num_processes} as distributed_type={accelerator.distributed_type}"
                           f"{', each alone' if alone else ''}; on CPUs launch with ACCELERATE_USE_CPU=1 (the Make "
                           "targets do), see docs/backends.md 'Launching on CPU'")
    return accelerator


def drop_tied_weights(models: list, weights: list[dict], output_dir: str) -> None:
    """save_state's pre-hook: each model's tied weights (transformers' _tied_weights_keys, BERT's MLM decoder =
    the word embeddings) leave the state dict it is handed when they share their source's storage. Accelerate's
    safetensors writer drops exactly these itself (the later name of a shared storage, utils/other.py
    clean_state_dict_for_safetensors) but warns "Removed shared tensor {'cls.predictions.decoder.weight'} while
    saving" each time; the load (safetensors' load_model) ties them back, so the checkpoint is the same file."""
    from accelerate.utils.other import id_tensor_storage
    for model, state in zip(models, weights):
        inner = getattr(model, "module", model)
        inner = getattr(inner, "_orig_mod", inner)   # train.compile's wrapper
        tied = getattr(inner, "_tied_weights_keys", None) or {}
        owners: dict = {}
        for name, tensor in list(state.items()):
            if not hasattr(tensor, "untyped_storage"):
                continue
            storage = id_tensor_storage(tensor)
            bare = name.removeprefix("module.").removeprefix("_orig_mod.")
            if storage in owners and bare in tied:
                del state[name]
            owners.setdefault(storage, name)


def check_engaged(accelerator, plan: LaunchPlan) -> None:
    """Stop if the launcher asked for a backend that Accelerate silently replaced."""
    from accelerate.utils import DistributedType
    got = accelerator.distributed_type
    for asked, wanted, message in ((plan.deepspeed, DistributedType.DEEPSPEED, ds_rules.REPLACED),
                                   (plan.fsdp, DistributedType.FSDP, fsdp_rules.REPLACED)):
        if asked and got != wanted:
            raise ConfigError(message.format(got=got))


def dynamo_plugin(train, plan: LaunchPlan):
    """train.compile as Accelerate's TorchDynamoPlugin (Accelerate refuses a plugin together with
    dynamo_backend): train.compile_backend and compile_mode (a mode for inductor only: dynamo's debugging
    backends take none), dynamic=False when the batches repeat a fixed set of shapes (plan.repeating_shapes:
    one graph per shape, no symbolic sizes), else torch's automatic dynamic shapes. None: no compile."""
    if not train.compile:
        return None
    from accelerate.utils import TorchDynamoPlugin
    inductor = train.compile_backend == "inductor"
    return TorchDynamoPlugin(backend=train.compile_backend, mode=train.compile_mode if inductor else "default",
                             dynamic=False if plan.repeating_shapes else None)


def optimizer_in_effect(optimizer) -> str:
    """The optimizer that really steps, under Accelerate's and ZeRO's wrappers: its class, and the
    variant (decoupled weight decay, fused / foreach kernel)."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None and chain[-1].optimizer is not chain[-1]:
        chain.append(chain[-1].optimizer)
    inner, group = chain[-1], chain[-1].param_groups[0]
    facts = [f"adamw_mode={inner.adam_w_mode}"] if hasattr(inner, "adam_w_mode") else []
    facts += [f"{k}={group[k]}" for k in ("fused", "foreach") if group.get(k)]
    facts += [f"lr {group.get('initial_lr', group['lr']):g}", f"betas {tuple(group['betas'])}" if "betas" in group else "",
              f"eps {group['eps']:g}" if "eps" in group else ""]
    wrappers = " in ".join(type(o).__name__ for o in reversed(chain[1:-1] if len(chain) > 2 else []))
    return (f"[optim] stepping: {type(inner).__name__} ({', '.join(f for f in facts if f)})"
            + (f" inside {wrappers}" if wrappers else ""))


def _local_numel(p) -> int:
    """The parameter elements this rank holds: a ZeRO-3 partition, an FSDP2 shard, or the whole tensor."""
    for numel in (ds_rules.zero3_partition_numel(p), fsdp_rules.dtensor_numel(p)):
        if numel is not None:
            return numel
    return p.numel()


def bare_model(accelerator, model):
    """The model under every wrapper (DDP, DeepSpeed's engine, Accelerate's fp32 wrapper) and under
    train.compile's OptimizedModule too: Accelerate 1.15's unwrap_model keeps the compiled wrapper by default,
    whose state_dict names every tensor `_orig_mod.<name>`."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def describe(accelerator, model, full_param_numel: int) -> dict:
    """What really runs: backend, ZeRO stage and offload, and whether parameters are sharded
    (a rank holding fewer parameter elements than the full model's `full_param_numel`)."""
    from accelerate.utils import DistributedType
    unwrapped = bare_model(accelerator, model)
    local = sum(_local_numel(p) for p in unwrapped.parameters())
    info = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision, "local_param_numel": local,
            "full_param_numel": full_param_numel, "params_sharded": local < full_param_numel}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        info.update(ds_rules.describe_deepspeed(model, unwrapped))
    if accelerator.distributed_type == DistributedType.FSDP:
        info.update(fsdp_rules.describe_fsdp(accelerator))
    info["cpu_affinity"] = cpu_affinity(accelerator.device.type == "cuda")
    plugin = accelerator.state.dynamo_plugin   # train.compile (dynamo_plugin)
    if plugin is not None and plugin.backend.value != "NO":
        info["compile"] = {"backend": plugin.backend.value.lower(), "mode": plugin.mode, "dynamic": plugin.dynamic}
    return info


def cpu_affinity(on_gpu: bool) -> str:
    """Whether this rank was bound to its GPU's NUMA node: accelerate does it when the process starts with
    ACCELERATE_CPU_AFFINITY=1 (the Makefile's GPU targets and slurm/launch.sh set it, tools/affinity.sh),
    and only where CUDA is available."""
    if os.environ.get("ACCELERATE_CPU_AFFINITY") != "1":
        return "off"
    if not on_gpu:
        return "asked, nothing to bind (no GPU)"
    return f"on ({len(os.sched_getaffinity(0))} cores of {os.cpu_count()})"
