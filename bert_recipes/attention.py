"""Attention within documents: a packed row of several documents (data.document_mask) or a batch run unpadded as one
row (data.unpad) attends only within each document, with positions that restart at each, through one of three
paths the run's plan decides once (attention_path):

- "mask": a block-diagonal mask for SDPA (bool) or eager attention (additive float: a bool mask there was 1.2e-3
  off), built on the device from the row's document ids. The CPU path, and a GPU's with attention dropout at short
  sequences; never at long ones (a dense (batch, 1, S, S) mask at 8k tokens is 64M entries a row).
- "varlen": torch.nn.attention.varlen.varlen_attn (flash attention over cumulative sequence lengths): no compute on
  padding or across documents. CUDA only; no attention dropout; the collator hands it cu_seqlens and max_seqlen, so
  the step never reads the device for them.
- "flex": FlexAttention with a document block mask, where varlen does not serve (fp32). Its forward runs on CPU
  (tests/test_attention.py compares it with the mask path there); its backward needs a GPU.

A batch carries `document_ids` (batch, seq): each token's document within its row (the collator's, from the packer's
columns or from the unpadded sequences), and for "varlen" also `cu_seqlens` and `max_seqlen`. The model's forward
(modeling.py) turns them into positions and the path's attention arguments (document_attention). No torch at import
time: the plan's choice (choose_path) is made before a launch, in a fraction of a second.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PATHS = ("mask", "varlen", "flex")
VARLEN = "bert_recipes_varlen"   # the names they are registered under with transformers' AttentionInterface
FLEX = "bert_recipes_flex"
LONGEST_DENSE_MASK = 1024        # the mask path on a GPU serves sequences up to this length: (S x S) bools a row


def choose_path(on_gpu: bool, precision: str, attention_dropout: float, seq_len: int,
                asked: str = "auto") -> tuple[str, str | None]:
    """The attention path of a run with document masks or unpadded batches, decided once (backends.consistency):
    -> (path, why it cannot run: None where it can). auto: CPU "mask"; GPU "varlen" under bf16/fp16 without attention
    dropout (flash takes no dropout and no fp32), "flex" without attention dropout in fp32, "mask" with attention
    dropout up to LONGEST_DENSE_MASK tokens, beyond that no path (the reason says what to change). `asked`
    (train.document_attention): that path, or why it cannot run here."""
    if asked != "auto":
        return asked, cannot_run(asked, on_gpu, precision, attention_dropout, seq_len)
    if not on_gpu:
        return "mask", None
    if attention_dropout == 0:
        return ("varlen" if precision in ("bf16", "fp16") else "flex"), None
    if seq_len <= LONGEST_DENSE_MASK:
        return "mask", None
    return "mask", (f"attention dropout ({attention_dropout:g}) with document masks or unpadded batches at "
                    f"{seq_len} tokens: varlen and FlexAttention take no dropout, and a dense mask of {seq_len}^2 a row "
                    f"is refused past {LONGEST_DENSE_MASK} tokens; set model.attention_probs_dropout_prob=0 (as "
                    "ModernBERT trains), or data.max_seq_length<=1024")


def cannot_run(path: str, on_gpu: bool, precision: str, attention_dropout: float, seq_len: int) -> str | None:
    """Why train.document_attention=<path> cannot run here (None: it can)."""
    if path == "mask":
        return None if not on_gpu or seq_len <= LONGEST_DENSE_MASK else (
            f"train.document_attention=mask at {seq_len} tokens on a GPU: a dense mask of {seq_len}^2 a row is refused "
            f"past {LONGEST_DENSE_MASK} tokens; use varlen or flex (or auto)")
    if not on_gpu:
        return f"train.document_attention={path} needs a CUDA GPU; on CPUs documents attend apart through mask (or auto)"
    if attention_dropout:
        return (f"train.document_attention={path} takes no attention dropout (the model's is {attention_dropout:g}): set "
                "model.attention_probs_dropout_prob=0, or document_attention=mask (or auto)")
    if path == "varlen" and precision not in ("bf16", "fp16"):
        return ("train.document_attention=varlen (flash attention) runs in bf16 or fp16, and train.mixed_precision="
                f"{precision}: set bf16, or document_attention=flex (or auto)")
    return None


def positions_within(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (0 at each document's first token), on the ids' device, without
    reading it: the index minus the running maximum of the documents' start indices."""
    import torch
    index = torch.arange(document_ids.size(1), device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def block_mask(document_ids: torch.Tensor, dtype: torch.dtype | None, window: int | None = None) -> torch.Tensor:
    """(batch, 1, seq, seq): a token attends to the tokens of its own document (and with `window`, only to those at
    most `window` positions away). dtype None: bool (SDPA: True attends); a float dtype: additive, 0 or that
    dtype's minimum (eager attention adds it to the scores)."""
    import torch
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if window is not None:
        index = torch.arange(document_ids.size(1), device=document_ids.device)
        same = same & ((index[:, None] - index[None, :]).abs() <= window)
    if dtype is None:
        return same
    return torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill(~same, torch.finfo(dtype).min)


def cu_seqlens(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """On the host (the collator): the cumulative lengths of every document of every row, the rows flattened, as
    varlen_attn takes them (int32), and the longest document. -> (cu_seqlens, max_seqlen)."""
    import torch
    flat = document_ids.reshape(-1)
    row = torch.arange(document_ids.size(0)).repeat_interleave(document_ids.size(1))
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = (flat[1:] != flat[:-1]) | (row[1:] != row[:-1])
    edges = torch.cat([starts.nonzero().view(-1), torch.tensor([flat.numel()])])
    return edges.to(torch.int32), int((edges[1:] - edges[:-1]).max())


def document_attention(path: str, document_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype,
                       cu: torch.Tensor | None = None, longest: int | None = None, window: int | None = None) -> dict:
    """The keyword arguments the encoder takes for `path`: position_ids, and the attention mask ("mask": a 4D mask,
    which transformers hands to the attention function as it is; with `window`, a local layer's reach, also
    local_mask: within the document and at most `window` tokens apart), or what the registered attention function
    reads ("varlen": cu_seqlens and max_seqlen; "flex": the document ids, for its block mask; a local layer passes
    its window itself)."""
    positions = positions_within(document_ids)
    if path == "mask":
        mask_dtype = dtype if attn_implementation == "eager" else None
        out = {"position_ids": positions, "attention_mask": block_mask(document_ids, mask_dtype)}
        if window is not None:
            out["local_mask"] = block_mask(document_ids, mask_dtype, window)
        return out
    if path == "varlen":
        return {"position_ids": positions, "cu_seqlens": cu, "max_seqlen": longest}
    return {"position_ids": positions, "document_ids": document_ids}


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seqlens=None,
                     max_seqlen=None, **kwargs):
    """transformers' attention interface over varlen_attn: query/key/value (batch, heads, seq, dim) flattened to the
    tokens of every row, one flash call over the documents' cumulative lengths. -> ((batch, seq, heads, dim), None).
    A batch without document lengths (an evaluation's padded batch) takes the recipe's sdpa (dropout.attention)."""
    if cu_seqlens is None:
        from .dropout import attention
        return attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from torch.nn.attention.varlen import varlen_attn
    b, h, s, d = query.shape
    flat = [t.transpose(1, 2).reshape(b * s, t.size(1), d) for t in (query, key, value)]   # key/value: their heads
    reach = local_reach(kwargs)
    out = varlen_attn(*flat, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scaling,
                      window_size=(reach, reach) if reach is not None else (-1, -1),
                      enable_gqa=key.size(1) != h)   # fewer key/value heads than query heads (grouped queries)
    return out.view(b, s, h, d), None


def flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, document_ids=None,
                   **kwargs):
    """transformers' attention interface over FlexAttention with a document block mask (tokens attend within their
    document). -> ((batch, seq, heads, dim), None). A batch without document ids takes the recipe's sdpa."""
    if document_ids is None:
        from .dropout import attention
        return attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    reach = local_reach(kwargs)

    def same_document(b, h, q, kv):
        if reach is None:
            return document_ids[b, q] == document_ids[b, kv]
        return (document_ids[b, q] == document_ids[b, kv]) & ((q - kv).abs() <= reach)
    b, _, s, _ = query.shape
    mask = create_block_mask(same_document, b, None, s, s, device=query.device)
    run = compiled_flex() if query.is_cuda else flex   # uncompiled, FlexAttention runs a slow reference on a GPU
    return run(query, key, value, block_mask=mask, scale=scaling,
               enable_gqa=key.size(1) != query.size(1)).transpose(1, 2), None   # grouped queries: fewer key/value heads


def local_reach(kwargs: dict) -> int | None:
    """A local attention layer's reach, |i - j| at most this (None: a global layer). ModernBERT's layer passes
    `sliding_window` as flash attention takes it, one more than the reach (its window is inclusive)."""
    window = kwargs.get("sliding_window")
    return None if window is None else window - 1


@functools.lru_cache(maxsize=1)
def compiled_flex():
    """FlexAttention compiled once a process (its fused kernel; torch's documented use)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention as flex
    return torch.compile(flex)


def use_path(model, path: str | None) -> None:
    """The model's documents take `path` (None: the run has no document masks or unpadded batches): the model
    remembers it (its forward builds the path's arguments), and for "varlen" and "flex" the BERT encoder's attention
    becomes the path's function, registered with transformers' AttentionInterface, with the recipe's padding mask
    for the batches that have one (evaluation runs padded)."""
    model.attention_path = path
    if path not in ("varlen", "flex"):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .dropout import padding_mask
    name, function = (VARLEN, varlen_attention) if path == "varlen" else (FLEX, flex_attention)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, padding_mask)
    model.config._attn_implementation = name
