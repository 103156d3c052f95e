"""Dropout with cheap random bits (model.dropout_impl): torch's dropout distribution, drawn faster on CPU.

torch's CPU dropout draws one double per element from a serial Mersenne Twister (`bernoulli_`): on the
mini bench model (4 layers, hidden 256, sequence 128, batch 16) its 13 masks, 8.9M elements, took 47 ms
of a 324 ms fp32 step and 18% of the bf16 step (make bench --profile). Here one 64-bit draw gives four
16-bit words, and an element is kept when its word is at or above round(p * 65536): the keep probability
is 1 - p to within 2^-17 (0.1 -> 0.10000610), and the kept values are scaled by the inverse of the exact
keep probability, so the expectation is the input's, as with torch. Same generator (torch's default,
saved and restored with every checkpoint), so runs stay reproducible and resume exactly.

Attention dropout sits inside scaled_dot_product_attention, which on CPU falls back to its math path
whenever dropout is on; "sdpa_packed_dropout" is that math path with this mask, for BERT's bidirectional
encoder only (anything else, and eval, p = 0, goes to transformers' sdpa). One difference under bf16
autocast: torch's math path upcasts q, k, v to fp32, here the two matmuls run in bf16 (fp32 softmax),
as fused GPU kernels do. On GPUs torch's fused dropout is already cheap, so "auto" packs only CPU
tensors; under torch.compile every setting keeps torch's dropout (dynamo cannot trace `random_`, and
inductor's kernels draw their own bits).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = "sdpa_packed_dropout"


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


def _packed_here(x: torch.Tensor, impl: str) -> bool:
    if torch.compiler.is_compiling():
        return False
    return impl == "packed" or (impl == "auto" and x.device.type == "cpu")


class PackedDropout(nn.Dropout):
    """nn.Dropout whose mask comes from keep_mask on CPU (model.dropout_impl)."""

    def __init__(self, p: float, impl: str):
        super().__init__(p)
        self.impl = impl

    def forward(self, x):
        if not self.training or self.p == 0 or not _packed_here(x, self.impl):
            return F.dropout(x, self.p, self.training)
        return packed_dropout(x, self.p)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: SDPA's math path (scores, softmax, dropout, values) with the
    packed mask when dropout is on; otherwise transformers' own sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    plain = not kwargs.get("is_causal", getattr(module, "is_causal", False)) and query.shape[1] == key.shape[1]
    if not dropout or not plain or not _packed_here(query, getattr(module, "dropout_impl", "auto")):
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


def use_packed_dropout(model: nn.Module, impl: str) -> int:
    """Swap the model's nn.Dropout modules (and, for a BERT encoder with sdpa, its attention) for the packed
    ones; -> how many dropout modules. Parameters and exported weights are untouched: dropout has none,
    and the attention name is not saved with the config (an export loads as plain sdpa). Other
    architectures (a classifier from any Hub model) and BERT as a decoder keep transformers' attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)   # without it, transformers builds no padding mask
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, PackedDropout(child.p, impl))
                swapped += 1
            if hasattr(child, "is_causal") and hasattr(child, "dropout"):   # self-attention: reads dropout_impl
                child.dropout_impl = impl
    config = model.config
    if config._attn_implementation == "sdpa" and config.model_type == "bert" and not config.is_decoder:
        model.config._attn_implementation = ATTENTION
    return swapped
