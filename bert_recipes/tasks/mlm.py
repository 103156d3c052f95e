"""Masked-LM pretraining (task.kind=mlm), the whole kind behind the task contract (bert_recipes/interface.py:
`Task`): text packed into blocks (or one sequence a line), masked by MLMCollator, the architecture's masked-LM
head (its MASKED_LM class: modeling.RecipeMaskedLM's forward), the MLM loss, and evaluation's loss, perplexity and
accuracy over every masked token of every rank. The masking is a pure function of (seed, epoch, example index):
the same example is masked the same way whichever rank, worker or prefetch order reads it, which is what makes a
resumed run equal an uninterrupted one."""
from __future__ import annotations

import copy
import math
from typing import Any

import torch

from ..data.batching import _seed_of
from ..data.collate import SharedInt, _collate, documents_apart, random_bits, uniform_field
from ..config import DataConfig, TaskConfig
from ..modeling import masked_lm_loss, per_sample_mlm_loss, slot_labels
from ..data.tokenizing import map_splits, tokenizer_fingerprint


def tokenize(raw, tokenizer, task: TaskConfig, data: DataConfig):
    """-> each split's model inputs. data.packing: the split's text in a token store (bert_recipes/data/store_cache.py:
    tokenized once by datatrove into the data cache, found there by the next run), read as full blocks of
    data.max_seq_length tokens, each token's document within its block with data.document_mask (a document cut at a
    block's start goes on there as its document 0). Else each non-empty line tokenized and truncated to
    data.max_seq_length, cached by datasets' fingerprint of (data, function, tokenizer)."""
    if data.packing:
        from ..data.store_cache import stored_splits
        return stored_splits(raw, tokenizer, data)
    seq = data.max_seq_length
    columns = next(iter(raw.values())).column_names   # the training split's (a mixture: every source's, one column)

    def encode(batch):
        lines = [t for t in batch[data.text_column] if t and t.strip()]
        return tokenizer(lines, truncation=True, max_length=seq, return_special_tokens_mask=True)

    key = ["mlm", tokenizer_fingerprint(tokenizer), seq, data.packing, data.text_column]
    return map_splits(raw, encode, key, "tokenizing", data.num_proc, columns)


def notes(tokenized, task: TaskConfig) -> list[str]:
    """Lines about the tokenized data worth a user's eye: best-fit rows' padding (data.packing=best_fit)."""
    plan = getattr(tokenized.get("train"), "plan", None)
    if plan is None:
        return []
    return [f"[data] data.packing=best_fit: the training store's documents in {plan['rows']:,} rows of {plan['seq']} "
            f"tokens, {plan['padding']:.1%} of them padding (bert_recipes/data/best_fit.py)"]


# ----------------------------------------------------------------------------- the collator
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


def collator(data: DataConfig, task: TaskConfig, seed: int, tokenizer, fixed_length: int | None):
    """The run's collator. The pipeline (fixed_length) computes every position's logits: the same tokens are chosen,
    no position slots."""
    return MLMCollator(tokenizer, data.mlm_probability, seed, fixed_length=fixed_length,
                       whole_word=data.whole_word_masking, max_predictions=data.max_predictions_per_seq,
                       positions=fixed_length is None)


# ----------------------------------------------------------------------------- the model
def config_fields(task: TaskConfig) -> dict:
    """What the task sets in the model's config: nothing for MLM."""
    return {}


def head(arch):
    """The model class this kind trains on an architecture's file (bert_recipes/architectures/<name>.py); None
    for a checkpoint whose model type no architecture here builds: MLM pretraining builds its own."""
    return arch.MASKED_LM if arch is not None else None


def loss(task: TaskConfig):
    """The loss of (logits, labels) over every position, as the pipeline's last stage computes it."""
    def mlm_loss(logits, labels):
        return masked_lm_loss(logits.view(-1, logits.size(-1)), labels.view(-1))
    return mlm_loss


def trial_labels(task: TaskConfig, ids: torch.Tensor, rate: float, k: int | None, g: torch.Generator) -> dict:
    """A trial batch's labels (bert_recipes/trial.py): `rate` of the tokens chosen, or K position slots a row
    (data.max_predictions_per_seq) as the collator gives them."""
    size, length = ids.shape
    chosen = torch.rand(size, length, generator=g) < rate
    out = {}
    if k:
        positions = torch.rand(size, length, generator=g).argsort(dim=1)[:, :k].sort(dim=1).values
        chosen = torch.zeros(size, length, dtype=torch.bool).scatter_(1, positions, True)
        out["masked_positions"] = positions
    out["labels"] = torch.where(chosen, ids, -100)
    return out


# ----------------------------------------------------------------------------- evaluation
def eval_rows(task: TaskConfig, logits, labels, masked_positions=None) -> dict:
    """One evaluation batch's per-sample rows (device tensors), the same for every engine: the MLM loss sum,
    labelled tokens and hits of each sample. masked_positions: the static head's K slots (its logits have one row
    per slot)."""
    if masked_positions is not None:
        labels = slot_labels(labels, masked_positions)
    sums, counts, correct = per_sample_mlm_loss(logits, labels)
    return {"loss_sums": sums, "token_counts": counts, "correct": correct}


def metrics(task: TaskConfig, rows: dict, split=None) -> dict[str, float]:
    """The evaluation's metrics from every rank's rows, each sample once, whatever the engine: means over all
    tokens (the loss, and mlm_accuracy, the share of masked tokens predicted exactly)."""
    import numpy as np
    counts = np.asarray(rows["token_counts"])
    tokens = max(int(counts.sum()), 1)
    loss = float(np.sum(np.asarray(rows["loss_sums"], dtype=np.float64))) / tokens
    accuracy = float(np.sum(np.asarray(rows["correct"], dtype=np.float64))) / tokens
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50)), "mlm_accuracy": accuracy,
            "eval_samples": len(counts)}


def baseline(task: TaskConfig, data) -> float | None:
    """A score any model beats, for the final metrics: none for MLM."""
    return None


def card_task(task: TaskConfig) -> str:
    """The model card's task line."""
    return "masked-language-model pretraining"
