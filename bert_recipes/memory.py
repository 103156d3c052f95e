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
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

GiB = 1024 ** 3
BACKENDS = ("ddp", "zero1", "zero2", "zero2-offload", "zero3", "zero3-offload", "fsdp", "pipeline")


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Shape:
    """The numbers of a BertConfig that decide memory."""
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int = 512
    type_vocab: int = 2
    num_labels: int | None = None    # None: masked LM; else a sequence-classification head

    @classmethod
    def from_config(cls, config, task_kind: str) -> "Shape":
        return cls(config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                   config.intermediate_size, config.max_position_embeddings, config.type_vocab_size,
                   None if task_kind == "mlm" else config.num_labels)

    def _layer(self) -> list[tuple[int, str]]:
        h, i = self.hidden, self.intermediate
        attention = [(h * h, "weight"), (h, "bias")] * 4                     # Q, K, V, output projection
        mlp = [(h * i, "weight"), (i, "bias"), (i * h, "weight"), (h, "bias")]
        return attention + [(h, "norm"), (h, "norm")] + mlp + [(h, "norm"), (h, "norm")]

    def parameters(self) -> list[tuple[int, str]]:
        """(numel, kind) of every parameter in Hugging Face's order, the tied decoder once; kind is
        'embedding', 'weight' / 'bias' (of a linear layer), 'norm' (LayerNorm) or 'vocab_bias'."""
        h, v = self.hidden, self.vocab
        out = [(v * h, "embedding"), (self.max_positions * h, "embedding"), (self.type_vocab * h, "embedding"),
               (h, "norm"), (h, "norm")]
        out += self.layers * self._layer()
        if self.num_labels is None:   # the vocab bias, transform, its LayerNorm
            out += [(v, "vocab_bias"), (h * h, "weight"), (h, "bias"), (h, "norm"), (h, "norm")]
        else:                         # pooler, classifier
            out += [(h * h, "weight"), (h, "bias"), (self.num_labels * h, "weight"), (self.num_labels, "bias")]
        return out

    def param_sizes(self) -> list[int]:
        return [n for n, _ in self.parameters()]

    def optimizer_groups(self) -> list[list[int]]:
        """Parameter sizes of the optimizer's two groups, in order (bert_recipes.optim: matrices
        decay, vectors do not)."""
        params = self.parameters()
        matrix = ("embedding", "weight")
        return [[n for n, kind in params if kind in matrix], [n for n, kind in params if kind not in matrix]]

    @property
    def embedding_params(self) -> int:
        """Word, position and token-type embeddings and their LayerNorm (the first 5 entries)."""
        return sum(n for n, _ in self.parameters()[:5])

    @property
    def layer_params(self) -> int:
        return sum(n for n, _ in self._layer())

    @property
    def params(self) -> int:
        return sum(self.param_sizes())

    @property
    def small_params(self) -> int:
        """Parameters ZeRO-3 keeps whole on every rank: those at or below the persistence
        threshold (stage3_param_persistence_threshold, 10 x hidden as Accelerate sets it)."""
        return sum(n for n in self.param_sizes() if n <= 10 * self.hidden)

    @property
    def autocast_cast_params(self) -> int:
        """Parameters autocast copies to 16 bits each step: the linear layers' weights and biases,
        and the MLM decoder (the tied word-embedding matrix)."""
        linear = sum(n for n, kind in self.parameters() if kind in ("weight", "bias"))
        return linear + (self.vocab * self.hidden if self.num_labels is None else 0)


# ----------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class Workload:
    """What one micro batch looks like to the model."""
    batch: int
    seq: int
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    attn_implementation: str = "sdpa"
    sparse_head: bool = True
    masked_tokens: int | None = None   # mlm: rows of the sparse head; None: mlm_probability x tokens
    mlm_probability: float = 0.15
    padded: bool = False               # some attention_mask zeros (dynamic padding): sdpa gets a mask
    dropout_impl: str = "torch"        # model.dropout_impl
    compile: bool = False              # train.compile (keeps torch's dropout)
    static_head: bool = False          # mlm: K position slots a sequence (data.max_predictions_per_seq)

    def packed_dropout(self, device: str) -> bool:
        from .dropout import packed_dropout_here
        return packed_dropout_here(self.dropout_impl, self.compile, device)

    @property
    def predicted_rows(self) -> int:
        if not self.sparse_head:
            return self.batch * self.seq
        if self.masked_tokens is not None:
            return self.masked_tokens
        return math.ceil(self.mlm_probability * self.batch * self.seq)


def attention_kernel(work: Workload, device: str) -> str:
    """Which attention the step runs: 'fused' (flash / memory-efficient: saves q, k, v, out and a
    log-sum-exp) or 'math' (saves the s x s probabilities). On CPU, torch's fused kernel is taken
    only without attention dropout (measured, torch 2.13); on CUDA, sdpa is fused for any dropout.
    'packed': bert_recipes.dropout's math path with a packed dropout mask."""
    if work.attn_implementation == "eager":
        return "math"
    if work.attention_dropout > 0 and work.packed_dropout(device):
        return "packed"
    if device == "cuda":
        return "fused"
    return "fused" if work.attention_dropout == 0 else "math"


def _attention_bytes(work: Workload, device: str, kernel: str, B: int, scores: int, lin: int, autocast: bool,
                     mask) -> tuple[int, int]:
    """activation_bytes' attention part of one layer -> (attention, context): what the kernel saves,
    and the context copy before the output projection. B: batch x seq x hidden elements; scores:
    batch x heads x seq x seq; lin: bytes of a linear's input; mask: bytes of a dropout mask."""
    b, s, a = work.batch, work.seq, scores // (work.batch * work.seq * work.seq)
    p_a = work.attention_dropout > 0
    if kernel == "fused":                               # q, k, v, out; log-sum-exp in fp32
        # fp32 on CUDA runs the memory-efficient kernel, whose log-sum-exp pads s to a multiple of 32.
        lse_len = math.ceil(s / 32) * 32 if (device == "cuda" and lin == 4) else s
        attention = 4 * B * lin + b * a * lse_len * 4
        # The output is laid out (b, s, heads, d): the context is a view of it.
        context = 0
    elif work.attn_implementation == "eager":
        # q and k^T as contiguous copies for the matmul, the probabilities, v; with dropout its
        # mask and the dropped probabilities. CUDA autocast runs softmax in fp32, then casts the
        # probabilities back for P @ V.
        probs = 4 if (autocast and device == "cuda") else lin
        attention = 3 * B * lin + scores * probs
        if p_a:
            attention += mask(scores, probs, module=False) + scores * probs   # functional dropout: torch's
        if autocast and device == "cuda":
            attention += scores * lin
        context = B * lin                               # transpose(1, 2).contiguous()
    elif kernel == "packed":
        # q, k^T and v as contiguous copies for the matmuls, the fp32 softmax output, the bool mask and
        # the dropped probabilities (in the values' dtype); with padding, the inverted bool mask.
        attention = 3 * B * lin + scores * 4 + scores + scores * lin + (b * s * s if work.padded else 0)
        context = B * lin
    else:
        # torch's math sdpa (CPU with attention dropout) computes in fp32 whatever the inputs.
        attention = 3 * B * 4 + scores * 4 + (2 * scores * 4 if p_a else 0)
        context = B * lin                               # the reshape copy (cast under autocast)
    return attention, context


def _head_bytes(shape: Shape, work: Workload, device: str, B: int, tokens: int, lin: int, res: int, stat: int,
                autocast: bool, e: int, p_h: bool, mask) -> int:
    """activation_bytes' head part: the MLM prediction head (its rows: every position, the masked
    ones, or K slots) or the pooler and classifier."""
    b, h = work.batch, shape.hidden
    if shape.num_labels is None:
        rows = work.predicted_rows
        R = rows * h
        ln_in = 4 if (autocast and device == "cuda") else lin   # CUDA autocast runs LayerNorm in fp32
        head = (R * lin                                 # transform input
                + R * lin + R * ln_in + 2 * rows * stat  # GELU input, LayerNorm input + stats
                + R * lin                               # decoder input
                + rows * shape.vocab * 4                # log-softmax output (the loss is fp32)
                + rows * 8 + 4)                         # labels, loss
        if work.static_head:   # gather keeps the whole last hidden state (for its shape) and the K slots' index
            head += B * res + rows * 8 + 8
        elif work.sparse_head:
            head += tokens                              # the bool selection of masked positions
    else:
        c = shape.num_labels
        head = ((b * h * 2) if autocast else (B * e))   # first token: a view keeps the whole output
        head += b * h * lin + (mask(b * h, lin) + b * h * lin if p_h else 0)   # tanh out, dropout
        head += (b * 4 * 2) if c == 1 else (b * c * 4 + b * 8)                # loss inputs
        head += 4
    return head


def activation_bytes(shape: Shape, work: Workload, precision: str = "fp32", device: str = "cuda",
                     checkpointing: bool = False) -> dict[str, int]:
    """Bytes autograd saves for backward in one forward of one micro batch.

    precision: 'fp32'; 'autocast' (DDP mixed precision: fp32 weights, 16-bit matmuls); 'half'
    (a 16-bit model, as DeepSpeed's bf16/fp16 makes it and FSDP2 gathers it). Returned parts: embeddings,
    per_layer, layers (all of them, or the stored layer inputs with checkpointing), head, total,
    and recompute (one layer rebuilt during backward with checkpointing, else 0)."""
    b, s, a, i = work.batch, work.seq, shape.heads, shape.intermediate
    tokens, B, Bi, scores = b * s, b * s * shape.hidden, b * s * i, b * a * s * s
    autocast, half = precision == "autocast", precision == "half"
    e = 2 if half else 4                    # the model's dtype
    lin = 2 if autocast else e              # linear inputs and outputs
    res = 4 if autocast else e              # residual stream and LayerNorm inputs (fp32 + 16-bit -> fp32)
    stat = 4 if (device == "cuda" or not half) else 2   # LayerNorm mean and rstd
    p_h = work.hidden_dropout > 0
    packed = work.packed_dropout(device)

    def mask(elements: int, of_bytes: int, module: bool = True) -> int:
        """A dropout mask: bool on CUDA and packed (dropout modules), torch's on CPU in the input's dtype."""
        return elements * (1 if device == "cuda" or (packed and module) else of_bytes)

    # --- embeddings: input_ids and token_type_ids (int64) for the lookups, LayerNorm, dropout
    embeddings = 2 * tokens * 8 + B * res + 2 * tokens * stat + (mask(B, res) if p_h else 0)

    # --- one encoder layer
    kernel = attention_kernel(work, device)
    qkv_in = (3 if autocast else 1) * B * lin           # autocast casts the input once per linear
    attention, context = _attention_bytes(work, device, kernel, B, scores, lin, autocast, mask)
    layer = (qkv_in + attention + context
             + (mask(B, lin) if p_h else 0)
             + B * res + 2 * tokens * stat              # LayerNorm 1
             + B * lin                                  # -> intermediate
             + Bi * lin + Bi * lin                      # GELU input, its output -> output projection
             + (mask(B, lin) if p_h else 0)
             + B * res + 2 * tokens * stat)             # LayerNorm 2
    # With padding, HF passes one bool (b, 1, s, s) mask; a fused sdpa converts it on every call into
    # an additive mask in the query's dtype and saves that copy (the math path adds it and saves nothing).
    if work.padded and kernel == "fused":
        layer += b * s * (math.ceil(s / 8) * 8 if device == "cuda" else s) * lin

    # --- head
    head = _head_bytes(shape, work, device, B, tokens, lin, res, stat, autocast, e, p_h, mask)

    layers = shape.layers * (B * res if checkpointing else layer)
    if checkpointing and work.padded:   # the checkpoints also keep HF's mask, an input of every layer
        layers += b * s * s * (1 if work.attn_implementation == "sdpa" else e)
    return {"embeddings": embeddings, "per_layer": layer, "layers": layers, "head": head,
            "total": embeddings + layers + head, "recompute": layer if checkpointing else 0}


def workload_of(cfg, config=None, micro_batch: int | None = None, masked_tokens: int | None = None) -> Workload:
    """The Workload of a recipe (`cfg`: a Config), with the model config's dropout where the
    recipe keeps the checkpoint's."""
    m = cfg.model
    hidden = m.hidden_dropout_prob if m.hidden_dropout_prob is not None else getattr(config, "hidden_dropout_prob", 0.1)
    attention = (m.attention_probs_dropout_prob if m.attention_probs_dropout_prob is not None
                 else getattr(config, "attention_probs_dropout_prob", 0.1))
    from .config import predictions_per_seq
    batch, k = micro_batch or cfg.train.micro_batch_size, predictions_per_seq(cfg)
    if k is not None and masked_tokens is None:   # the static head: K slots a sequence, every one computed
        masked_tokens = batch * k
    return Workload(batch=batch, seq=cfg.data.max_seq_length, static_head=k is not None,
                    hidden_dropout=hidden, attention_dropout=attention, attn_implementation=m.attn_implementation,
                    sparse_head=m.sparse_mlm_head, masked_tokens=masked_tokens,
                    mlm_probability=cfg.data.mlm_probability, padded=cfg.task.kind == "classification",
                    dropout_impl=m.dropout_impl, compile=cfg.train.compile)


# ----------------------------------------------------------------------------- backends
@dataclass
class Plan:
    """Per-device bytes of one backend."""
    backend: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    notes: list[str] = field(default_factory=list)

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


def pipeline_stages(launch: Launch) -> int:
    return max(1, min(launch.stages, launch.world))


def replicas(backend: str, launch: Launch) -> int:
    """Data-parallel ranks: all devices, or devices / stages under the pipeline."""
    return max(1, launch.world // pipeline_stages(launch)) if backend == "pipeline" else launch.world


def planner_row(plan) -> str | None:
    """The BACKENDS row of a bert_recipes.backend.LaunchPlan: NVMe offload leaves the device as CPU
    offload does; None for a backend the planner does not model (ZeRO-0, ZeRO-1 with offload)."""
    name = plan.name.replace("-nvme", "-offload")
    return name if name in BACKENDS else None


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


def step_precision(backend: str, mixed_precision: str) -> str:
    """How a mixed-precision step computes: DDP keeps fp32 weights under 'autocast'; DeepSpeed
    runs a 16-bit model, and Accelerate's FSDP2 gathers 16-bit weights (MixedPrecisionPolicy), so
    both compute as a 'half' model (measured: the same saved tensors)."""
    if mixed_precision not in ("bf16", "fp16"):
        return "fp32"
    return "autocast" if backend == "ddp" else "half"


def plan_backend(backend: str, shape: Shape, work: Workload, launch: Launch,
                 checkpointing: bool = False) -> Plan:
    """Per-device memory of one training step of `backend` (one of BACKENDS)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}' (one of {', '.join(BACKENDS)})")
    P, n, h = shape.params, launch.world, shape.hidden
    mixed = launch.mixed_precision in ("bf16", "fp16")
    precision = step_precision(backend, launch.mixed_precision)
    k = 2 if precision == "half" else 4               # bytes per parameter and gradient element
    act = activation_bytes(shape, work, precision, launch.device, checkpointing)
    activations = act["total"] + act["recompute"]
    # The loss gradient w.r.t. the logits, fp32 and in the logits' dtype, lives at the start of backward.
    rows = work.predicted_rows if shape.num_labels is None else 0
    logits_grad = rows * shape.vocab * (4 + (2 if mixed else 4))
    autocast_copies = shape.autocast_cast_params * 2 if precision == "autocast" else 0
    reduce_bucket = launch.reduce_bucket or h * h
    notes = []

    if backend == "ddp":
        # DDP's buckets hold a second copy of every gradient (gradient_as_bucket_view=False);
        # a single process runs without DDP.
        buckets = 4 * P if n > 1 else 0
        return Plan(backend, 4 * P, 4 * P, 8 * P, activations, buckets + autocast_copies + logits_grad,
                    ["buckets: a second fp32 copy of the gradients"] if n > 1 else [])
    if backend in ("zero1", "zero2", "zero2-offload"):
        shard = math.ceil(P / n)
        # ZeRO-1/2 clone an fp32 master partition even of an fp32 model (stage_1_and_2.py).
        optimizer = 0 if backend.endswith("offload") else shard * (4 + 8)
        # The rank's gradient partition (on CPU when offloaded). ZeRO-2's buffer holds every
        # parameter that overlaps the partition in full, so a boundary inside the word embeddings
        # costs a rank up to a whole embedding matrix. ZeRO-1 holds the full gradients during
        # backward until it reduces them at the end.
        if backend == "zero1":
            gradients = k * shard
        else:
            gradients = 0 if backend.endswith("offload") else k * zero2_grad_partition(shape.optimizer_groups(), n)
        # overlap_comm: two reduce buckets; the step casts the gradient shard to fp32.
        temporary = 2 * reduce_bucket * k + logits_grad + (4 * shard if k == 2 else 0)
        if backend == "zero1":
            temporary += k * P
        if backend.endswith("offload"):
            notes.append(f"host RAM: {fmt(shard * 16)} fp32 gradient partition, master and moments per rank")
        return Plan(backend, k * P, gradients, optimizer, activations, temporary, notes)
    if backend in ("zero3", "zero3-offload"):
        small = shape.small_params
        shard = math.ceil(P / n)
        offload = backend.endswith("offload")
        parameters = 0 if offload else k * (shard + small)   # small params also stay whole (persistence)
        # An fp32 master partition always: DeepSpeed 0.19's "share it when already fp32" test
        # compares a torch.device with a str and never holds.
        optimizer = 0 if offload else shard * (4 + 8)
        gradients = 0 if offload else k * shard
        # Gathered weights: the layer running and the prefetched one, plus the prefetch bucket.
        gathered = 2 * shape.layer_params * k + (launch.prefetch_bucket or int(0.9 * h * h)) * k
        temporary = gathered + 2 * reduce_bucket * k + logits_grad
        if offload:
            notes.append(f"host RAM: {fmt(shard * (k + 16))} params, fp32 gradients, master and moments per rank")
        return Plan(backend, parameters, gradients, optimizer, activations, temporary, notes)
    if backend == "fsdp":
        # fp32 shards of weights, gradients and moments; unsharded while they run: the layer running
        # and the prefetched one (in the compute dtype), and one layer's gradients before the
        # reduce-scatter.
        shard = math.ceil(P / n)
        temporary = 2 * shape.layer_params * k + shape.layer_params * 4 + logits_grad
        return Plan(backend, 4 * shard, 4 * shard, 8 * shard, activations, temporary)
    return _plan_pipeline(backend, shape, work, launch, act, precision, k, logits_grad)


def _plan_pipeline(backend: str, shape: Shape, work: Workload, launch: Launch, act: dict, precision: str, k: int,
                   logits_grad: int) -> Plan:
    """plan_backend's pipeline row: stages x data-parallel replicas. The first stage holds the
    embeddings and, in 1F1B, up to `stages` micro batches in flight; the last holds the head, the tied
    copy of the word embeddings (the MLM decoder) and one micro batch. The larger of the two decides."""
    P, h = shape.params, shape.hidden
    stages, dp = pipeline_stages(launch), replicas(backend, launch)
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
             f"{in_flight} micro batches in flight on the first"]
    if launch.pipeline_zero >= 1:   # ZeRO-1 over the replicas (ds_configs/pipeline.json), as zero1 above
        return Plan(backend, k * stage_params, k * shard, shard * (4 + 8), activations,
                    boundary + k * stage_params + logits_grad, notes)
    # Without ZeRO: torch AdamW on fp32 weights, or DeepSpeed's BF16_Optimizer (fp32 gradient
    # accumulation, fp32 master and moments partitioned over the replicas).
    optimizer = 8 * stage_params if precision == "fp32" else shard * 12
    return Plan(backend, k * stage_params, 4 * stage_params, optimizer, activations, boundary + logits_grad, notes)


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


# ----------------------------------------------------------------------------- measurement
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


def predict_run(cfg, model_config, plan, world: int, device: str, accum: int = 1,
                masked_tokens: int | None = None) -> Plan | None:
    """The plan of a running train.py: its recipe and model under the LaunchPlan it runs; None for
    a backend the planner does not model."""
    row = planner_row(plan)
    if row is None:
        return None
    launch = launch_of(plan, world, cfg.train.mixed_precision, device, accum)
    return plan_backend(row, Shape.from_config(model_config, cfg.task.kind),
                        workload_of(cfg, model_config, masked_tokens=masked_tokens), launch,
                        cfg.model.gradient_checkpointing)


def describe_plan(plan: Plan) -> str:
    return (f"params {fmt(plan.parameters)}, grads {fmt(plan.gradients)}, optimizer {fmt(plan.optimizer)}, "
            f"activations {fmt(plan.activations)}, temporary {fmt(plan.temporary)} = peak {fmt(plan.peak)}")


# ----------------------------------------------------------------------------- train.micro_batch_size: auto
MARGIN_SHARE, MARGIN_BYTES = 0.10, 2 * 2 ** 30   # kept free: fragmentation, NCCL buffers, compile's pools


def auto_micro_batch(cfg, model_config, plan, world: int, free_bytes: int, total_bytes: int) -> tuple[int, str]:
    """The largest micro batch that divides global batch / data-parallel ranks and whose predicted peak
    (this planner: within 10% of an H200's measured peaks at micro 32, not checked at larger batches)
    fits `free_bytes` less a margin of 10% of the GPU and 2 GiB (the CUDA context is already outside
    free memory). -> (micro batch, the one-line reason). Pure arithmetic: the run passes what
    torch.cuda.mem_get_info() says."""
    import copy

    from .backend import pipeline_replicas
    from .config import ConfigError
    replicas = pipeline_replicas(plan, world)
    per_rank = cfg.train.global_batch_size // replicas
    if cfg.train.global_batch_size % replicas:
        raise ConfigError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by the "
                          f"{replicas} data-parallel ranks: train.micro_batch_size=auto needs a global batch that is")
    budget = free_bytes - MARGIN_SHARE * total_bytes - MARGIN_BYTES
    tried = []
    for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        trial = copy.deepcopy(cfg)
        trial.train.micro_batch_size = micro
        predicted = predict_run(trial, model_config, plan, world, "cuda", per_rank // micro)
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
