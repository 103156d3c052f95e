"""The launch side: what the accelerate YAML (and DeepSpeed JSON) asked for, checked against the
recipe before any heavy work; the Accelerator built from it; and what actually engaged.

`accelerate launch --config_file X.yaml` hands its settings to the script as ACCELERATE_* / FSDP_*
environment variables; `read_launch_plan` reads them, plus the DeepSpeed JSON they point at. Tools
that plan a launch without running it read the YAML itself with `plan_from_config_file`, into the
same LaunchPlan, so the backend vocabulary (name, kind, ZeRO stage, offload, sharding) is defined
once, here.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from .config import Config, ConfigError, grad_accum_steps, padded_batches, repeating_shapes, yaml_problem

REPO = Path(__file__).resolve().parents[1]
BACKENDS_TSV = REPO / "accelerate_configs" / "backends.tsv"


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
    num_processes: int | None = None          # the YAML's num_processes (a running job reads WORLD_SIZE)
    num_machines: int = 1
    # Decided once, for the machine the run is on (launch_plan_here); None in a plan made for elsewhere
    # (the memory planner, tools that plan a launch): those take the device as an input.
    on_gpu: bool | None = None
    # Resolved with the recipe, once, by resolve_run (preflight): what the engines and the loop read.
    world: int | None = None                  # processes
    replicas: int | None = None               # data-parallel replicas (world / stages under the pipeline)
    accum: int | None = None                  # micro batches per optimizer step
    precision: str | None = None              # the recipe's train.mixed_precision, checked against the launch files
    tf32: bool = False                        # TF32 matmuls: train.tf32 on a GPU
    packed_dropout: bool = False              # packed dropout masks (dropout.packed_dropout_here)
    padded: bool = False                      # padded batches with an attention mask (config.padded_batches)
    repeating_shapes: bool = False            # a fixed set of batch shapes (config.repeating_shapes): compile static

    @property
    def pin_memory(self) -> bool:
        """Pinned host batches: worth it only when they are copied to a GPU."""
        return bool(self.on_gpu)

    # ------------------------------------------------------------ the backend vocabulary
    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0)) if self.deepspeed else 0

    @property
    def pipeline(self) -> bool:
        return self.deepspeed and "pipeline" in self.ds_config

    @property
    def kind(self) -> str:
        """The engine family: ddp | fsdp | deepspeed | pipeline."""
        if self.pipeline:
            return "pipeline"
        return "deepspeed" if self.deepspeed else "fsdp" if self.fsdp else "ddp"

    @property
    def offload(self) -> str:
        """Where ZeRO offloads to: none | cpu | nvme (the farther of optimizer and parameters)."""
        zero = self.ds_config.get("zero_optimization", {}) if self.deepspeed else {}
        devices = {(zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
        return "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"

    @property
    def offloads_optimizer(self) -> bool:
        """The optimizer step runs on the host (ZeRO offload_optimizer to cpu or nvme)."""
        zero = self.ds_config.get("zero_optimization", {}) if self.deepspeed and not self.pipeline else {}
        return (zero.get("offload_optimizer") or {}).get("device", "none") != "none"

    @property
    def name(self) -> str:
        """ddp | fsdp | zero0..3 with -offload (CPU) or -nvme | pipeline: the names of the Make
        targets, the memory planner's rows and the logs."""
        if self.kind != "deepspeed":
            return self.kind
        suffix = {"none": "", "cpu": "-offload", "nvme": "-nvme"}[self.offload]
        return f"zero{self.zero_stage}{suffix}"

    @property
    def shards_params(self) -> bool:
        """Does a rank hold only part of the weights? (ZeRO-3, FSDP, the pipeline's stages)"""
        return self.kind in ("fsdp", "pipeline") or (self.kind == "deepspeed" and self.zero_stage == 3)


def read_launch_plan(env=os.environ) -> LaunchPlan:
    plan = LaunchPlan(deepspeed=_true(env.get("ACCELERATE_USE_DEEPSPEED")), fsdp=_true(env.get("ACCELERATE_USE_FSDP")),
                      cpu=_true(env.get("ACCELERATE_USE_CPU")), mixed_precision=env.get("ACCELERATE_MIXED_PRECISION"),
                      grad_accum_env=env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                      grad_clip_env=env.get("ACCELERATE_GRADIENT_CLIPPING"),
                      ds_config_path=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
    if plan.deepspeed and plan.ds_config_path:
        path = Path(plan.ds_config_path)
        if not path.exists() and not path.is_absolute() and (REPO / path).exists():
            path = REPO / path   # a repository-relative path in a YAML, read from another directory
        if not path.exists():
            raise ConfigError(f"DeepSpeed config not found: {path} (from the accelerate config's deepspeed_config_file)")
        try:
            plan.ds_config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
        if not isinstance(plan.ds_config, dict):
            raise ConfigError(f"DeepSpeed config {path} is not a JSON object")
    return plan


def launch_plan_here(env=os.environ) -> LaunchPlan:
    """The plan of a launched rank (or of a launch about to start here, `env` being its environment),
    with the device decided once (decide_on_gpu). Engines, the loop and the checks read plan.on_gpu and
    never decide again."""
    plan = read_launch_plan(env)
    plan.on_gpu = decide_on_gpu(plan, env)
    return plan


def plan_from_config_file(path: str | Path) -> LaunchPlan:
    """The LaunchPlan an accelerate YAML would give a launched script (the same environment
    variables `accelerate launch` sets from it), for tools that plan without launching."""
    import yaml
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise ConfigError(f"accelerate config {path}: {err.strerror}; pass an existing file "
                          "(see accelerate_configs/)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"accelerate config {path} is not valid YAML: {yaml_problem(err)}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"accelerate config {path} is not a mapping of settings (see accelerate_configs/)")
    kind = str(config.get("distributed_type", "NO")).upper()
    ds = config.get("deepspeed_config") or {}
    env = {"ACCELERATE_USE_DEEPSPEED": str(kind == "DEEPSPEED"), "ACCELERATE_USE_FSDP": str(kind == "FSDP"),
           "ACCELERATE_USE_CPU": str(config.get("use_cpu", False))}
    if config.get("mixed_precision") is not None:
        env["ACCELERATE_MIXED_PRECISION"] = str(config["mixed_precision"]).lower().replace("false", "no")
    for key, var in (("deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE"),
                     ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                     ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING")):
        if kind == "DEEPSPEED" and ds.get(key) is not None:
            env[var] = str(ds[key])
    plan = read_launch_plan(env)
    plan.num_processes = int(config.get("num_processes", 1))
    plan.num_machines = int(config.get("num_machines", 1))
    return plan


def pipeline_replicas(plan: LaunchPlan, world_size: int) -> int:
    """Data-parallel replicas: the world size, or world / stages under the pipeline engine (whose
    `stages` consecutive ranks form one pipeline)."""
    if not plan.pipeline:
        return world_size
    stages = plan.ds_config.get("pipeline", {}).get("stages", 2)
    if not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"pipeline.stages must be a positive integer, got {stages!r}")
    if world_size % stages:
        raise ConfigError(f"{world_size} processes cannot form pipelines of {stages} stages (pipeline.stages in "
                          f"{plan.ds_config_path}): the world size must be a multiple of the stage count")
    return world_size // stages


# ---------------------------------------------------------------------------- the device
def decide_on_gpu(plan: LaunchPlan, env=os.environ, cuda_available: bool | None = None) -> bool:
    """The one answer to "does this run train on CUDA GPUs?", asked once by launch_plan_here and kept
    as plan.on_gpu, which is what everything reads: the process-group backend,
    the fp16 and bf16 checks, the optimizer kernel, pinned memory and the GPU statistics: CUDA is
    visible and the launch did not ask for CPU. DS_ACCELERATOR=cpu with GPUs visible is refused:
    Accelerate would still pick NCCL and CUDA devices and DeepSpeed would send CPU tensors over NCCL
    (the CPU launch rule hides the GPUs: make <mode> CPU=1 sets CUDA_VISIBLE_DEVICES=)."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if env.get("DS_ACCELERATOR") == "cpu" and cuda:
        raise ConfigError("DS_ACCELERATOR=cpu asks DeepSpeed for a CPU run but CUDA GPUs are visible, so Accelerate "
                          "would use NCCL and CUDA devices; hide them (CUDA_VISIBLE_DEVICES=, as make <mode> CPU=1 "
                          "does) or unset DS_ACCELERATOR to train on the GPUs")
    return cuda and not plan.cpu


def set_kernels(plan: LaunchPlan) -> str | None:
    """The GPU kernels the run's plan calls for, set once before the model runs (nothing on CPUs):
    - fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer; a no-op before), as
      NVIDIA's recipes train; MFU then divides by the TF32 peak (bert_recipes.perf.gpu_peak);
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


def bf16_supported(capability: tuple[int, int] | None) -> bool:
    """Native bf16 needs compute capability 8.0 (Ampere) or newer. torch.cuda.is_bf16_supported()
    also says yes on V100/T4, where bf16 is emulated and slow."""
    return capability is not None and tuple(capability) >= (8, 0)


def local_capability() -> tuple[int, int]:
    """This rank's GPU (LOCAL_RANK), read before any device is set, without touching GPU 0."""
    return torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0")))


# ---------------------------------------------------------------------------- the backend matrix
@dataclass(frozen=True)
class BackendRow:
    """One row of accelerate_configs/backends.tsv: a Make target and how it launches."""
    name: str
    config: str          # the accelerate YAML on GPUs
    cpu_yaml: str | None  # the accelerate YAML on CPU processes; None: a GPU-only row
    cpu_env: str         # VAR=value the CPU launch needs (the Makefile prefixes the same)

    @property
    def gpu_only(self) -> bool:
        """The table's `gpu-only`: no CPU launch runs this backend (FSDP: Accelerate would run DDP)."""
        return self.cpu_yaml is None

    @property
    def cpu_config(self) -> str:
        if self.cpu_yaml is None:
            raise ConfigError(f"{self.name} runs on GPUs only (accelerate_configs/backends.tsv): on CPU processes use "
                              "ddp, or zero3 for sharded parameters")
        return self.cpu_yaml

    @property
    def plan(self) -> LaunchPlan:
        return plan_from_config_file(REPO / self.config)

    def cpu_launch_env(self, env: dict) -> dict:
        """`env` with this row's CPU launch variables. DeepSpeed on CPU needs DS_ACCELERATOR=cpu and
        must NOT see ACCELERATE_USE_CPU (Accelerate would silently run plain DDP instead)."""
        self.cpu_config   # a GPU-only row has no CPU launch: ConfigError
        assignments = dict(item.split("=", 1) for item in self.cpu_env.split())
        deepspeed = assignments.get("DS_ACCELERATOR") == "cpu"
        out = {k: v for k, v in env.items() if not (deepspeed and k == "ACCELERATE_USE_CPU")}
        return {**out, **assignments}


def backend_rows() -> dict[str, BackendRow]:
    """The backend matrix, read by the Makefile, tools/ and the tests alike."""
    rows = {}
    for line in BACKENDS_TSV.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, config, cpu_config, cpu_env = line.split("\t")
            cpu_yaml = None if cpu_config == "gpu-only" else config if cpu_config == "-" else cpu_config
            rows[name] = BackendRow(name, config, cpu_yaml, "" if cpu_env == "-" else cpu_env)
    return rows


def _set(value) -> bool:
    """A value the user pinned (not missing, not 'auto')."""
    return value is not None and value != "auto"


def check_consistency(cfg: Config, plan: LaunchPlan, world_size: int, accum: int, has_cuda: bool,
                      capability: tuple[int, int] | None = None) -> None:
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
    # a JSON that owns the optimizer / schedule (Accelerate's templates): the recipe fills its "auto"s
    conflicts += ds_block_conflicts(cfg, ds, name)

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
    if o.name == "lamb" and (plan.fsdp or plan.zero_stage >= 1):
        what = "FSDP shards each parameter" if plan.fsdp else f"ZeRO-{plan.zero_stage} hands the optimizer flat shards"
        conflicts.append(f"optim.name=lamb needs whole parameter tensors for its per-layer trust ratio, but {what} "
                         "(DeepSpeed itself lists LAMB as untested with ZeRO): use a DDP config, or optim.name=adamw")
    if t.mixed_precision == "fp16" and not has_cuda:
        conflicts.append("train.mixed_precision=fp16 needs a CUDA GPU; on a CPU Accelerate would silently train "
                         "in fp32. Use bf16 (supported on CPU) or no")
    if t.mixed_precision == "bf16" and has_cuda and capability is not None and not bf16_supported(capability):
        major, minor = capability
        conflicts.append(f"train.mixed_precision=bf16 but this GPU (compute capability {major}.{minor}) has no native "
                         "bf16 (it needs 8.0, Ampere or newer; older GPUs emulate it slowly): use fp16")
    if len(conflicts) == 1:
        raise ConfigError(f"the launch config conflicts with the recipe: {conflicts[0]}")
    if conflicts:
        raise ConfigError("the launch config conflicts with the recipe:\n  - " + "\n  - ".join(conflicts))


def resolve_run(cfg: Config, plan: LaunchPlan, world_size: int, capability="local") -> LaunchPlan:
    """The plan resolved with the recipe, once, before anything is built (preflight calls it, in every
    rank and before a Make target launches): world, replicas, accumulation, precision, TF32 and the
    dropout masks, with recipe and launch files compared (check_consistency). The engines read these
    fields and never derive them again. Needs plan.on_gpu (launch_plan_here) and a numeric
    train.micro_batch_size (preflight.choose_micro_batch). capability: the GPU's compute capability,
    "local" (this rank's GPU) or None (a GPU not at hand, as make memory plans for: bf16 not checked).
    -> the same plan, filled in."""
    from .dropout import packed_dropout_here
    if capability == "local":
        capability = local_capability() if plan.on_gpu else None
    plan.world, plan.replicas = world_size, pipeline_replicas(plan, world_size)
    plan.accum = grad_accum_steps(cfg.train, plan.replicas)
    check_consistency(cfg, plan, plan.replicas, plan.accum, bool(plan.on_gpu), capability)
    plan.precision, plan.tf32 = cfg.train.mixed_precision, bool(plan.on_gpu and cfg.train.tf32)
    plan.packed_dropout = packed_dropout_here(cfg.model.dropout_impl, cfg.train.compile,
                                              "cuda" if plan.on_gpu else "cpu")
    plan.padded, plan.repeating_shapes = padded_batches(cfg), repeating_shapes(cfg)
    return plan


# ---------------------------------------------------------------------------- DeepSpeed-owned optimizer / schedule
DS_OPTIMIZERS = {"adamw": ("adam", "adamw"), "lamb": ("lamb",)}
DS_SCHEDULES = {"linear": "WarmupDecayLR", "constant": "WarmupLR", "cosine": "WarmupCosineLR"}


def _differs(pinned, wanted) -> bool:
    if isinstance(wanted, list):
        return not isinstance(pinned, list) or len(pinned) != len(wanted) or any(_differs(a, b) for a, b in zip(pinned, wanted))
    try:
        return abs(float(pinned) - float(wanted)) > 1e-12 * max(1.0, abs(float(wanted)))
    except (TypeError, ValueError):
        return True


def ds_block_conflicts(cfg: Config, ds: dict, name: str) -> list[str]:
    """A DeepSpeed JSON may own the optimizer and the schedule, as Accelerate's templates do; each
    value it pins must be the recipe's (the "auto"s are filled from the recipe)."""
    o, out = cfg.optim, []
    for key in ("optimizer", "scheduler"):
        if key in ds and not (isinstance(ds[key], dict) and isinstance(ds[key].get("params", {}), dict)):
            out.append(f"{key}: {name} {key} must be a mapping with a type and a params mapping, got {ds[key]!r}")
            return out
    block = ds.get("optimizer")
    if isinstance(block, dict):
        if str(block.get("type", "")).lower() not in DS_OPTIMIZERS[o.name]:
            out.append(f"optimizer: recipe optim.name={o.name}, {name} optimizer.type={block.get('type')}")
        params = block.get("params") or {}
        if o.name == "adamw" and params.get("adam_w_mode") is False:
            out.append(f"optimizer: recipe optim.name=adamw (decoupled weight decay), {name} "
                       "optimizer.params.adam_w_mode=false (Adam with L2)")
        for key, wanted in (("lr", o.lr), ("betas", list(o.betas)), ("eps", o.eps), ("weight_decay", o.weight_decay)):
            if _set(params.get(key)) and _differs(params[key], wanted):
                out.append(f"optimizer: recipe optim.{key}={wanted}, {name} optimizer.params.{key}={params[key]}")
    offload = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none") != "none"
    if offload and ds.get("zero_force_ds_cpu_optimizer") is True and not o.cpu_adam and "optimizer" not in ds:
        out.append(f"optimizer: recipe optim.cpu_adam=false (torch AdamW on the host), {name} "
                   "zero_force_ds_cpu_optimizer=true (Accelerate would replace it with a CPU Adam)")
    block = ds.get("scheduler")
    if isinstance(block, dict):
        wanted_type = DS_SCHEDULES.get(o.decay)
        if block.get("type") != wanted_type:
            shown = f"DeepSpeed's {wanted_type}" if wanted_type else "no DeepSpeed schedule has this shape"
            out.append(f"schedule: recipe optim.decay={o.decay} ({shown}), {name} scheduler.type={block.get('type')}")
        params = block.get("params") or {}
        for key, wanted in ds_schedule_values(o, block.get("type"), o.warmup_steps, None).items():
            if wanted is not None and _set(params.get(key)) and _differs(params[key], wanted):
                out.append(f"schedule: the recipe gives {key}={wanted}, {name} scheduler.params.{key}={params[key]}")
        if block.get("type") == "WarmupDecayLR" and o.min_lr_ratio != 0:
            out.append(f"schedule: recipe optim.min_lr_ratio={o.min_lr_ratio}, {name} scheduler.type=WarmupDecayLR "
                       "decays to 0 (set min_lr_ratio: 0, or drop the JSON's scheduler block)")
    return out


def ds_schedule_values(o, ds_type: str, warmup, total) -> dict:
    """The recipe's values for a DeepSpeed schedule's params, per type (None: not known yet)."""
    warmup = None if warmup is None else max(1, warmup)
    if ds_type == "WarmupCosineLR":   # ratios of the optimizer's lr
        return {"warmup_min_ratio": 0.0, "cos_min_ratio": o.min_lr_ratio, "warmup_num_steps": warmup,
                "total_num_steps": total}
    values = {"warmup_min_lr": 0.0, "warmup_max_lr": o.lr, "warmup_num_steps": warmup}
    return values if ds_type == "WarmupLR" else {**values, "total_num_steps": total}


def deepspeed_owned(accelerator, cfg: Config, module, optimizer, scheduler):
    """When the DeepSpeed JSON has an optimizer and/or scheduler block: Accelerate's DummyOptim /
    DummyScheduler in place of the recipe's objects, every "auto" filled from the recipe (total steps
    included: Accelerate's own fill would divide them by the world size). -> (optimizer, scheduler,
    a line saying what is in effect, or None)."""
    from accelerate.utils import DummyOptim, DummyScheduler
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config if plugin is not None else {}
    if "optimizer" not in ds and "scheduler" not in ds:
        return optimizer, scheduler, None
    o, said = cfg.optim, []
    if "optimizer" in ds:
        params = ds["optimizer"].setdefault("params", {})
        for key, value in (("lr", o.lr), ("betas", list(o.betas)), ("eps", o.eps), ("weight_decay", o.weight_decay)):
            if params.get(key, "auto") == "auto":
                params[key] = value
        optimizer = DummyOptim(optimizer.param_groups, lr=o.lr, weight_decay=o.weight_decay)
        said.append(f"optimizer {ds['optimizer'].get('type')} from the DeepSpeed config (lr {params['lr']}, betas "
                    f"{params['betas']}, eps {params['eps']}, weight decay {params['weight_decay']}, none on biases "
                    "and norms)")
    total, warmup = scheduler.total_steps, scheduler.warmup_steps
    if "scheduler" in ds:
        params = ds["scheduler"].setdefault("params", {})
        pinned = []
        for key, value in ds_schedule_values(o, ds["scheduler"].get("type"), warmup, total).items():
            if params.get(key, "auto") == "auto":
                params[key] = value
            elif _differs(params[key], value):
                pinned.append(f"scheduler.params.{key}={params[key]}, the recipe gives {value}")
        if pinned:
            raise ConfigError("the DeepSpeed config's schedule contradicts the recipe: " + "; ".join(pinned)
                              + ' (set them to "auto")')
        scheduler = DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=max(1, warmup))
        said.append(f"schedule {ds['scheduler']['type']} from the DeepSpeed config ({params['warmup_num_steps']} "
                    f"warmup steps of {params.get('total_num_steps', total)})")
        if params.get("warmup_type", "log") == "log":
            said.append("note: its warmup is log-shaped (DeepSpeed's default warmup_type), the recipe's is linear; "
                        'add "warmup_type": "linear" to the JSON\'s scheduler params for the recipe\'s shape')
    elif isinstance(optimizer, DummyOptim):   # DeepSpeed's optimizer under the recipe's own schedule
        from .optim import build_scheduler
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: build_scheduler(opt, o, total))
        said.append(f"the recipe's schedule ({o.decay}, {warmup} warmup steps of {total})")
    return optimizer, scheduler, "[optim] " + "; ".join(said)


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


def fill_deepspeed_autos(accelerator, cfg: Config) -> None:
    """Accelerate fills an "auto" gradient_clipping with 1.0 whatever the script wants; make the
    recipe the source instead (0 disables clipping, as in DeepSpeed). Under optimizer offload the
    recipe's optimizer is used as built (optim.cpu_adam picks DeepSpeed's CPU Adam or torch's AdamW):
    left to its default, Accelerate would rebuild it as a CPU Adam from lr and weight decay alone, and
    a CPU Adam that is not a torch AdamW would lose its decoupled weight decay (adamw_mode)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = cfg.optim.max_grad_norm
    ds.setdefault("zero_force_ds_cpu_optimizer", False)


def check_nvme_gradient_swap(plan: LaunchPlan, model, world_size: int, on_gpu: bool) -> None:
    """Refuse what DeepSpeed 0.19.8 gets wrong on CPU processes (ds_configs/README.md): with ZeRO-3's
    optimizer offloaded to NVMe it swaps every gradient partition of at least max(1 MiB, aio.block_size)
    to disk, and the updates then come out wrong, differently on every run (measured on CPU: the loss
    off DDP by up to 0.04 within 4 steps; without such a partition, or with the optimizer in host
    memory, the same runs match DDP within 1e-5). Not checked on GPUs, which are let through."""
    zero = plan.ds_config.get("zero_optimization", {}) if plan.deepspeed else {}
    if on_gpu or plan.zero_stage != 3 or (zero.get("offload_optimizer") or {}).get("device") != "nvme":
        return
    threshold = max(2 ** 20, int((plan.ds_config.get("aio") or {}).get("block_size", 2 ** 20)))
    name, param = max(model.named_parameters(), key=lambda item: item[1].numel())
    partition_bytes = -(-param.numel() // world_size) * 4   # fp32 gradients, split over the ranks
    if partition_bytes >= threshold:
        raise ConfigError(f"offload_optimizer to nvme in {plan.ds_config_path} on CPU processes: DeepSpeed 0.19.8 swaps "
                          f"gradient partitions of {threshold / 2 ** 20:g} MiB or more to disk ({name}: "
                          f"{partition_bytes / 2 ** 20:.1f} MiB a rank), and its updates then come out wrong "
                          "(ds_configs/README.md); offload the optimizer to cpu instead, or train on GPUs")


def private_swap_dirs(accelerator, output_dir: Path) -> list[Path]:
    """ZeRO NVMe offload: DeepSpeed swaps into a folder of this run's below each nvme_path (named after
    output_dir, so a rerun reuses it), which the engine removes when the run ends: DeepSpeed itself
    leaves its swap files behind (the model's size several times over, on every node)."""
    import hashlib
    plugin = accelerator.state.deepspeed_plugin
    zero = plugin.deepspeed_config.get("zero_optimization", {}) if plugin is not None else {}
    tag = hashlib.sha256(str(Path(output_dir).absolute()).encode()).hexdigest()[:10]
    dirs = []
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if section.get("device") == "nvme" and section.get("nvme_path"):
            section["nvme_path"] = str(Path(section["nvme_path"]) / f"bert-recipes-swap-{tag}")
            dirs.append(Path(section["nvme_path"]))
    return sorted(set(dirs))


def check_engaged(accelerator, plan: LaunchPlan) -> None:
    """Stop if the launcher asked for a backend that Accelerate silently replaced."""
    from accelerate.utils import DistributedType
    got = accelerator.distributed_type
    if plan.deepspeed and got != DistributedType.DEEPSPEED:
        raise ConfigError(f"the accelerate config asks for DeepSpeed but Accelerate runs {got} "
                           "(ACCELERATE_USE_CPU=1 turns a DeepSpeed config into plain DDP: on CPU set "
                           "DS_ACCELERATOR=cpu instead)")
    if plan.fsdp and got != DistributedType.FSDP:
        raise ConfigError(f"the accelerate config asks for FSDP but Accelerate runs {got}: this run would be DDP "
                           "under the name FSDP. Refusing. FSDP is a GPU-only row of accelerate_configs/backends.tsv: "
                           "use a GPU machine, or a DDP/DeepSpeed config on CPU")


def build_accelerator(cfg: Config, plan: LaunchPlan, output_dir: Path):
    """The Accelerator, with the settings the recipe owns (precision, accumulation, trackers), from a
    plan resolve_run has filled in (recipe and launch files already compared there). The backend
    itself (DDP, DeepSpeed, FSDP) comes from the launch config."""
    from accelerate import Accelerator
    from accelerate.utils import (DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs,
                                  ProjectConfiguration)

    if plan.accum is None:
        raise RuntimeError("build_accelerator needs a resolved plan: call backend.resolve_run first")
    world_size, on_gpu = plan.world, plan.on_gpu
    # Every collective gives up after train.collective_timeout_s (a stuck rank, a lost node). On CPU
    # the backend must be named: otherwise Accelerate leaves it unset for DeepSpeed and sees 1 process.
    handlers = [] if world_size == 1 else [InitProcessGroupKwargs(
        backend=None if on_gpu else "gloo", timeout=timedelta(seconds=cfg.train.collective_timeout_s))]
    check_trackers(cfg.logging.trackers)   # opened by the engine (logs.Trackers), the same on every backend
    accelerator = Accelerator(
        mixed_precision=plan.precision,
        # Every optimizer step takes exactly `accum` micro batches (train.py's loop), so the
        # gradients sync on the count alone, never on an epoch's end.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=plan.accum, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,   # the engine steps the schedule once per optimizer step
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        # non_blocking: pinned batches are copied to the GPU without making the host wait
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=cfg.data.pin_memory),
        kwargs_handlers=handlers,
        dynamo_plugin=dynamo_plugin(cfg.train, plan),   # train.compile: Accelerate compiles in prepare
    )
    check_engaged(accelerator, plan)
    fill_deepspeed_autos(accelerator, cfg)
    accelerator.swap_dirs = private_swap_dirs(accelerator, output_dir)
    if accelerator.num_processes != world_size:
        raise ConfigError(f"the launcher started {world_size} processes but Accelerate sees "
                           f"{accelerator.num_processes} (distributed_type={accelerator.distributed_type}); "
                           "see docs/backends.md 'Launching on CPU' for launch commands that really distribute")
    return accelerator


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


@contextlib.contextmanager
def zero3_keeps_model_dtype():
    """Work around a DeepSpeed defect (0.19.8; ds_configs/README.md) while ZeRO-3 partitions the model:
    `zero.Init._set_dtype`, given the model's dtype, returns "that dtype if the accelerator supports
    fp16, else bf16" (an operator-precedence slip, and `is_bf16_supported` tested without calling
    it). CUDA supports fp16, so GPU runs are not affected; a CPU without AVX512-FP16 (most AMD EPYC)
    gets bf16, and under NVMe parameter offload the swap buffers, and with them the parameters of an
    fp32 run, become bf16. Within this context a dtype that is passed in is kept. The defect is
    probed, not assumed: where DeepSpeed already keeps the dtype, nothing is changed."""
    import types

    from deepspeed.runtime.zero.partition_parameters import Init
    original = Init._set_dtype
    probe = types.SimpleNamespace()
    original(probe, None, torch.float32)
    if probe.dtype == torch.float32:
        yield
        return

    def keep_given_dtype(self, ds_config, dtype):
        if dtype is None:
            original(self, ds_config, dtype)
        else:
            self.dtype = dtype
    Init._set_dtype = keep_given_dtype
    try:
        yield
    finally:
        Init._set_dtype = original


def check_trackers(trackers: list[str]) -> list[str]:
    """The recipe's trackers, each known and installed."""
    for name in trackers:
        if name not in ("tensorboard", "wandb", "mlflow"):
            raise ConfigError(f"logging.trackers: unknown tracker '{name}' (use tensorboard, wandb or mlflow)")
        try:
            __import__(name)
        except ImportError:
            raise ConfigError(f"logging.trackers includes '{name}' but it is not installed: pip install {name}")
    return list(trackers)


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
        params = [p for p in accelerator.unwrap_model(model).parameters() if hasattr(p, "ds_tensor")]
        if params:   # ZeRO-3: the dtype of this rank's partitions (in memory, or on NVMe) and how many live on NVMe
            nvme = [getattr(p.ds_tensor, "final_location", None) == "nvme" for p in params]
            info["param_dtypes"] = sorted({str(p.nvme_swapper.dtype if on_disk else p.ds_tensor.dtype)
                                           for p, on_disk in zip(params, nvme)})
            info["params_on_nvme"] = sum(nvme)
    if accelerator.distributed_type == DistributedType.FSDP:
        info["fsdp_version"] = accelerator.state.fsdp_plugin.fsdp_version
    plugin = accelerator.state.dynamo_plugin   # train.compile (backend.dynamo_plugin)
    if plugin is not None and plugin.backend.value != "NO":
        info["compile"] = {"backend": plugin.backend.value.lower(), "mode": plugin.mode, "dynamic": plugin.dynamic}
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
