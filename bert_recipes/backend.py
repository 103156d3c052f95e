"""The launch side: what the accelerate YAML (and DeepSpeed JSON) asked for, checked against the
recipe before any heavy work, and what actually engaged once Accelerate is up.

`accelerate launch --config_file X.yaml` hands its settings to the script as ACCELERATE_* / FSDP_*
environment variables; this module reads them, plus the DeepSpeed JSON they point at.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import Config, ConfigError


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


@dataclass
class LaunchPlan:
    """What the launcher requested, before Accelerate interprets it."""
    deepspeed: bool = False
    fsdp: bool = False
    cpu: bool = False
    mixed_precision: str | None = None        # accelerate YAML's mixed_precision
    grad_accum_env: str | None = None         # accelerate YAML's deepspeed gradient_accumulation_steps
    grad_clip_env: str | None = None          # accelerate YAML's deepspeed gradient_clipping
    ds_config_path: str | None = None
    ds_config: dict = field(default_factory=dict)

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def pipeline(self) -> bool:
        return "pipeline" in self.ds_config


def read_launch_plan(env=os.environ) -> LaunchPlan:
    plan = LaunchPlan(deepspeed=_true(env.get("ACCELERATE_USE_DEEPSPEED")), fsdp=_true(env.get("ACCELERATE_USE_FSDP")),
                      cpu=_true(env.get("ACCELERATE_USE_CPU")), mixed_precision=env.get("ACCELERATE_MIXED_PRECISION"),
                      grad_accum_env=env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                      grad_clip_env=env.get("ACCELERATE_GRADIENT_CLIPPING"),
                      ds_config_path=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
    if plan.deepspeed and plan.ds_config_path:
        path = Path(plan.ds_config_path)
        if not path.exists():
            raise ConfigError(f"DeepSpeed config not found: {path} (from the accelerate config's deepspeed_config_file)")
        try:
            plan.ds_config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    return plan


def _set(value) -> bool:
    """A value the user pinned (not missing, not 'auto')."""
    return value is not None and value != "auto"


def check_consistency(cfg: Config, plan: LaunchPlan, world_size: int, accum: int, has_cuda: bool) -> None:
    """Compare recipe, accelerate YAML and DeepSpeed JSON; raise one ConfigError naming every conflict
    with both values. The recipe owns the maths: launch files may leave a value unset/"auto" or
    repeat it, but not contradict it."""
    t, o = cfg.train, cfg.optim
    ds, name = plan.ds_config, plan.ds_config_path or "the DeepSpeed config"
    conflicts: list[str] = []

    # precision: accelerate YAML 'no' means "not set here"
    if plan.mixed_precision not in (None, "no", t.mixed_precision):
        conflicts.append(f"precision: recipe train.mixed_precision={t.mixed_precision}, "
                         f"accelerate config mixed_precision={plan.mixed_precision}")
    for mode in ("bf16", "fp16"):
        enabled = ds.get(mode, {}).get("enabled") if isinstance(ds.get(mode), dict) else None
        if _set(enabled) and bool(enabled) != (t.mixed_precision == mode):
            conflicts.append(f"precision: recipe train.mixed_precision={t.mixed_precision}, "
                             f"{name} {mode}.enabled={enabled}")
    # batch arithmetic
    if _set(ds.get("train_micro_batch_size_per_gpu")) and int(ds["train_micro_batch_size_per_gpu"]) != t.micro_batch_size:
        conflicts.append(f"micro batch: recipe train.micro_batch_size={t.micro_batch_size}, "
                         f"{name} train_micro_batch_size_per_gpu={ds['train_micro_batch_size_per_gpu']}")
    if _set(ds.get("train_batch_size")) and int(ds["train_batch_size"]) != t.global_batch_size:
        conflicts.append(f"global batch: recipe train.global_batch_size={t.global_batch_size}, "
                         f"{name} train_batch_size={ds['train_batch_size']}")
    if _set(ds.get("gradient_accumulation_steps")) and int(ds["gradient_accumulation_steps"]) != accum:
        conflicts.append(f"accumulation: the recipe gives {accum} (= global {t.global_batch_size} / (micro "
                         f"{t.micro_batch_size} x {world_size} processes)), {name} gradient_accumulation_steps="
                         f"{ds['gradient_accumulation_steps']}")
    if plan.deepspeed and _set(plan.grad_accum_env) and int(plan.grad_accum_env) != accum:
        conflicts.append(f"accumulation: the recipe gives {accum}, accelerate config gradient_accumulation_steps="
                         f"{plan.grad_accum_env}")
    # clipping
    if _set(ds.get("gradient_clipping")) and float(ds["gradient_clipping"]) != o.max_grad_norm:
        conflicts.append(f"clipping: recipe optim.max_grad_norm={o.max_grad_norm}, {name} gradient_clipping="
                         f"{ds['gradient_clipping']}")
    if plan.deepspeed and _set(plan.grad_clip_env) and float(plan.grad_clip_env) != o.max_grad_norm:
        conflicts.append(f"clipping: recipe optim.max_grad_norm={o.max_grad_norm}, accelerate config "
                         f"gradient_clipping={plan.grad_clip_env}")
    # ownership
    for block in ("optimizer", "scheduler"):
        if block in ds:
            conflicts.append(f"{block} owned twice: the recipe's optim section builds the {block}, and {name} "
                             f"has an '{block}' block; remove the block from the JSON")

    # impossible combinations
    if plan.deepspeed and plan.fsdp:
        conflicts.append("FSDP and DeepSpeed are both enabled: pick one accelerate config")
    if plan.pipeline and plan.zero_stage >= 2:
        conflicts.append(f"pipeline parallelism with ZeRO-{plan.zero_stage} ({name}): DeepSpeed's pipeline engine "
                         "supports ZeRO-0/1 only (stage 2/3 shard the gradients the pipeline accumulates)")
    zero = ds.get("zero_optimization", {})
    for kind in ("offload_optimizer", "offload_param"):
        offload = zero.get(kind) or {}
        if offload.get("device") == "nvme":
            path = offload.get("nvme_path")
            if not path:
                conflicts.append(f"{kind} to nvme needs nvme_path in {name}")
            elif not Path(path).is_dir() or not os.access(path, os.W_OK):
                conflicts.append(f"{kind}.nvme_path={path} in {name} is not a writable directory on this machine")
    if t.mixed_precision == "fp16" and not has_cuda:
        conflicts.append("train.mixed_precision=fp16 needs a CUDA GPU; on a CPU Accelerate would silently train "
                         "in fp32. Use bf16 (supported on CPU) or no")
    if t.mixed_precision == "bf16" and has_cuda and not torch.cuda.is_bf16_supported():
        conflicts.append("train.mixed_precision=bf16 but this GPU has no bf16 (pre-Ampere): use fp16")
    if conflicts:
        raise ConfigError("the launch config conflicts with the recipe:\n  - " + "\n  - ".join(conflicts))


def fill_deepspeed_autos(accelerator, cfg: Config) -> None:
    """Accelerate fills an "auto" gradient_clipping with 1.0 whatever the script wants; make the
    recipe the source instead (0 disables clipping, as in DeepSpeed)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
        plugin.deepspeed_config["gradient_clipping"] = cfg.optim.max_grad_norm


def check_engaged(accelerator, plan: LaunchPlan) -> None:
    """Stop if the launcher asked for a backend that Accelerate silently replaced."""
    from accelerate.utils import DistributedType
    got = accelerator.distributed_type
    if plan.deepspeed and got != DistributedType.DEEPSPEED:
        raise ConfigError(f"the accelerate config asks for DeepSpeed but Accelerate runs {got} "
                           "(ACCELERATE_USE_CPU=1 turns a DeepSpeed config into plain DDP: on CPU set "
                           "DS_ACCELERATOR=cpu instead)")
    if plan.fsdp and got != DistributedType.FSDP:
        raise ConfigError(f"the accelerate config asks for FSDP but Accelerate runs {got}: Accelerate enables "
                           "FSDP only on GPUs, so this run would be DDP under the name FSDP. Refusing. "
                           "Use a GPU machine, or a DDP/DeepSpeed config on CPU")


def _local_numel(p) -> int:
    if hasattr(p, "ds_tensor"):      # ZeRO-3: the rank's shard lives in ds_tensor, p itself is empty
        return p.ds_tensor.numel()
    if hasattr(p, "to_local"):       # FSDP2 DTensor
        return p.to_local().numel()
    return p.numel()


def describe(accelerator, model, full_param_numel: int) -> dict:
    """What really runs: backend, ZeRO stage and offload, and whether parameters are sharded
    (a rank holding fewer parameter elements than the full model's `full_param_numel`)."""
    from accelerate.utils import DistributedType
    local = sum(_local_numel(p) for p in accelerator.unwrap_model(model).parameters())
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version == 1:
        local = sum(_local_numel(p) for p in model.parameters())   # the flat, sharded FSDP1 parameters
    info = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision, "local_param_numel": local,
            "full_param_numel": full_param_numel, "params_sharded": local < full_param_numel}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        info.update(zero_stage=model.zero_optimization_stage(), offload_optimizer=bool(model.zero_offload_optimizer()),
                    offload_param=bool(model.zero_offload_param()))
    if accelerator.distributed_type == DistributedType.FSDP:
        info["fsdp_version"] = accelerator.state.fsdp_plugin.fsdp_version
    return info


@contextlib.contextmanager
def full_weights(accelerator, model):
    """Yield {name: full tensor} as this rank sees the model, gathering shards where the backend
    shards them (ZeRO-3: GatheredParameters; FSDP2: DTensor.full_tensor; FSDP1: summon_full_params).
    Collective under sharded backends: every rank must enter it."""
    from accelerate.utils import DistributedType
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and model.zero_optimization_stage() == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
            yield {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    elif accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        with FSDP.summon_full_params(model, writeback=False):
            yield {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    else:
        yield {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
               for k, v in unwrapped.state_dict().items()}


def rank_checksums(accelerator, model) -> list[list[float]]:
    """[sum, sum of |w|] in float64 of the full weights as each rank sees them; equal rows mean
    the ranks agree. Collective: every rank must call it."""
    with full_weights(accelerator, model) as weights:
        tensors = list(weights.values())
        local = torch.tensor([[sum(float(t.double().sum()) for t in tensors),
                               sum(float(t.double().abs().sum()) for t in tensors)]],
                             dtype=torch.float64, device=accelerator.device)
    return accelerator.gather(local).tolist()
