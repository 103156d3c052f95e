"""Batches: rows read from a tokenized split (Indexed: one Arrow call a batch), batches of similar length
(LengthGroupedBatches, length bins: a few shapes that repeat), an epoch's order computed from the position
(PermutedOrder: no list of the rows in memory) and the DataLoader's settings."""
from __future__ import annotations

import hashlib
from collections import Counter

import torch
from torch.utils.data import Dataset

from ..config import DataConfig


def _seed_of(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


class PermutedOrder(torch.utils.data.Sampler):
    """The training loader's sampler over `n` rows that computes epoch e's order from the position alone: row i of the
    epoch is a seeded bijection of i over [0, n) (a 4-round Feistel network over the next even power of two, walked
    back into range), keyed by (seed, e). Its memory does not grow with n (a seeded shuffle's randperm(n).tolist()
    costs 40 bytes a row on every rank: 0.8 GB at 20M blocks), and a resumed epoch seeks by skipping positions, as
    Accelerate skips a shuffle's first batches."""

    CHUNK = 1 << 16   # positions computed at once (numpy), then read as the loader asks

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0
        self.half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)   # bits of each half: 2 ** (2 x half) >= n

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def permute(self, positions) -> "np.ndarray":
        """Rows at `positions` (an int array) of this epoch's order."""
        import numpy as np
        keys = [np.uint64(_seed_of(self.seed, self.epoch, -4, r)) for r in range(4)]
        mask = np.uint64((1 << self.half) - 1)
        x = np.asarray(positions, dtype=np.uint64)
        todo = np.ones(len(x), dtype=bool)
        while todo.any():   # cycle-walking: a value past n goes round again until it lands inside
            left, right = x[todo] >> np.uint64(self.half), x[todo] & mask
            for key in keys:
                z = (right ^ key) * np.uint64(0x9E3779B97F4A7C15)
                z = (z ^ (z >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
                left, right = right, left ^ ((z ^ (z >> np.uint64(29))) & mask)
            x[todo] = (left << np.uint64(self.half)) | right
            todo = x >= np.uint64(self.n)
        return x.astype(np.int64)

    def __iter__(self):
        import numpy as np
        for start in range(0, self.n, self.CHUNK):
            yield from (int(i) for i in self.permute(np.arange(start, min(start + self.CHUNK, self.n))))


class LengthGroupedBatches:
    """Micro batches of sequences of similar length, in random order, so little compute goes to padding
    (what transformers' Trainer calls group_by_length). Each epoch: a seeded shuffle, cut into groups of
    `group` optimizer steps, each group sorted by length and cut into micro batches; the steps (runs of
    `step_batches` = global batch / micro batch micro batches, every rank's accumulation included) are
    then shuffled, so the ranks of one step get similar lengths. A pure function of (seed, epoch) and
    the recipe's batch sizes, not of the world size: a resumed epoch is the same epoch, even on another
    number of processes. Accelerate shards batch i to rank i % world and skips a resumed epoch's first
    batches, as for the default sampler."""

    drop_last = True

    def __init__(self, lengths: list[int], batch_size: int, seed: int, step_batches: int = 1, group: int = 50,
                 order=None):
        self.lengths, self.batch_size, self.seed, self.step_batches = lengths, batch_size, seed, step_batches
        self.group = group
        self.order = order   # epoch -> row ids (a data.mixture's: bert_recipes/data/mixture.py), else a seeded shuffle
        self.epoch = 0
        self.sampler = self   # where Accelerate's DataLoaderShard.set_epoch looks for it

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return len(self.lengths) // self.batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(_seed_of(self.seed, self.epoch, -1))
        order = self.order(self.epoch) if self.order else torch.randperm(len(self.lengths), generator=g).tolist()
        span, n = self.batch_size * self.group * self.step_batches, len(self.lengths)
        batches = []
        for start in range(0, len(order), span):
            chunk = sorted(order[start:start + span], key=lambda i: -self.lengths[i % n])
            batches += [chunk[i:i + self.batch_size] for i in range(0, len(chunk) - self.batch_size + 1, self.batch_size)]
        steps = [batches[i:i + self.step_batches] for i in range(0, len(batches), self.step_batches)]
        for r in torch.randperm(len(steps), generator=g).tolist():
            yield from steps[r]


class Indexed(Dataset):
    """Adds each row's index as 'idx', which the MLM collator seeds its masking from. An index past the last row reads
    row index mod rows (a data.mixture's later passes: bert_recipes/data/mixture.py), and keeps its own idx.

    `__getitems__` reads a whole micro batch in one Arrow call, or one call of a token store's (the DataLoader's
    fetcher uses it when it exists): row by row, a micro batch of 256 costs 256 table slices and conversions on the
    process that collates (the training process itself with data.num_workers=0); here, one."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return {**self.dataset[int(i) % len(self.dataset)], "idx": int(i)}

    def __getitems__(self, indices) -> list[dict]:
        """Rows `indices` (any sequence of ints: a list, a tuple, a tensor) as __getitem__ gives them."""
        indices = [int(i) for i in indices]
        n = len(self.dataset)
        if not hasattr(self.dataset, "column_names"):   # a token store's blocks (data/store.py): their batched read;
            if hasattr(self.dataset, "__getitems__"):   # a list of rows: one by one
                return [{**row, "idx": i} for row, i in zip(self.dataset.__getitems__([i % n for i in indices]), indices)]
            return [self[i] for i in indices]
        columns = self.dataset[[i % n for i in indices]]   # {column: [value of each row]}
        return [{**{k: values[j] for k, values in columns.items()}, "idx": i} for j, i in enumerate(indices)]


def sequence_lengths(dataset, column: str = "input_ids") -> list[int]:
    """The token count of every row, from Arrow's list lengths (no row is converted to Python); a token store's blocks
    (data/store.py) say theirs."""
    if hasattr(dataset, "lengths"):
        return dataset.lengths()
    import pyarrow.compute as pc
    values = dataset.with_format("arrow")[column]
    return pc.list_value_length(values).to_pylist()


def length_bins(lengths: list[int], bins: int, multiple: int | None, longest: int | None = None) -> list[int]:
    """At most `bins` padded lengths for batches of these sequences, each rounded up to `multiple` (8 on
    GPUs: tensor cores): the quantiles of `lengths` that leave the least padding when each sequence is
    padded to the smallest bin that holds it (a dynamic program over the histogram of the lengths, so
    the bins sit where the sequences are). The longest length, or `longest` when another split has a
    longer row, is always the last bin. A batch is padded to the smallest bin that holds its longest
    sequence (padded_width), so the same few shapes repeat. -> sorted lengths, or [] for bins=0."""
    import numpy as np
    if not bins or not lengths:
        return []
    step = multiple or 1
    up = lambda n: -(-n // step) * step   # noqa: E731
    histogram = Counter(up(n) for n in lengths)
    histogram[up(max(max(lengths), longest or 0))] += 0
    values = np.array(sorted(histogram), dtype=np.float64)
    if len(values) <= bins:
        return [int(v) for v in values]
    counts = np.array([histogram[int(v)] for v in values], dtype=np.float64)
    below = np.concatenate([[0.0], np.cumsum(counts)])             # below[i]: sequences of value index < i
    below_sum = np.concatenate([[0.0], np.cumsum(counts * values)])
    m = len(values)
    # padding[b][j]: the least padding of the sequences of value index <= j in b bins, the last ending at j
    padding = np.full((bins + 1, m), np.inf)
    back = np.full((bins + 1, m), -1, dtype=np.int64)
    padding[1] = values * below[1:] - below_sum[1:]
    for b in range(2, bins + 1):
        for j in range(b - 1, m):   # the bin before ends at i < j; the sequences of i+1..j pad to values[j]
            i = np.arange(j)
            cost = padding[b - 1, :j] + values[j] * (below[j + 1] - below[i + 1]) - (below_sum[j + 1] - below_sum[i + 1])
            back[b, j] = int(cost.argmin())
            padding[b, j] = cost[back[b, j]]
    edges, j = [], m - 1
    for b in range(bins, 0, -1):
        edges.append(int(values[j]))
        j = back[b, j]
        if j < 0:
            break
    return sorted(edges)


def fit_length_bins(collate, data: dict, bins: int, print0=print) -> list[int] | None:
    """data.length_bins for the run's padded batches: the bins from the training split's lengths, the
    longest row of any split the run collates (eval, extra eval, test) always the last, set on the
    collator that every loader copies. -> the training split's lengths (LengthGroupedBatches reuses
    them), or None without bins."""
    if not bins:
        return None
    lengths = sequence_lengths(data["train"])
    longest = max(max(sequence_lengths(split), default=0) for split in data.values())
    collate.bins = length_bins(lengths, bins, collate.pad_to_multiple_of, longest)
    padded = sum(padded_width(n, collate.pad_to_multiple_of, collate.bins) for n in lengths)
    print0(f"[data] data.length_bins={bins}: padded batches take one of the lengths {collate.bins}, the quantiles of "
           f"the {len(lengths)} training sequences' lengths that leave the least padding ({1 - sum(lengths) / padded:.1%}"
           " of the positions, each sequence padded to its bin)")
    return lengths


def padded_width(longest: int, pad_to_multiple_of: int | None, bins: list[int] | None) -> int:
    """The length a padded batch whose longest row has `longest` tokens is padded to: the smallest of
    `bins` that holds it (data.length_bins), else `longest` rounded up to `pad_to_multiple_of`."""
    for width in bins or ():
        if width >= longest:
            return width
    return -(-longest // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else longest


def loader_kwargs(data: DataConfig, collate, seed: int, pin: bool) -> dict:
    """DataLoader settings shared by the train and eval loaders. One seeded generator of their own:
    otherwise each new iterator draws its worker seed from the global torch RNG, which shifts the
    dropout stream of a resumed run away from the uninterrupted one."""
    return dict(collate_fn=collate, num_workers=data.num_workers,
                persistent_workers=data.persistent_workers and data.num_workers > 0,
                pin_memory=data.pin_memory and pin, generator=torch.Generator().manual_seed(seed))
