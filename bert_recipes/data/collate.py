"""Collation that every task kind's collator shares (each kind's own is in bert_recipes/tasks/<kind>.py): rows
stacked or padded into tensors, a padded batch unpadded into one row, documents kept apart, and counter-based random
bits, so a collator's draws are a pure function of (seed, epoch, example index): the same example gets the same draws
whichever rank, worker or prefetch order reads it, which is what makes a resumed run equal an uninterrupted one."""
from __future__ import annotations

import torch

from .batching import padded_width


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return value - 2 ** 64 if value >= 2 ** 63 else value


_MASK64 = [(1 << (64 - k)) - 1 for k in range(64)]   # logical right shift of an int64: (x >> k) & _MASK64[k]


def random_bits(key: int, rows: torch.Tensor, columns: int) -> torch.Tensor:
    """64 random bits (an int64) for each (row id, column), shape (len(rows), columns), each a pure
    function of (key, row id, column): splitmix64 of a counter (Steele et al. 2014), vectorised over the
    whole batch, so example i's values do not depend on which other examples share its batch, worker
    or rank."""
    counter = rows.to(torch.int64)[:, None] * columns + torch.arange(columns) + _signed((key * 0x9E3779B97F4A7C15) % 2 ** 64)
    z = counter + _signed(0x9E3779B97F4A7C15)
    z = (z ^ ((z >> 30) & _MASK64[30])) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 27) & _MASK64[27])) * _signed(0x94D049BB133111EB)
    return z ^ ((z >> 31) & _MASK64[31])


def uniform_field(bits: torch.Tensor, shift: int, width: int) -> torch.Tensor:
    """Bits shift .. shift + width - 1 of `bits` as a uniform float in [0, 1)."""
    return ((bits >> shift) & ((1 << width) - 1)).to(torch.float32) / float(1 << width)


class SharedInt:
    """An int attribute held in shared memory (a one-element tensor, `_<name>` on the instance), so DataLoader worker
    processes that persist see what the loop sets; a copy gets its own (tasks/mlm.MLMCollator.__copy__)."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else int(getattr(obj, self.slot)[0])

    def __set__(self, obj, value: int):
        getattr(obj, self.slot)[0] = value


def documents_apart(batch: dict, unpad: bool, path: str | None) -> dict:
    """A batch whose documents attend apart (bert_recipes/attention.py): data.unpad's padded batch as one row of its
    real tokens (unpadded); a packed batch with document ids as it is. On the varlen path it also carries the
    documents' cumulative lengths, computed here on the host, so the step never reads the device for them."""
    if unpad:
        batch = unpadded(batch)
    if path == "varlen" and "document_ids" in batch:
        from ..attention import cu_seqlens
        batch["cu_seqlens"], batch["max_seqlen"] = cu_seqlens(batch["document_ids"])
    return batch


def unpadded(batch: dict) -> dict:
    """A padded batch (an attention_mask) as one row of its real tokens (data.unpad): input_ids and token_type_ids
    (1, T), each token's sequence (document_ids), each sequence's first position in the row (sequence_starts: the
    classifier pools there); MLM labels (1, T), and its K slots (masked_positions) moved to the row, an unused slot
    onto its sequence's own first token ([CLS], never a label). A classification's labels stay one a sequence."""
    # rows of one length come without a mask (_collate): every token is real
    real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(batch["input_ids"], dtype=torch.bool)
    lengths = real.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths
    out = {k: batch[k][real].unsqueeze(0) for k in ("input_ids", "token_type_ids") if k in batch}
    out["document_ids"] = torch.repeat_interleave(torch.arange(len(lengths)), lengths).unsqueeze(0)
    out["sequence_starts"] = starts
    labels = batch.get("labels")
    if labels is not None and labels.dim() == 2:   # MLM: a label a token
        out["labels"] = labels[real].unsqueeze(0)
        if "masked_positions" in batch:
            out["masked_positions"] = batch["masked_positions"] + starts[:, None]
    elif labels is not None:
        out["labels"] = labels
    return out


def _collate(examples: list[dict], pad_id: int, pad_to_multiple_of: int | None, fixed_length: int | None,
             bins: list[int] | None = None) -> dict:
    """Tensors of a list of tokenized rows. Rows of one length (packed MLM blocks) are stacked as they
    are, without an attention_mask: the model then attends everywhere, and builds no mask (on a GPU,
    checking an all-ones mask makes the host wait: bert_recipes.dropout). Otherwise every row is
    padded (padded_width: to a length bin, or to the longest rounded up to `pad_to_multiple_of`), or
    to `fixed_length` (the pipeline engine needs fixed shapes), with an attention_mask. With `bins`
    every batch is padded to a bin and has a mask, even one whose rows are of one length: the model
    then sees only the bins' shapes and always the same inputs (one compiled graph per bin)."""
    import numpy as np   # numpy builds an int64 array from lists about 6x faster than torch.tensor
    lengths = [len(e["input_ids"]) for e in examples]
    columns = [k for k in examples[0] if k not in ("idx", "labels", "label")]
    if fixed_length is None and not bins and min(lengths) == max(lengths):
        batch = {k: torch.from_numpy(np.array([e[k] for e in examples], dtype=np.int64))
                 for k in columns if k != "attention_mask"}
        if "attention_mask" in columns:   # kept where it marks padding (best-fit rows' tails: the real tokens counted)
            real = np.array([e["attention_mask"] for e in examples], dtype=np.int64)
            if not real.all():
                batch["attention_mask"] = torch.from_numpy(real)
    else:
        width = fixed_length or padded_width(max(lengths), pad_to_multiple_of, bins)
        fill = {"input_ids": pad_id, "special_tokens_mask": 1}
        batch = {}
        for k in sorted(set(columns) | {"attention_mask"}):
            out = np.full((len(examples), width), fill.get(k, 0), dtype=np.int64)
            for row, (e, n) in enumerate(zip(examples, lengths)):
                out[row, :n] = e[k] if k in e else 1   # no attention_mask column: the real tokens
            batch[k] = torch.from_numpy(out)
    if "labels" in examples[0]:
        batch["labels"] = torch.tensor([e["labels"] for e in examples])
    return batch
