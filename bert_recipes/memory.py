"""Memory planner: per-device bytes of a BERT training step, for each backend, before launch.

    peak ~ parameters + gradients + optimizer states + activations + temporary buffers

Model states follow what each backend allocates (torch AdamW keeps two fp32 moments; DeepSpeed's
ZeRO keeps an fp32 master partition as well, even of an fp32 model). Activations
are the tensors autograd saves for backward, listed op by op for Hugging Face's BertLayer, which is
what `measure_activations` counts with `torch.autograd.graph.saved_tensors_hooks`. Existing
estimators (`accelerate estimate-memory`, DeepSpeed's `estimate_zero*`) stop at model states; for
BERT at sequence 512 the activations are most of the step.

tests/test_memory.py checks every component against measurement (tensors after a real step with 2
processes for the ZeRO stages; saved tensors for activations) within 10%. Temporary buffers
(communication buckets, autocast weight copies, the logits' gradient, ZeRO-3's gathered layer) are
estimated from the backends' settings; only a GPU allocator can measure them (tools/memory.py
--measure reports torch.cuda.max_memory_allocated next to the predicted peak).

The model and its activations: bert_recipes/activations.py; the measurement: tools/measure.py.
No torch at import time (make memory plans in a fraction of a second).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .activations import Shape, Workload, activation_bytes
from .tasks import TASKS

if TYPE_CHECKING:
    from .config import Config

GiB = 1024 ** 3


MODELLED_KINDS = ("ddp", "fsdp", "deepspeed", "pipeline")   # LaunchPlan.kind's: plan_backend has a branch for each


@dataclass(frozen=True)
class States:
    """How a backend holds the model states, the planner's one input from the launch files: the engine kind
    (ddp | fsdp | deepspeed | pipeline: LaunchPlan.kind), the ZeRO stage and where ZeRO offloads them (none | cpu
    | nvme: either way the device holds none of them). A launch config is planned by what it asks for, never by
    its row's name; `name` is the kind's (LaunchPlan.name's vocabulary), for the planner's lines."""
    kind: str
    zero_stage: int = 0
    offload: str = "none"

    @property
    def offloaded(self) -> bool:
        return self.offload != "none"

    @property
    def name(self) -> str:
        if self.kind != "deepspeed":
            return self.kind
        return f"zero{self.zero_stage}" + {"none": "", "cpu": "-offload", "nvme": "-nvme"}[self.offload]


def states_of(plan) -> States | None:
    """The States of a bert_recipes.backends.plan.LaunchPlan; None for what the planner does not model (ZeRO-0,
    ZeRO-1 with offload, a kind it does not know: its lines then say "not modelled")."""
    if plan.kind not in MODELLED_KINDS:
        return None
    deepspeed = plan.kind == "deepspeed"
    states = States(plan.kind, plan.zero_stage if plan.kind in ("deepspeed", "pipeline") else 0,
                    plan.offload if deepspeed else "none")
    if deepspeed and (states.zero_stage == 0 or (states.zero_stage == 1 and states.offloaded)):
        return None
    return states


@dataclass
class Plan:
    """Per-device bytes of one backend."""
    backend: str          # the kind's name (States.name)
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    notes: list[str] = field(default_factory=list)
    host: int = 0   # bytes of host RAM a rank holds for offloaded states (CPU and NVMe offload rows)

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporary


@dataclass(frozen=True)
class Launch:
    """How the step runs: world size, precision and the backend's bucket settings."""
    world: int = 1
    mixed_precision: str = "no"          # no | bf16 | fp16
    device: str = "cuda"
    stages: int = 2                      # pipeline stages
    micro_batches: int = 1               # pipeline: micro batches per step (the accumulation)
    pipeline_zero: int = 1               # pipeline: the JSON's ZeRO stage (0 or 1)
    reduce_bucket: int | None = None     # DeepSpeed reduce_bucket_size (elements); None: Accelerate's hidden^2
    prefetch_bucket: int | None = None   # DeepSpeed stage3_prefetch_bucket_size; None: 0.9 hidden^2


def bubble_line(stages: int, micro_batches: int) -> str:
    """The pipeline's idle share in 1F1B: (stages - 1) / (micro batches + stages - 1) of a step, each stage
    waiting while the first micro batch fills the pipe and the last drains it. Over 25%, the accumulation
    (micro batches a step) that brings it under: m >= 3 (stages - 1)."""
    share = (stages - 1) / (micro_batches + stages - 1)
    line = (f"pipeline bubble: (stages - 1) / (micro batches + stages - 1) = {stages - 1}/{micro_batches + stages - 1}"
            f" = {share:.0%} of each step idle")
    if share > 0.25:
        line += (f"; accumulation {3 * (stages - 1)} or more (a smaller micro batch, same global batch) brings it "
                 "under 25%")
    return line


def pipeline_stages(launch: Launch) -> int:
    return max(1, min(launch.stages, launch.world))


def replicas(states: States, launch: Launch) -> int:
    """Data-parallel ranks: all devices, or devices / stages under the pipeline."""
    return max(1, launch.world // pipeline_stages(launch)) if states.kind == "pipeline" else launch.world


def _numeric(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None   # "auto": unset


def launch_of(plan, world: int, precision: str, device: str, micro_batches: int = 1) -> Launch:
    """The Launch of a LaunchPlan: world size, precision, device and the DeepSpeed JSON's settings."""
    ds = plan.ds_config
    zero = ds.get("zero_optimization", {})
    return Launch(world=world, mixed_precision=precision, device=device, micro_batches=micro_batches,
                  stages=int(ds.get("pipeline", {}).get("stages", 2)),
                  pipeline_zero=plan.zero_stage if plan.pipeline else 1,
                  reduce_bucket=_numeric(zero.get("reduce_bucket_size")),
                  prefetch_bucket=_numeric(zero.get("stage3_prefetch_bucket_size")))


def step_precision(states: States, mixed_precision: str) -> str:
    """How a mixed-precision step computes: DDP keeps fp32 weights under 'autocast'; DeepSpeed
    runs a 16-bit model, and Accelerate's FSDP2 gathers 16-bit weights (MixedPrecisionPolicy), so
    both compute as a 'half' model (measured: the same saved tensors)."""
    if mixed_precision not in ("bf16", "fp16"):
        return "fp32"
    return "autocast" if states.kind == "ddp" else "half"


def plan_backend(states: States, shape: Shape, work: Workload, launch: Launch,
                 checkpointing: bool = False) -> Plan:
    """Per-device memory of one training step of a backend that holds its states as `states` says."""
    P, n, h = shape.params, launch.world, shape.hidden
    mixed = launch.mixed_precision in ("bf16", "fp16")
    precision = step_precision(states, launch.mixed_precision)
    k = 2 if precision == "half" else 4               # bytes per parameter and gradient element
    act = activation_bytes(shape, work, precision, launch.device, checkpointing)
    activations = act["total"] + act["recompute"]
    # The loss gradient w.r.t. the logits, fp32 and in the logits' dtype, lives at the start of backward.
    rows = work.predicted_rows if shape.num_labels is None else 0
    logits_grad = rows * shape.vocab * (4 + (2 if mixed else 4))
    autocast_copies = shape.autocast_cast_params * 2 if precision == "autocast" else 0
    reduce_bucket = launch.reduce_bucket or h * h
    notes, name, offload, stage = [], states.name, states.offloaded, states.zero_stage

    if states.kind == "ddp":
        # DDP's buckets hold a second copy of every gradient (gradient_as_bucket_view=False);
        # a single process runs without DDP.
        buckets = 4 * P if n > 1 else 0
        return Plan(name, 4 * P, 4 * P, 8 * P, activations, buckets + autocast_copies + logits_grad,
                    ["buckets: a second fp32 copy of the gradients"] if n > 1 else [])
    if states.kind == "deepspeed" and stage in (1, 2):
        shard = math.ceil(P / n)
        # ZeRO-1/2 clone an fp32 master partition even of an fp32 model (stage_1_and_2.py).
        optimizer = 0 if offload else shard * (4 + 8)
        # The rank's gradient partition (on CPU when offloaded). ZeRO-2's buffer holds every
        # parameter that overlaps the partition in full, so a boundary inside the word embeddings
        # costs a rank up to a whole embedding matrix. ZeRO-1 holds the full gradients during
        # backward until it reduces them at the end.
        if stage == 1:
            gradients = k * shard
        else:
            gradients = 0 if offload else k * zero2_grad_partition(shape.optimizer_groups(), n)
        # overlap_comm: two reduce buckets; the step casts the gradient shard to fp32.
        temporary = 2 * reduce_bucket * k + logits_grad + (4 * shard if k == 2 else 0)
        if stage == 1:
            temporary += k * P
        host = shard * 16 if offload else 0
        if host:
            notes.append(f"{where_offloaded(states)}: {fmt(host)} fp32 gradient partition, master and moments per rank")
        return Plan(name, k * P, gradients, optimizer, activations, temporary, notes, host)
    if states.kind == "deepspeed":   # ZeRO-3
        small = shape.small_params
        shard = math.ceil(P / n)
        parameters = 0 if offload else k * (shard + small)   # small params also stay whole (persistence)
        # An fp32 master partition always: DeepSpeed 0.19's "share it when already fp32" test
        # compares a torch.device with a str and never holds.
        optimizer = 0 if offload else shard * (4 + 8)
        gradients = 0 if offload else k * shard
        # Gathered weights: the layer running and the prefetched one, plus the prefetch bucket.
        gathered = 2 * shape.layer_params * k + (launch.prefetch_bucket or int(0.9 * h * h)) * k
        temporary = gathered + 2 * reduce_bucket * k + logits_grad
        host = shard * (k + 16) if offload else 0
        if host:
            notes.append(f"{where_offloaded(states)}: {fmt(host)} params, fp32 gradients, master and moments per rank")
        return Plan(name, parameters, gradients, optimizer, activations, temporary, notes, host)
    if states.kind == "fsdp":
        # fp32 shards of weights, gradients and moments; unsharded while they run: the layer running
        # and the prefetched one (in the compute dtype), and one layer's gradients before the
        # reduce-scatter.
        shard = math.ceil(P / n)
        temporary = 2 * shape.layer_params * k + shape.layer_params * 4 + logits_grad
        return Plan(name, 4 * shard, 4 * shard, 8 * shard, activations, temporary)
    if states.kind != "pipeline":
        raise ValueError(f"the planner does not model the {states.kind} kind (memory.MODELLED_KINDS)")
    return _plan_pipeline(states, shape, work, launch, act, precision, k, logits_grad)


def _plan_pipeline(states: States, shape: Shape, work: Workload, launch: Launch, act: dict, precision: str, k: int,
                   logits_grad: int) -> Plan:
    """plan_backend's pipeline row: stages x data-parallel replicas. The first stage holds the
    embeddings and, in 1F1B, up to `stages` micro batches in flight; the last holds the head, the tied
    copy of the word embeddings (the MLM decoder) and one micro batch. The larger of the two decides."""
    P, h, backend = shape.params, shape.hidden, states.name
    stages, dp = pipeline_stages(launch), replicas(states, launch)
    per_stage = math.ceil(shape.layers / stages)
    head = P - shape.embedding_params - shape.layers * shape.layer_params
    first = shape.embedding_params + per_stage * shape.layer_params
    last = per_stage * shape.layer_params + head + (shape.vocab * h if shape.num_labels is None else 0)
    stage_params = P if stages == 1 else max(first, last)
    in_flight = min(stages, launch.micro_batches)
    layer_act = act["layers"] // shape.layers
    first_acts = in_flight * (act["embeddings"] + per_stage * layer_act)
    last_acts = per_stage * layer_act + act["head"]
    activations = (max(first_acts, last_acts) if stages > 1 else act["total"]) + act["recompute"]
    boundary = 2 * work.batch * work.seq * h * k * in_flight   # activations sent and received
    shard = math.ceil(stage_params / dp)
    notes = [f"{stages} stages x {dp} replicas; the largest stage holds {fmt(k * stage_params)} of weights, "
             f"{in_flight} micro batches in flight on the first"] + ([bubble_line(stages, launch.micro_batches)]
                                                                      if stages > 1 else [])
    if launch.pipeline_zero >= 1:   # ZeRO-1 over the replicas (ds_configs/pipeline.json), as zero1 above
        return Plan(backend, k * stage_params, k * shard, shard * (4 + 8), activations,
                    boundary + k * stage_params + logits_grad, notes)
    # Without ZeRO: torch AdamW on fp32 weights, or DeepSpeed's BF16_Optimizer (fp32 gradient
    # accumulation, fp32 master and moments partitioned over the replicas).
    optimizer = 8 * stage_params if precision == "fp32" else shard * 12
    return Plan(backend, k * stage_params, 4 * stage_params, optimizer, activations, boundary + logits_grad, notes)


def where_offloaded(states: States) -> str:
    """Where the offloaded states live, as the planner's note says it (Plan.host counts their bytes)."""
    return "host RAM" if states.offload == "cpu" else "NVMe (host RAM holds DeepSpeed's swap buffers)"


def zero2_grad_partition(groups: list[list[int]], world: int) -> int:
    """Elements of the largest ZeRO-2 gradient buffer over the ranks: per optimizer group, the
    flat group (padded to 2 x world) is cut into equal partitions, and a rank's buffer sums the
    full size of every parameter overlapping its partition (stage_1_and_2.py)."""
    per_rank = [0] * world
    for sizes in groups:
        padded = math.ceil(sum(sizes) / (2 * world)) * 2 * world
        part, start = padded // world, 0
        for n in sizes:
            for rank in range(world):
                if start < (rank + 1) * part and start + n > rank * part:
                    per_rank[rank] += n
            start += n
    return max(per_rank)


def fmt(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f} GiB" if n_bytes >= GiB / 10 else f"{n_bytes / 2 ** 20:.1f} MiB"


def workload_of(cfg: Config, config=None, micro_batch: int | None = None, masked_tokens: int | None = None) -> Workload:
    """The Workload of a recipe (`cfg`: a Config), with the model config's dropout where the recipe keeps the
    checkpoint's (its architecture's fields: bert_recipes/architectures/<name>.py's `dropouts`)."""
    from .architectures import module, of_config
    from .config import predictions_per_seq
    from .mask_rate import largest
    m = cfg.model
    kept = module(of_config(config)).dropouts(config) if config is not None else (0.1, 0.1, None)
    hidden = m.hidden_dropout_prob if m.hidden_dropout_prob is not None else kept[0]
    attention = m.attention_probs_dropout_prob if m.attention_probs_dropout_prob is not None else kept[1]
    output = m.attention_output_dropout if m.attention_output_dropout is not None else kept[2]
    rate, k = largest(cfg.data, predictions_per_seq(cfg))   # a masking rate that moves: memory for its largest level
    batch = micro_batch or cfg.train.micro_batch_size
    if k is not None and masked_tokens is None:   # the static head: K slots a sequence, every one computed
        masked_tokens = batch * k
    return Workload(batch=batch, seq=cfg.data.max_seq_length, static_head=k is not None,
                    hidden_dropout=hidden, attention_dropout=attention, output_dropout=output,
                    attn_implementation=m.attn_implementation,
                    sparse_head=m.sparse_mlm_head, masked_tokens=masked_tokens,
                    mlm_probability=rate, padded=not TASKS[cfg.task.kind].masked_lm,
                    dropout_impl=m.dropout_impl, compile=cfg.train.compile)


def predict_run(cfg: Config, model_config, plan, world: int, device: str, accum: int = 1,
                masked_tokens: int | None = None, micro_batch: int | None = None) -> Plan | None:
    """The plan of a running train.py: its recipe and model under the LaunchPlan it runs (micro_batch: another
    than train.micro_batch_size, as train.micro_batch_size=auto tries); None for a backend the planner does not
    model."""
    states = states_of(plan)
    if states is None:
        return None
    launch = launch_of(plan, world, cfg.train.mixed_precision, device, accum)
    return plan_backend(states, Shape.from_config(model_config, cfg.task.kind),
                        workload_of(cfg, model_config, micro_batch=micro_batch, masked_tokens=masked_tokens), launch,
                        cfg.model.gradient_checkpointing)


def describe_plan(plan: Plan) -> str:
    return (f"params {fmt(plan.parameters)}, grads {fmt(plan.gradients)}, optimizer {fmt(plan.optimizer)}, "
            f"activations {fmt(plan.activations)}, temporary {fmt(plan.temporary)} = peak {fmt(plan.peak)}")


# ----------------------------------------------------------------------------- train.micro_batch_size: auto
MARGIN_SHARE, MARGIN_BYTES = 0.10, 2 * 2 ** 30   # kept free: fragmentation, NCCL buffers, compile's pools


def auto_micro_batch(cfg: Config, model_config, plan, world: int, free_bytes: int, total_bytes: int) -> tuple[int, str]:
    """The largest micro batch that divides global batch / data-parallel ranks and whose predicted peak
    (this planner: within 10% of an H200's measured peaks at micro 32, not checked at larger batches)
    fits `free_bytes` less a margin of 10% of the GPU and 2 GiB (the CUDA context is already outside
    free memory). -> (micro batch, the one-line reason). Pure arithmetic: the run passes what
    torch.cuda.mem_get_info() says."""
    from .backends.plan import pipeline_replicas
    from .config import ConfigError
    replicas = pipeline_replicas(plan, world)
    per_rank = cfg.train.global_batch_size // replicas
    if cfg.train.global_batch_size % replicas:
        raise ConfigError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by the "
                          f"{replicas} data-parallel ranks: train.micro_batch_size=auto needs a global batch that is")
    budget = free_bytes - MARGIN_SHARE * total_bytes - MARGIN_BYTES
    tried = []
    for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        predicted = predict_run(cfg, model_config, plan, world, "cuda", per_rank // micro, micro_batch=micro)
        if predicted is None:
            raise ConfigError(f"train.micro_batch_size=auto: the memory planner does not model the {plan.name} "
                              "backend; set a number (make memory estimates it)")
        if predicted.peak <= budget:
            bigger = f"; {tried[-1][0]} would need {fmt(tried[-1][1])}" if tried else " (the whole per-rank batch)"
            return micro, (f"[config] train.micro_batch_size=auto -> {micro}: the largest divisor of {per_rank} (global "
                           f"{cfg.train.global_batch_size} / {replicas} ranks) whose predicted peak, {fmt(predicted.peak)}, "
                           f"fits {fmt(free_bytes)} free less a margin of {MARGIN_SHARE:.0%} of {fmt(total_bytes)} "
                           f"and {fmt(MARGIN_BYTES)}{bigger}; accumulation {per_rank // micro}")
        tried.append((micro, predicted.peak))
    raise ConfigError(f"train.micro_batch_size=auto: even a micro batch of 1 is predicted to need {fmt(tried[-1][1])}, "
                      f"more than the {fmt(max(budget, 0))} usable of {fmt(free_bytes)} free on this GPU; see make "
                      "memory for a backend or gradient checkpointing that fits")
