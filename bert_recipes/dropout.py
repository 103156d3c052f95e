"""BERT's attention and dropout as the run uses them (bert_recipes.models.build_model applies this).

Every BERT or ModernBERT encoder with sdpa gets the attention "bert_recipes_sdpa": transformers' sdpa, with a padding
mask built without reading it on the host. transformers' own mask builder asks `padding_mask.all()`
before each forward (to skip an all-ones mask), which makes the host wait for the GPU; here a batch
without padding comes without an attention_mask (packed MLM: tasks/mlm.MLMCollator) and gets no mask, and a
padded one gets its mask built unconditionally.

model.dropout_impl: packed (CPU only, an opt-in): dropout masks with cheap random bits. torch's CPU
dropout draws one double per element from a serial Mersenne Twister (`bernoulli_`): on the mini bench
model (4 layers, hidden 256, sequence 128, batch 16) its 13 masks, 8.9M elements, took 47 ms of a 324 ms
fp32 step and 18% of the bf16 step (make bench --profile). Here one 64-bit draw gives four 16-bit words,
and an element is kept when its word is at or above round(p * 65536): the keep probability is 1 - p to
within 2^-17 (0.1 -> 0.10000610), and the kept values are scaled by the inverse of the exact keep
probability, so the expectation is the input's, as with torch. Same generator (torch's default, saved and
restored with every checkpoint), so runs stay reproducible and resume exactly. Attention dropout sits
inside scaled_dot_product_attention, which on CPU falls back to its math path whenever dropout is on; with
packed masks the attention is that math path with this mask, for BERT's bidirectional encoder only
(anything else, and eval, p = 0, goes to transformers' sdpa). One difference under bf16 autocast: torch's
math path upcasts q, k, v to fp32, here the two matmuls run in bf16 (fp32 softmax), as fused GPU kernels
do. On GPUs torch's fused dropout is already cheap: packed is refused there (bert_recipes.preflight), and
under torch.compile it is not used (dynamo cannot trace `random_`, and inductor's kernels draw their own
bits). `config.packed_dropout_here` is the one answer, for the run and for the memory planner.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = "bert_recipes_sdpa"


def keep_mask(shape, p: float, device) -> tuple[torch.Tensor, float]:
    """-> (bool mask, True with probability 1 - round(p * 2^16) / 2^16; the scale 1 / that probability)."""
    numel = math.prod(shape)
    threshold = round(p * 65536)
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device).random_(-2 ** 63, None)
    bits = words.view(torch.int16)[:numel].view(shape)          # four uniform int16 per draw
    return bits >= threshold - 32768, 65536 / (65536 - threshold)


def packed_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    if round(p * 65536) >= 65536:   # p within 2^-17 of 1: nothing kept (and no int16 threshold exists)
        return x * 0
    mask, scale = keep_mask(x.shape, p, x.device)
    return x.mul(mask).mul_(scale)   # autograd keeps the mask (mul's backward), not x


class PackedDropout(nn.Dropout):
    """nn.Dropout whose mask comes from keep_mask (model.dropout_impl=packed)."""

    def forward(self, x):
        if not self.training or self.p == 0 or torch.compiler.is_compiling():
            return F.dropout(x, self.p, self.training)
        return packed_dropout(x, self.p)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: SDPA's math path (scores, softmax, dropout, values) with the
    packed mask when dropout is on; otherwise transformers' own sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    plain = not kwargs.get("is_causal", getattr(module, "is_causal", False)) and query.shape[1] == key.shape[1]
    if not (dropout and plain and getattr(module, "packed_dropout", False)) or torch.compiler.is_compiling():
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(scale)
    if attention_mask is not None and attention_mask.dtype == torch.bool:   # sdpa's mask: True attends
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    # softmax in fp32 whatever the matmuls ran in (bf16 under autocast); the values' matmul in their dtype
    probs = packed_dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def padding_mask(*args, attention_mask=None, **kwargs):
    """transformers' sdpa mask for a bidirectional encoder, without reading the padding mask on the
    host: no padding mask, no mask (a batch without padding); else the mask, built every time."""
    from transformers.masking_utils import sdpa_mask
    if attention_mask is None and kwargs.get("local_size") is None:
        return None
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_recipe_attention(model: nn.Module, packed: bool) -> int:
    """A BERT encoder with sdpa gets the attention "bert_recipes_sdpa" (see the module docstring); with
    `packed` (packed_dropout_here) its nn.Dropout modules draw packed masks, and so does its attention.
    -> how many dropout modules were swapped. Parameters and exported weights are untouched: dropout
    has none, and the attention name is not saved with the config (an export loads as plain sdpa).
    Other architectures than bert_recipes/architectures/' (a classifier from any Hub model) and BERT as a decoder
    keep transformers' attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, padding_mask)   # without a mask function, transformers builds none
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if packed and type(child) is nn.Dropout:
                setattr(parent, name, PackedDropout(child.p))
                swapped += 1
            if hasattr(child, "is_causal") and hasattr(child, "dropout"):   # self-attention: reads packed_dropout
                child.packed_dropout = packed
    from .architectures import of_model_type
    config = model.config
    if (config._attn_implementation == "sdpa" and of_model_type(config.model_type)
            and not getattr(config, "is_decoder", False)):
        model.config._attn_implementation = ATTENTION
    return swapped
