"""The recipe against its launch, once, before anything is built: resolve_run fills the plan in (world,
replicas, accumulation, precision, TF32, dropout masks) and check_consistency names every conflict
between the recipe and the launch files. The Make targets (preflight), every rank and the memory
planner run the same checks. DeepSpeed's rules live in backends/deepspeed.py. No torch at import time.
"""
from __future__ import annotations

from pathlib import Path

from ..config import (Config, ConfigError, documents_attend_apart, grad_accum_steps, packed_dropout_here, padded_batches,
                      repeating_shapes)
from ..batch_ramp import check_ramp
from .deepspeed import deepspeed_conflicts
from .plan import LaunchPlan, bf16_supported, local_capability, pipeline_replicas


# Optimizers whose rule reads each parameter tensor whole, and what for: ZeRO and FSDP hand them shards
WHOLE_TENSORS = {"lamb": ("its per-layer trust ratio", " (DeepSpeed itself lists LAMB as untested with ZeRO)"),
                 "stable_adamw": ("its per-tensor update RMS", "")}

def check_consistency(cfg: Config, plan: LaunchPlan, world_size: int, accum: int, has_cuda: bool,
                      capability: tuple[int, int] | None = None) -> None:
    """Compare recipe, accelerate YAML and DeepSpeed JSON; raise one ConfigError naming every conflict
    with both values. The recipe owns the maths: launch files may leave a value unset/"auto" or
    repeat it, but not contradict it. The DeepSpeed JSON's own rules: backends/deepspeed.py."""
    t, o = cfg.train, cfg.optim
    conflicts: list[str] = []

    # precision: accelerate YAML 'no' means "not set here"
    if plan.mixed_precision not in (None, "no", t.mixed_precision):
        conflicts.append(f"precision: recipe train.mixed_precision={t.mixed_precision}, "
                         f"accelerate config mixed_precision={plan.mixed_precision}")
    conflicts += deepspeed_conflicts(cfg, plan, world_size, accum)   # the DeepSpeed JSON (backends/deepspeed.py)

    # impossible combinations
    if plan.deepspeed and plan.fsdp:
        conflicts.append("FSDP and DeepSpeed are both enabled: pick one accelerate config")
    if o.name in WHOLE_TENSORS and (plan.fsdp or plan.zero_stage >= 1):
        what = "FSDP shards each parameter" if plan.fsdp else f"ZeRO-{plan.zero_stage} hands the optimizer flat shards"
        rule, note = WHOLE_TENSORS[o.name]
        conflicts.append(f"optim.name={o.name} needs whole parameter tensors for {rule}, but {what}{note}: use a DDP "
                         "config, or optim.name=adamw")
    if plan.kind == "pipeline" and cfg.model.architecture != "bert":
        conflicts.append(f"model.architecture={cfg.model.architecture}: the pipeline engine cuts BERT's layers only "
                         "(bert_recipes/backends/pipeline.py): use a DDP, ZeRO or FSDP config")
    from .pipeline import PIPELINE_HEADS
    if plan.kind == "pipeline" and cfg.task.kind not in PIPELINE_HEADS:
        conflicts.append(f"task.kind={cfg.task.kind}: the pipeline engine cuts the heads of {', '.join(PIPELINE_HEADS)} "
                         "only (bert_recipes/backends/pipeline.py: layer_specs): use a DDP, ZeRO or FSDP config")
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


def check_cuda_graphs(t, accum: int, replicas: int) -> None:
    """train.compile_mode=reduce-overhead (CUDA graphs) with accumulation over 1 is refused until a GPU run
    covers it: the step keeps the loss of every micro batch, and a CUDA graph's outputs are overwritten by
    its next replay (torch raises on reading one); the gradients each step's first micro batch allocates
    after zero_grad(set_to_none=True) would be allocated inside a capture. Refused on CPU processes too, so
    a recipe that passes here passes on GPUs. The mode is inductor's: dynamo's eager backends ignore it."""
    if not (t.compile and t.compile_backend == "inductor" and t.compile_mode == "reduce-overhead") or accum == 1:
        return
    whole = t.global_batch_size // replicas
    raise ConfigError(f"train.compile_mode=reduce-overhead (CUDA graphs) with accumulation {accum} "
                      f"(train.global_batch_size={t.global_batch_size} / (train.micro_batch_size={t.micro_batch_size} "
                      f"x {replicas} ranks)): "
                      "a graph's next replay overwrites the losses the step keeps, and no GPU run has covered it yet; "
                      f"set train.micro_batch_size={whole} (accumulation 1) or train.compile_mode=default")


def resolve_run(cfg: Config, plan: LaunchPlan, world_size: int, capability="local") -> LaunchPlan:
    """The plan resolved with the recipe, once, before anything is built (preflight calls it, in every
    rank and before a Make target launches): world, replicas, accumulation, precision, TF32 and the
    dropout masks, with recipe and launch files compared (check_consistency). The engines read these
    fields and never derive them again. Needs a validated config (config.validate: model.architecture
    decided), plan.on_gpu (launch_plan_here) and a numeric train.micro_batch_size (preflight.choose_micro_batch). capability: the GPU's compute capability,
    "local" (this rank's GPU) or None (a GPU not at hand, as make memory plans for: bf16 not checked).
    -> the same plan, filled in."""
    if capability == "local":
        capability = local_capability() if plan.on_gpu else None
    plan.world, plan.replicas = world_size, pipeline_replicas(plan, world_size)
    plan.accum = grad_accum_steps(cfg.train, plan.replicas)
    check_ramp(cfg.train, plan.replicas)   # train.global_batch_size_start: each stage whole micro batches on every rank
    check_cuda_graphs(cfg.train, plan.accum, plan.replicas)
    check_consistency(cfg, plan, plan.replicas, plan.accum, bool(plan.on_gpu), capability)
    plan.precision, plan.tf32 = cfg.train.mixed_precision, bool(plan.on_gpu and cfg.train.tf32)
    plan.packed_dropout = packed_dropout_here(cfg.model.dropout_impl, cfg.train.compile,
                                              "cuda" if plan.on_gpu else "cpu")
    plan.padded, plan.repeating_shapes = padded_batches(cfg.data, cfg.task), repeating_shapes(cfg)
    plan.attention_path = attention_path(cfg, plan) if documents_attend_apart(cfg) else None
    return plan


def attention_path(cfg: Config, plan: LaunchPlan) -> str:
    """How documents attend apart in this run (data.document_mask, data.unpad), decided once: attention.choose_path
    on the plan's device, precision and the model's attention dropout; what no path serves, and what a path
    cannot do (compile the varlen and flex paths, whose arguments change every batch), is one line."""
    from ..attention import choose_path
    from ..architectures import ARCHITECTURES
    dropout = cfg.model.attention_probs_dropout_prob
    default = ARCHITECTURES[cfg.model.architecture].attention_dropout
    if dropout is None:   # the checkpoint's, else a fresh config's (BERT 0.1, ModernBERT 0)
        dropout = checkpoint_attention_dropout(cfg.model.name_or_path, default) if cfg.model.name_or_path else default
    path, why = choose_path(bool(plan.on_gpu), cfg.train.mixed_precision, dropout, cfg.data.max_seq_length,
                            cfg.train.document_attention)
    if why:
        raise ConfigError(why)
    if cfg.train.compile and path != "mask":
        raise ConfigError(f"train.compile with the {path} attention path (data.document_mask or data.unpad on a GPU): "
                          "its documents' lengths change every batch, a recompile each; set train.compile=false")
    return path


def checkpoint_attention_dropout(name: str, default: float) -> float:
    """A checkpoint's attention dropout (BERT's attention_probs_dropout_prob, ModernBERT's attention_dropout; the
    architecture's default where its config cannot be read here)."""
    try:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(name)
        return float(getattr(config, "attention_probs_dropout_prob", getattr(config, "attention_dropout", default)))
    except Exception:   # noqa: BLE001 (offline, a private repo: the architecture's value)
        return default


def check_trackers(trackers: list[str]) -> list[str]:
    """The recipe's trackers, each known and installed (a missing one: the package to install, as pinned)."""
    for name in trackers:
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"logging.trackers: unknown tracker '{name}' (use tensorboard, wandb or mlflow)")
        try:
            __import__(name)
        except ImportError:
            raise ConfigError(f"logging.trackers includes '{name}' but it is not installed: pip install "
                              f"{tracker_pin(name)} (requirements-trackers.txt, which make setup installs), "
                              f"or leave '{name}' out") from None
    return list(trackers)


# logging.trackers' names -> the package that provides each (MLflow's client alone: mlflow-skinny)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


def tracker_pin(name: str) -> str:
    """The package of a tracker as requirements-trackers.txt pins it (e.g. wandb==0.31.0)."""
    package = TRACKER_PACKAGES[name]
    pins = Path(__file__).resolve().parents[2] / "requirements-trackers.txt"
    lines = pins.read_text().splitlines() if pins.is_file() else []
    return next((line.split("#")[0].strip() for line in lines if line.startswith(f"{package}==")), package)
