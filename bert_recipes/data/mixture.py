"""data.mixture: pretraining sources sampled by weight, in an order that is arithmetic on the position in the run.

The run reads one stream of sequences, cut into epochs of N positions, N = every source's training sequences (the
count an epoch has without a mix: steps per epoch and train.epochs mean what they did). Each block of BLOCK positions
gives each source its slots, round(BLOCK x its share of the weights) (largest remainders, at least one a source), in
an order shuffled by (seed, block). A source's k-th position reads its pass k // n (n: its training sequences), in
that pass's own shuffle of its rows, (seed, source, pass): a source that runs out starts its next pass. Which source a
position reads, how many positions each source had before it and which row it reads are all computed from the
position, never replayed: a resume seeks to it on any process count, as the run without a mix does.

Row ids: position reading row r of source s in its pass p carries the id p x N + offset_s + r (offset_s: where s
starts in the joined training split). batching.Indexed reads row id mod N and the MLM collator masks by the id, so
a source's second pass masks its rows anew. Each source's evaluation rows are evaluated on their own
(<name>/eval_loss); the overall metrics are those of all of them together.

The run reads whole full-size steps an epoch (bert_recipes/batch_ramp.py), the first `read` positions of each epoch's N:
what the run reports (the sequences and tokens each source gave, where a pass starts) counts the positions it read."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .batching import _seed_of, sequence_lengths
from .collate import random_bits

BLOCK = 1000   # positions a block: each source's share of a block is exact to 1/BLOCK


@dataclass(frozen=True)
class Mixture:
    names: tuple[str, ...]
    weights: tuple[float, ...]   # as the recipe gives them
    sizes: tuple[int, ...]       # training sequences a source
    eval_sizes: tuple[int, ...]
    tokens: tuple[float, ...]    # mean tokens of a source's training sequence
    seed: int
    read: int                    # the positions of an epoch the run reads: whole full-size steps (batch_ramp.BatchPlan)
    slots: tuple[int, ...] = field(init=False)   # positions a source gets in each block

    def __post_init__(self):
        object.__setattr__(self, "slots", block_slots(self.weights))

    @property
    def total(self) -> int:
        """N: positions an epoch."""
        return sum(self.sizes)

    def _offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    def _labels(self, first: int, end: int | None = None) -> np.ndarray:
        """The source of each position of blocks first .. end - 1 (end: first + 1), one row a block: slots[s] of each
        source s, shuffled by (seed, block)."""
        blocks = torch.arange(first, first + 1 if end is None else end)
        keys = random_bits(_seed_of(self.seed, -2), blocks, BLOCK)
        return np.repeat(np.arange(len(self.names)), self.slots)[keys.argsort(dim=1).numpy()]

    def counts(self, position: int) -> np.ndarray:
        """Positions each source had before `position` (of the whole run, epochs included)."""
        full, rest = divmod(position, BLOCK)
        return full * np.asarray(self.slots, dtype=np.int64) + np.bincount(self._labels(full)[0, :rest],
                                                                             minlength=len(self.names))

    def _rows(self, source: int, k: np.ndarray) -> np.ndarray:
        """The row ids of source `source`'s positions number k (0, 1, ...: its own count over the run, ascending):
        pass k // n, row (k mod n) of that pass's shuffle, all passes at once (a row of random keys a pass)."""
        n = self.sizes[source]
        passes, j = np.divmod(k, n)
        first = int(passes[0]) if len(k) else 0
        keys = random_bits(_seed_of(self.seed, source, -3), torch.arange(first, int(passes[-1]) + 1 if len(k) else 0), n)
        perms = keys.argsort(dim=1).numpy()   # perms[p - first]: pass p's order of the source's rows
        return passes * self.total + int(self._offsets()[source]) + perms[passes - first, j]

    def order(self, epoch: int) -> list[int]:
        """The row ids of epoch `epoch`'s N positions, in order."""
        return self.ids(epoch).tolist()

    def ids(self, epoch: int) -> np.ndarray:
        """order(epoch) as an int64 array: 8 bytes a position, where a list holds a Python int (28 and a pointer)."""
        start, end = epoch * self.total, (epoch + 1) * self.total
        first = start // BLOCK
        labels = self._labels(first, -(-end // BLOCK)).reshape(-1)[start - first * BLOCK:end - first * BLOCK]
        before, ids = self.counts(start), np.empty(self.total, dtype=np.int64)
        for s in range(len(self.names)):
            where = np.nonzero(labels == s)[0]
            ids[where] = self._rows(s, before[s] + np.arange(len(where)))
        return ids

    def _mixed(self, position: int) -> int:
        """A position of the run (sequences read before it) as a position of the mixture: each epoch's last total -
        read positions are never read (whole full-size steps an epoch, as without a mix)."""
        epoch, rest = divmod(position, self.read)
        return epoch * self.total + rest

    def _run(self, mixed: int) -> int:
        """A position of the mixture as the run's first position at or after it."""
        epoch, rest = divmod(mixed, self.total)
        return epoch * self.read + rest if rest < self.read else (epoch + 1) * self.read

    def pass_starts(self, begin: int, end: int) -> list[tuple[str, int, int]]:
        """The passes sources start at the run's positions in [begin, end), pass 0 excluded: (name, pass, the run's
        position of the pass's first row it reads; a pass wholly in an epoch's unread tail is never met)."""
        out = []
        low, high = self.counts(max(self._mixed(begin) - self.total, 0)), self.counts(self._mixed(end) + self.total)
        for s, name in enumerate(self.names):
            n = self.sizes[s]
            for p in range(-(-int(low[s]) // n) or 1, (int(high[s]) - 1) // n + 1):
                start = self._nth(s, p * n)   # the source's position number p x n
                if start % self.total >= self.read:   # in an unread tail: the run meets the pass at its next read row,
                    k = int(self.counts((start // self.total + 1) * self.total)[s])   # or never (all of it unread)
                    if k >= (p + 1) * n:
                        continue
                    start = self._nth(s, k)
                position = self._run(start)
                if begin <= position < end:
                    out.append((name, p, position))
        return sorted(out, key=lambda x: x[2])

    def _nth(self, source: int, k: int) -> int:
        """The mixture's position of source `source`'s position number k: block k // slots, that block's slot k mod
        slots of the source."""
        block, nth = divmod(k, self.slots[source])
        return block * BLOCK + int(np.nonzero(self._labels(block)[0] == source)[0][nth])

    def seen(self, position: int) -> dict:
        """What each source gave the run's first `position` sequences (every epoch's read positions): sequences, tokens
        (sequences x the source's mean tokens a sequence: exact for packed blocks), its share beside its target, and
        the passes over its rows."""
        epochs, rest = divmod(position, self.read)
        counts = sum((self.counts(e * self.total + self.read) - self.counts(e * self.total) for e in range(epochs)),
                     self.counts(epochs * self.total + rest) - self.counts(epochs * self.total))
        weight, done = sum(self.weights), max(position, 1)
        return {name: {"sequences": int(c), "tokens": int(round(c * t)), "share": int(c) / done,
                       "target_share": w / weight, "passes": int(c) / n}
                for name, c, t, w, n in zip(self.names, counts, self.tokens, self.weights, self.sizes)}

    def line(self) -> str:
        weight = sum(self.weights)
        parts = [f"{name} {n:,} train / {e:,} eval sequences (~{t:.0f} tokens), {slots} of each {BLOCK} positions "
                 f"(target {w / weight:.1%}; a pass every ~{n * BLOCK / slots:,.0f} positions)"
                 for name, n, e, t, slots, w in zip(self.names, self.sizes, self.eval_sizes, self.tokens, self.slots,
                                                     self.weights)]
        return (f"[data] data.mixture: {len(self.names)} sources, an epoch of {self.total:,} positions ({self.read:,} "
                "read: whole full-size steps): "
                + "; ".join(parts) + "; a source that runs out starts its next pass")


def block_slots(weights) -> tuple[int, ...]:
    """Each source's positions in a block of BLOCK: BLOCK x its share, rounded by largest remainders, at least 1."""
    share = np.asarray(weights, dtype=np.float64) / sum(weights) * BLOCK
    slots = np.maximum(np.floor(share).astype(np.int64), 1)
    order = np.argsort(-(share - np.floor(share)), kind="stable")
    i = 0
    while slots.sum() < BLOCK:
        slots[order[i % len(order)]] += 1
        i += 1
    while slots.sum() > BLOCK:   # the at-least-one raised some: take from the largest
        slots[int(np.argmax(slots))] -= 1
    return tuple(int(s) for s in slots)


class MixedOrder(torch.utils.data.Sampler):
    """The training loader's sampler under a mixture: epoch e's row ids (Mixture.order). Accelerate shards its
    micro batches over the ranks and skips a resumed epoch's first ones, as for the seeded shuffle."""

    def __init__(self, mixture: Mixture):
        self.mixture, self.epoch = mixture, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return self.mixture.total

    def __iter__(self):
        return (int(i) for i in self.mixture.ids(self.epoch))   # an array, read as the loader asks


def joined_sources(data, names: list[str]) -> dict:
    """The tokenized sources (train@<name>, eval@<name>) with 'train' and 'eval' their concatenations, in the
    mixture's order (no copy: token stores' blocks, or Arrow tables, side by side)."""
    from datasets import Dataset, concatenate_datasets

    from .store import JoinedBlocks
    out = dict(data)
    for split in ("train", "eval"):
        parts = [data[f"{split}@{name}"] for name in names]
        out[split] = (concatenate_datasets(parts) if all(isinstance(p, Dataset) for p in parts) else
                      JoinedBlocks(parts))
    return out


def source_mixture(data_cfg, data, seed: int, read: int) -> Mixture | None:
    """The run's Mixture from its tokenized sources, `read` positions of each epoch read (the batch plan's whole
    full-size steps); None without data.mixture."""
    if not data_cfg.mixture:
        return None
    from ..config import ConfigError
    names = [s.name for s in data_cfg.mixture]
    for name in names:
        for split, what in (("train", "training"), ("eval", "evaluation")):
            if len(data[f"{split}@{name}"]) == 0:
                raise ConfigError(f"data.mixture: source {name} has no {what} sequence once tokenized (packing cuts "
                                  f"full {data_cfg.max_seq_length}-token blocks; evaluation holds out "
                                  f"data.validation_split_percentage={data_cfg.validation_split_percentage}% of its "
                                  "rows): give it more text, or raise that percentage")
    lengths = [sequence_lengths(data[f"train@{name}"]) for name in names]
    return Mixture(names=tuple(names), weights=tuple(s.weight for s in data_cfg.mixture),
                   sizes=tuple(len(x) for x in lengths), eval_sizes=tuple(len(data[f"eval@{n}"]) for n in names),
                   tokens=tuple(float(np.mean(x)) for x in lengths), seed=seed, read=read)
