"""The memory planner's model: BERT's parameters (Shape, from a model config) and the activations one
training step saves for backward (Workload -> activation_bytes), listed op by op for Hugging Face's
BertLayer, with the attention kernel each shape takes. bert_recipes/memory.py adds what each backend
keeps; tools/measure.py counts what really happens. No torch at import time."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The numbers of a model config that decide memory (its architecture's file lists the parameters:
    bert_recipes/architectures/<name>.py's `parameters`)."""
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int = 512
    type_vocab: int = 2
    num_labels: int | None = None    # None: masked LM; else a classifier of this many outputs (per_token: below)
    architecture: str = "bert"
    local: tuple[bool, ...] = ()     # ModernBERT: which layers attend within a window ...
    window: int = 0                  # ... of this many tokens on each side (|i - j| <= window)
    per_token: bool = False          # the classifier scores every token (token classification), not a sequence

    @classmethod
    def from_config(cls, config, task_kind: str) -> "Shape":
        """The shape of a model config trained for a task kind: a masked-LM kind's vocabulary head (num_labels None),
        else a head of config.num_labels outputs (bert_recipes/tasks/: the row's masked_lm)."""
        from dataclasses import replace

        from .architectures import module, of_config
        from .tasks import TASKS
        row = TASKS[task_kind]
        shape = module(of_config(config)).shape(cls, config, None if row.masked_lm else config.num_labels)
        return replace(shape, per_token=row.per_token and not row.masked_lm)

    def _architecture(self):
        from .architectures import module
        return module(self.architecture)

    def _layer(self) -> list[tuple[int, str]]:
        return self._architecture().layer_parameters(self)

    def parameters(self) -> list[tuple[int, str]]:
        """(numel, kind) of every parameter in Hugging Face's order, the tied decoder once; kind is
        'embedding', 'weight' / 'bias' (of a linear layer), 'norm' (LayerNorm) or 'vocab_bias'."""
        return self._architecture().parameters(self)

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
        """The embeddings and their LayerNorm (BERT: word, position and token-type embeddings, the first 5 entries)."""
        return sum(n for n, _ in self.parameters()[:self._architecture().EMBEDDING_ENTRIES])

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
    output_dropout: float | None = None   # the attention output's, where it has its own (ModernBERT); None: the above
    attn_implementation: str = "sdpa"
    sparse_head: bool = True
    masked_tokens: int | None = None   # mlm: rows of the sparse head; None: mlm_probability x tokens
    mlm_probability: float = 0.15
    padded: bool = False               # some attention_mask zeros (dynamic padding): sdpa gets a mask
    dropout_impl: str = "torch"        # model.dropout_impl
    compile: bool = False              # train.compile (keeps torch's dropout)
    static_head: bool = False          # mlm: K position slots a sequence (data.max_predictions_per_seq)

    def packed_dropout(self, device: str) -> bool:
        from .config import packed_dropout_here
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


def attention_bytes(work: Workload, device: str, kernel: str, B: int, scores: int, lin: int, autocast: bool,
                     mask) -> tuple[int, int]:
    """An attention's saved bytes in one layer, for every architecture's activation_bytes -> (attention, context): what the kernel saves,
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


def head_bytes(shape: Shape, work: Workload, device: str, B: int, tokens: int, lin: int, res: int, stat: int,
                autocast: bool, e: int, p_h: bool, mask) -> int:
    """A head's saved bytes, for every architecture's activation_bytes: the MLM prediction head (its rows: every position, the masked
    ones, or K slots), a token classifier, or the pooler and classifier."""
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
    elif shape.per_token:   # token classification: dropout, the classifier at every position, the loss over them
        c = shape.num_labels
        head = B * lin + (mask(B, res) if p_h else 0) + tokens * c * 4 + tokens * 8 + 4
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
    and recompute (one layer rebuilt during backward with checkpointing, else 0). Each architecture counts its own,
    op by op (bert_recipes/architectures/<name>.py: activation_bytes), with the shared kernels' and heads' terms
    here (attention_bytes, head_bytes)."""
    return shape._architecture().activation_bytes(shape, work, precision, device, checkpointing)
