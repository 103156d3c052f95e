"""Collators: MLM masking and classification padding. MLM masking is a pure function of (seed, epoch,
example index): the same example is masked the same way whichever rank, worker or prefetch order reads it,
which is what makes a resumed run equal an uninterrupted one."""
from __future__ import annotations

import copy
from typing import Any

import torch

from .batching import _seed_of, padded_width


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
    processes that persist see what the loop sets; a copy gets its own (MLMCollator.__copy__)."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else int(getattr(obj, self.slot)[0])

    def __set__(self, obj, value: int):
        getattr(obj, self.slot)[0] = value


class MLMCollator:
    """Stacks (packed blocks) or pads a batch and masks `mlm_probability` of its non-special tokens:
    80% [MASK], 10% a random token, 10% unchanged. Labels are -100 everywhere else.

    max_predictions (K): exactly min(K, round(mlm_probability x tokens)) tokens of each sequence are
    chosen, uniformly, as BERT's create_pretraining_data does, and with `positions` the batch carries
    them as `masked_positions` (K a row, the chosen ones first in position order, then unused slots at
    0): the model's head then has static shapes and no boolean indexing (modeling.py). None: each
    token is chosen with probability mlm_probability (a count that varies per sequence).

    whole_word: words, not tokens, are chosen (a word is a WordPiece token and the "##" pieces that
    follow it), as BERT's whole-word-masking models were trained: words in a random order are taken
    while they fit in min(K, round(mlm_probability x tokens)), a word that does not fit is passed over
    for the next ones (BERT's rule), so all pieces of a word are predicted together; each chosen token
    then gets the 80/10/10 replacement.

    The masking of example i in epoch e depends only on (seed, e, i): every random number is a hash of
    those and its position (`random_bits`), computed for the whole batch at once. Set `.epoch` before each
    epoch; it lives in shared memory, so persistent DataLoader workers see it too (a copy gets its own).

    A masking rate that moves (bert_recipes/mask_rate.py): `levels` holds each level's (rate, K), the last one
    evaluation's; `.level`, in shared memory as `.epoch`, says which one masks: the loop sets it before it starts
    each level's iterator, and `evaluation_copy()` masks at evaluation's."""

    def __init__(self, tokenizer, mlm_probability: float, seed: int, pad_to_multiple_of: int | None = 8,
                 fixed_length: int | None = None, whole_word: bool = False, max_predictions: int | None = None,
                 positions: bool = True):
        self.positions = positions and bool(max_predictions)
        self.tokenizer = tokenizer
        self.pad_id, self.mask_id = tokenizer.pad_token_id, tokenizer.mask_token_id
        self.levels = [(mlm_probability, max_predictions)]   # (rate, K) a level: mask_rate.MaskSchedule's
        self._level = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.seed = seed
        self.pad_to_multiple_of = pad_to_multiple_of
        self.fixed_length = fixed_length
        self.bins: list[int] | None = None   # data.length_bins, set by the engine (fit_length_bins)
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.unpad, self.attention_path = False, None   # data.unpad and the plan's path, set by the engine
        self.vocab_size = len(tokenizer)
        self.whole_word = whole_word
        if whole_word:   # token id -> is it a "##" continuation piece?
            pieces = tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
            self.continuation = torch.tensor([p is not None and p.startswith("##") for p in pieces])

    epoch = SharedInt()   # the epoch masks are drawn for
    level = SharedInt()   # which of `levels` masks now

    @property
    def mlm_probability(self) -> float:
        return self.levels[self.level][0]

    @property
    def max_predictions(self) -> int | None:
        return self.levels[self.level][1]

    def follow(self, schedule) -> None:
        """Mask at `schedule`'s levels (a mask_rate.MaskSchedule), evaluation's last; the loop sets .level."""
        self.levels = [*schedule.levels, schedule.evaluation]

    def evaluation_copy(self):
        """The collator as evaluation and prediction use it: a copy (its own epoch), at evaluation's rate, never
        unpadded (data.unpad is for training: evaluation's rows, metrics and predictions are per sequence)."""
        other = copy.copy(self)
        other.unpad, other.level = False, len(self.levels) - 1
        return other

    def __copy__(self):
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._epoch = self._epoch.clone().share_memory_()
        other._level = self._level.clone().share_memory_()
        return other

    def _targets(self, valid: torch.Tensor) -> torch.Tensor:
        """Tokens to predict in each row: round(p x valid tokens), at least 1, at most K."""
        count = valid.sum(1)
        target = torch.round(count.double() * self.mlm_probability).long().clamp(min=1)
        if self.max_predictions:
            target = target.clamp(max=self.max_predictions)
        return torch.where(count > 0, target, torch.zeros_like(target))

    def _choose_tokens(self, valid, u) -> torch.Tensor:
        """K-exact choice: the `target` valid positions with the smallest random keys."""
        keys = torch.where(valid, u, torch.full_like(u, 2.0))
        order = keys.argsort(dim=1, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(valid.shape[1]).expand_as(order))
        return rank < self._targets(valid)[:, None]

    def _choose_words(self, ids, valid, u) -> torch.Tensor:
        """Whole-word choice (see the class docstring), all rows at once; the greedy pass over each
        row's words in random order runs over word ranks, not rows."""
        import numpy as np
        rows, n = ids.shape
        starts = valid & ~(self.continuation[ids] & torch.cat([torch.zeros(rows, 1, dtype=torch.bool), valid[:, :-1]], 1))
        word = torch.cumsum(starts.long(), 1) - 1                      # word index of each position
        word = torch.where(valid, word, torch.full_like(word, n))      # n: not a word
        lengths = torch.zeros(rows, n + 1, dtype=torch.long).scatter_add_(1, word, torch.ones_like(word))[:, :n]
        keys = torch.where(starts, u, torch.full_like(u, 2.0))        # a word's key: its first token's
        word_key = torch.full((rows, n + 1), 2.0).scatter_(1, torch.where(starts, word, n), keys)[:, :n]
        order = word_key.argsort(dim=1, stable=True).numpy()           # words in random order (no-words last)
        sorted_len = np.take_along_axis(lengths.numpy(), order, 1)
        target, taken = self._targets(valid).numpy(), np.zeros(rows, dtype=np.int64)
        take = np.zeros_like(sorted_len, dtype=bool)
        for j in range(int((lengths > 0).sum(1).max())):     # BERT's skip-and-continue, per rank
            fits = (sorted_len[:, j] > 0) & (taken + sorted_len[:, j] <= target)
            take[:, j] = fits
            taken += np.where(fits, sorted_len[:, j], 0)
            if (taken >= target).all():
                break
        chosen_word = np.zeros((rows, n + 1), dtype=bool)
        np.put_along_axis(chosen_word, order, take, 1)
        return torch.from_numpy(chosen_word).gather(1, word) & valid

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = _collate(examples, self.pad_id, self.pad_to_multiple_of, self.fixed_length, self.bins)
        special = batch.pop("special_tokens_mask").bool()
        if "attention_mask" in batch:
            special |= batch["attention_mask"] == 0
        ids, valid = batch["input_ids"], ~special
        rows = torch.tensor([e["idx"] for e in examples], dtype=torch.int64)
        # one 64-bit draw a position: 24 bits choose it, 20 bits its replacement, 20 bits a random token
        bits = random_bits(_seed_of(self.seed, self.epoch), rows, ids.shape[1])
        u, action, pick = uniform_field(bits, 40, 24), uniform_field(bits, 20, 20), uniform_field(bits, 0, 20)
        if self.whole_word:
            chosen = self._choose_words(ids, valid, u)
        elif self.max_predictions:
            chosen = self._choose_tokens(valid, u)
        else:
            chosen = (u < self.mlm_probability) & valid
        random_ids = (pick * self.vocab_size).long().clamp(max=self.vocab_size - 1)
        batch["labels"] = torch.where(chosen, ids, -100)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, ids)
        batch["input_ids"] = torch.where(chosen & (action < 0.8), self.mask_id, inputs)
        if self.positions:   # K slots a row: the chosen positions in order, then unused slots at 0
            k, n = self.max_predictions, ids.shape[1]
            slots = torch.where(chosen, torch.arange(n), n).sort(dim=1).values[:, :k]
            if slots.shape[1] < k:
                slots = torch.cat([slots, torch.full((len(slots), k - slots.shape[1]), n)], 1)
            batch["masked_positions"] = torch.where(slots < n, slots, 0)
        return documents_apart(batch, self.unpad, self.attention_path)


class ClassificationCollator:
    """Dynamic padding (to a multiple of 8 for tensor cores); labels pass through."""

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = 8, fixed_length: int | None = None):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.fixed_length = fixed_length
        self.bins: list[int] | None = None   # data.length_bins, set by the engine (fit_length_bins)
        self.epoch = 0
        self.unpad, self.attention_path = False, None   # data.unpad and the plan's path, set by the engine

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = _collate(examples, self.pad_id, self.pad_to_multiple_of, self.fixed_length, self.bins)
        return documents_apart(batch, self.unpad, self.attention_path)

    def evaluation_copy(self):
        """The collator as evaluation and prediction use it: a copy, never unpadded (data.unpad is for training)."""
        other = copy.copy(self)
        other.unpad = False
        return other


def documents_apart(batch: dict, unpad: bool, path: str | None) -> dict:
    """A batch whose documents attend apart (bert_recipes/attention.py): data.unpad's padded batch as one row of its
    real tokens (unpadded); a packed batch with document ids as it is. On the varlen path it also carries the
    documents' cumulative lengths, computed here on the host, so the step never reads the device for them."""
    if unpad:
        batch = unpadded(batch)
    if path == "varlen" and "document_ids" in batch:
        from .attention import cu_seqlens
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
