"""Everything DeepSpeed-specific (the pipeline engine aside: bert_recipes/pipeline.py), each rule with the
DeepSpeed version it answers (0.19.8 unless it says otherwise; ds_configs/README.md tells the user's side):

- its JSON against the recipe (deepspeed_conflicts, ds_block_conflicts): the recipe owns the maths, a JSON
  may leave a value "auto" or repeat it;
- a JSON that owns the optimizer and the schedule (deepspeed_owned: Accelerate's DummyOptim and
  DummyScheduler, every "auto" filled from the recipe) and the autos Accelerate would fill otherwise
  (fill_deepspeed_autos, fill_micro_batch);
- what a process asks the host once, not at every call (ask_cpuinfo_once, ask_numa_once);
- NVMe offload: a private swap folder per run (private_swap_dirs), the gradient swap that goes wrong on
  CPU processes (check_nvme_gradient_swap), ZeRO-3's dtype slip (zero3_keeps_model_dtype);
- what engaged (describe_deepspeed; REPLACED, when Accelerate ran something else);
- a failed save that must still meet DeepSpeed's own barrier (saved_meeting_the_barrier);
- what its own step decided (deepspeed_norm_and_skip), its CPU Adam (host_adam, cpu_adam), the fp32 master weights an export holds
  (fp32_state_dict), and its `synchronize` for sync_audit.SyncAudit to count (its own step's host waits are
  listed in tests/deepspeed_syncs.py).

No torch or deepspeed at import time: the consistency checks (preflight, make memory) import this file.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from ..config import Config, ConfigError, OptimConfig
from ..places import cannot_create_in
from .plan import LaunchPlan

# DeepSpeed's own Lamb is not the recipe's: its FusedLamb applies the trust ratio to every tensor, clamped to
# [0.01, 10] (ops/lamb/fused_lamb.py, 0.19.8); the recipe's LAMB (optim.py) runs where the JSON names none.
DS_OPTIMIZERS = {"adamw": ("adam", "adamw"), "lamb": (), "stable_adamw": ()}   # DeepSpeed has no StableAdamW
DS_SCHEDULES = {"linear": "WarmupDecayLR", "constant": "WarmupLR", "cosine": "WarmupCosineLR"}


def ask_cpuinfo_once() -> None:
    """DeepSpeed 0.19.8's op builders ask py-cpuinfo for the CPU's architecture and SIMD width each time an
    op is loaded (op_builder/builder.py: cpu_arch and simd_width, both calling cpuinfo.get_cpu_info), and
    py-cpuinfo answers every call from a new Python process: about 1.1 s of a rank's start each, 2 to 4
    calls per rank under CPU offload or NVMe (counted in the suite on 2026-12-01: 42 such processes). The
    answer cannot change while a process runs: it is asked once per process."""
    try:
        import cpuinfo
    except ImportError:
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.lru_cache(maxsize=1)(cpuinfo.get_cpu_info)


def ask_numa_once() -> None:
    """DeepSpeed 0.19.8's CPU accelerator counts its devices by running `numactl --hardware` each time it is asked
    (accelerator/cpu_accelerator.py device_count -> utils/numa.get_numa_cores, unless LOCAL_SIZE is set), and ZeRO-3
    asks once per gradient bucket: about 30 processes a step on 2 ranks of a 2-layer model. Each one also resets
    Python's warning registry (os.get_exec_path enters warnings.catch_warnings), so torch's deprecation warnings for
    the collectives DeepSpeed calls came back with every bucket: 3,804 lines in a ZeRO-3 launch of the shipped
    recipes' first steps (tests/test_recipes.py). The answer cannot change while a process runs: asked once."""
    from deepspeed.utils import numa
    if not hasattr(numa.get_numa_cores, "cache_info"):
        numa.get_numa_cores = functools.lru_cache(maxsize=1)(numa.get_numa_cores)


def saved_meeting_the_barrier(save) -> None:
    """save() (a DeepSpeed engine's save_checkpoint, directly or through Accelerate's save_state). DeepSpeed
    0.19.8's save_checkpoint (runtime/engine.py) makes its directory, waits in dist.barrier(), checks the tag
    (a collective), writes each rank's files, then waits in dist.barrier() again. A rank whose write fails
    (a full disk) skips that last barrier and leaves the others in it until the collective timeout: it
    meets it before it raises, so every rank reaches the agreement after the save (ranks.written_by_all)."""
    try:
        save()
    except Exception:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        raise


def _set(value) -> bool:
    """A value the user pinned (not missing, not 'auto')."""
    return value is not None and value != "auto"


def _differs(pinned, wanted) -> bool:
    if isinstance(wanted, list):
        return not isinstance(pinned, list) or len(pinned) != len(wanted) or any(_differs(a, b) for a, b in zip(pinned, wanted))
    try:
        return abs(float(pinned) - float(wanted)) > 1e-12 * max(1.0, abs(float(wanted)))
    except (TypeError, ValueError):
        return True


def deepspeed_conflicts(cfg: Config, plan: LaunchPlan, world_size: int, accum: int) -> list[str]:
    """The DeepSpeed JSON (and the accelerate YAML's deepspeed section) against the recipe, each conflict
    with both values (backends.consistency.check_consistency raises them together with the others):
    precision, batch arithmetic, clipping, an optimizer or schedule block, the pipeline's ZeRO stage,
    the NVMe paths. Empty when the launch is not DeepSpeed's (its plan has no JSON)."""
    t, o = cfg.train, cfg.optim
    ds, name = plan.ds_config, plan.ds_config_path or "the DeepSpeed config"
    conflicts: list[str] = []
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
    conflicts += ds_block_conflicts(cfg.optim, ds, name)
    if plan.pipeline:
        conflicts += pipeline_conflicts(cfg, plan, name)
    elif cfg.train.compile and plan.zero_stage == 3:
        conflicts.append(f"train.compile under ZeRO-3 ({name}): dynamo traces the parameters ZeRO-3 has partitioned "
                         "away (empty tensors) and the first step fails (DeepSpeed 0.19.8, torch 2.13, seen on CPU "
                         "processes 2026-12-03; ZeRO-2 and DDP compile and run); set train.compile=false, or use "
                         "ZeRO-2")
    by_path: dict[str, list[str]] = {}   # a path the optimizer and the parameters share is told once
    for kind, offload in nvme_offloads(ds):
        if not offload.get("nvme_path"):
            conflicts.append(f"{kind} to nvme needs nvme_path in {name}")
        else:
            by_path.setdefault(offload["nvme_path"], []).append(kind)
    for path, kinds in by_path.items():
        where = f"{' and '.join(f'{kind}.nvme_path' for kind in kinds)}={path} in {name}"
        if not Path(path).is_dir():
            conflicts.append(f"{where} is not a directory on this machine")
        elif problem := cannot_create_in(Path(path)):
            conflicts.append(f"{where}: nothing can be created there ({problem})")
    return conflicts


def nvme_offloads(ds: dict) -> list[tuple[str, dict]]:
    """(offload_optimizer | offload_param, its section) for each ZeRO offload to NVMe in a DeepSpeed JSON."""
    zero = ds.get("zero_optimization") or {}
    return [(kind, zero[kind]) for kind in ("offload_optimizer", "offload_param")
            if isinstance(zero.get(kind), dict) and zero[kind].get("device") == "nvme"]


def pipeline_conflicts(cfg: Config, plan: LaunchPlan, name: str) -> list[str]:
    """What DeepSpeed's pipeline engine (bert_recipes/pipeline.py) cannot run: it takes the recipe's own
    optimizer and schedule, runs its stages itself (no torch.compile, its own activation checkpointing) and
    accumulates whole gradients (ZeRO-0/1)."""
    conflicts = []
    if plan.zero_stage >= 2:
        conflicts.append(f"pipeline parallelism with ZeRO-{plan.zero_stage} ({name}): DeepSpeed's pipeline engine "
                         "supports ZeRO-0/1 only (stage 2/3 shard the gradients the pipeline accumulates)")
    if {"optimizer", "scheduler"} & set(plan.ds_config):
        conflicts.append(f"{name} has an optimizer or scheduler block: the pipeline engine takes the recipe's own "
                         "(optim section); remove the block from the JSON")
    if cfg.model.gradient_checkpointing:
        conflicts.append("model.gradient_checkpointing under the pipeline: use the DeepSpeed JSON's "
                         "pipeline.activation_checkpoint_interval instead")
    if cfg.train.compile:
        conflicts.append("train.compile under the pipeline engine: DeepSpeed's pipeline runs its stages itself; "
                         "set train.compile=false")
    if cfg.train.global_batch_size_start is not None:
        conflicts.append("train.global_batch_size_start under the pipeline engine: its micro batches per step are fixed "
                         "when the engine is built; remove the ramp (and train.batch_rampup_tokens)")
    if cfg.data.document_mask or cfg.data.unpad:
        conflicts.append("data.document_mask or data.unpad under the pipeline engine: its stages pass hidden states and "
                         "a padding mask of fixed shapes; set both false")
    return conflicts


def ds_block_conflicts(o: OptimConfig, ds: dict, name: str) -> list[str]:
    """A DeepSpeed JSON may own the optimizer and the schedule, as Accelerate's templates do; each
    value it pins must be the recipe's optim (the "auto"s are filled from the recipe)."""
    out = []
    for key in ("optimizer", "scheduler"):
        if key in ds and not (isinstance(ds[key], dict) and isinstance(ds[key].get("params", {}), dict)):
            out.append(f"{key}: {name} {key} must be a mapping with a type and a params mapping, got {ds[key]!r}")
            return out
    block = ds.get("optimizer")
    if isinstance(block, dict):
        if str(block.get("type", "")).lower() == "lamb":
            out.append(f"optimizer: {name} optimizer.type={block.get('type')} is DeepSpeed's FusedLamb, which "
                       "scales every tensor by a clamped trust ratio, not the recipe's LAMB (optim.lamb_trust_ratio): "
                       "remove the optimizer block and the recipe's runs")
        elif str(block.get("type", "")).lower() not in DS_OPTIMIZERS[o.name]:
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


def deepspeed_owned(accelerator, o: OptimConfig, module, optimizer, scheduler, recipe_schedule):
    """When the DeepSpeed JSON has an optimizer and/or scheduler block: Accelerate's DummyOptim /
    DummyScheduler in place of the recipe's objects, every "auto" filled from the recipe (total steps
    included: Accelerate's own fill would divide them by the world size). recipe_schedule(optimizer):
    the recipe's schedule on another optimizer (DeepSpeed's, when the JSON owns the optimizer only).
    -> (optimizer, scheduler, a line saying what is in effect, or None)."""
    from accelerate.utils import DummyOptim, DummyScheduler
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config if plugin is not None else {}
    if "optimizer" not in ds and "scheduler" not in ds:
        return optimizer, scheduler, None
    said = []
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
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=recipe_schedule)
        said.append(f"the recipe's schedule ({o.decay}, {warmup} warmup steps of {total})")
    return optimizer, scheduler, "[optim] " + "; ".join(said)


def fill_deepspeed_autos(accelerator, optim: OptimConfig) -> None:
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
        ds["gradient_clipping"] = optim.max_grad_norm
    ds.setdefault("zero_force_ds_cpu_optimizer", False)


def fill_micro_batch(accelerator, micro_batch_size: int) -> None:
    """An "auto" train_micro_batch_size_per_gpu is the recipe's train.micro_batch_size, filled just before prepare
    (after train.micro_batch_size=auto's trial has chosen it). Left to Accelerate 1.15, "auto" is read off the
    loaders' batch_size: a loader with a batch sampler (data.group_by_length) has none, and prepare raises;
    with a smaller evaluation batch it would take that one (is_train_batch_min)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size


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
    tag = hashlib.sha256(str(Path(output_dir).absolute()).encode()).hexdigest()[:10]
    dirs = []
    for _, section in nvme_offloads(plugin.deepspeed_config if plugin is not None else {}):
        if section.get("nvme_path"):
            section["nvme_path"] = str(Path(section["nvme_path"]) / f"bert-recipes-swap-{tag}")
            dirs.append(Path(section["nvme_path"]))
    return sorted(set(dirs))


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

    import torch
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


def describe_deepspeed(model, unwrapped) -> dict:
    """What DeepSpeed engaged: ZeRO stage and offload, and under ZeRO-3 the dtype of this rank's partitions
    (in memory, or on NVMe) and how many of them live on NVMe."""
    info = dict(zero_stage=model.zero_optimization_stage(), offload_optimizer=bool(model.zero_offload_optimizer()),
                offload_param=bool(model.zero_offload_param()))
    params = [p for p in unwrapped.parameters() if hasattr(p, "ds_tensor")]
    if params:
        nvme = [getattr(p.ds_tensor, "final_location", None) == "nvme" for p in params]
        info["param_dtypes"] = sorted({str(p.nvme_swapper.dtype if on_disk else p.ds_tensor.dtype)
                                       for p, on_disk in zip(params, nvme)})
        info["params_on_nvme"] = sum(nvme)
    return info


def zero3_partition_numel(p) -> int | None:
    """ZeRO-3: the rank's shard lives in ds_tensor (p itself is empty); None for any other parameter."""
    return p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None


# A DeepSpeed config that Accelerate ran as something else (accelerator.check_engaged says it).
REPLACED = ("the accelerate config asks for DeepSpeed but Accelerate runs {got} (ACCELERATE_USE_CPU=1 turns a "
            "DeepSpeed config into plain DDP: on CPU set DS_ACCELERATOR=cpu instead)")


# ---------------------------------------------------------------------------- the step, the optimizer, the export
def deepspeed_norm_and_skip(accelerator, model) -> tuple:
    """After DeepSpeed's own step (inside backward, on the last micro batch): (its global gradient norm,
    whether it skipped the update: its overflow check, decided on the host)."""
    return model.get_global_grad_norm(), accelerator.optimizer_step_was_skipped


def host_adam(plan: LaunchPlan, optim: OptimConfig):
    """The AdamW a ZeRO offload steps on the host: DeepSpeed's vectorised CPU Adam (cpu_adam) where the recipe's
    optimizer is built (no JSON optimizer block: then none is built for nothing), its AdamW steps offloaded and
    optim.cpu_adam asks; None: torch's (optim.build_optimizer)."""
    offloaded = plan.offloads_optimizer and "optimizer" not in plan.ds_config
    return cpu_adam if offloaded and optim.cpu_adam and optim.name == "adamw" else None


def cpu_adam(groups: list[dict], optim: OptimConfig):
    """DeepSpeed's vectorised CPU Adam for an offloaded step (optim.cpu_adam), in AdamW mode (decoupled
    weight decay, as the recipe's AdamW). JIT-built on first use (about 45 s), then cached."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, adamw_mode=True)


def without_zero_init(accelerator):
    """A context in which a model that rank 0 alone loads (an export's sentence-transformers files, written by
    sentence-transformers reading the folder back: embeddings.write_sentence_transformer) is built whole: under ZeRO-3
    transformers' from_pretrained would build it in zero.Init, a collective the other ranks never join (a hang)."""
    if accelerator.state.deepspeed_plugin is None:
        return contextlib.nullcontext()
    return _hf_zero3_off()


@contextlib.contextmanager
def _hf_zero3_off():
    """transformers' own switch: its weak reference to the run's DeepSpeed config (set by Accelerate's plugin, which
    its is_deepspeed_zero3_enabled reads) unset, and restored after (Accelerate's zero3_init_context_manager only
    changes it where its zero3_init_flag does)."""
    from transformers.integrations import deepspeed as hf_deepspeed
    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept


def fp32_state_dict(accelerator, unwrapped) -> dict:
    """Under DeepSpeed in bf16/fp16 the model's own parameters are 16-bit copies; the fp32 master
    weights live in the optimizer, and those are what the export holds (safe_get_full_fp32_param,
    a collective per parameter, so peak memory is one parameter). Gathering ourselves also means a
    user's ZeRO-3 JSON without stage3_gather_16bit_weights_on_model_save still exports."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param
    whole: dict[int, torch.Tensor] = {}
    for param in unwrapped.parameters():          # tied weights appear once
        master = safe_get_full_fp32_param(param)  # None where DeepSpeed keeps no separate fp32 copy
        if master is None:
            with deepspeed.zero.GatheredParameters([param]):   # a no-op below ZeRO-3
                master = param.detach().clone()
        if accelerator.is_main_process:
            whole[id(param)] = master.detach().float().cpu()
    if not accelerator.is_main_process:
        return {}
    return {name: whole[id(v)] if isinstance(v, torch.nn.Parameter) else v.detach().cpu()
            for name, v in unwrapped.state_dict(keep_vars=True).items()}


# ---------------------------------------------------------------------------- host waits (sync_audit.SyncAudit)
# The host waits DeepSpeed's own step makes are listed, each with its line, in tests/deepspeed_syncs.py: the
# suite's allowlist, matched by DeepSpeed's files and functions (docs/backends.md, "The step and the host").
def synchronize_owner() -> tuple:
    """DeepSpeed's accelerator and its `synchronize` (its throughput timer, its optimizer steps), for
    sync_audit.SyncAudit to count."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator(), "synchronize"
