"""The token store (data.source=store), as training reads it: a corpus tokenized once, outside the job, into flat
token files and their documents' boundaries (bert_recipes/data/store_writer.py writes it with datatrove, in
datatrove's own format: `<task>_unshuffled.ds`, uint16 or uint32 token ids; `.ds.index`, each document's end,
uint64), memory-mapped here; `store.json`, written last, is the manifest a run reads: the tokenizer's vocabulary
fingerprint, the input files with their sizes, the tokens and documents of each shard, the dtype.

A packed block of data.max_seq_length tokens is a slice of one shard (a shard's tail that fills no block is left
out); its documents come from the boundaries on the fly (no per-token column on disk). Starting a run reads the
manifest, never the tokens. No torch at import time."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import ConfigError, path_kind

STORE_META = "store.json"
STORE_VERSION = 1
SHARD_NAME = "tokens"                       # datatrove's files: <task:05d>_unshuffled.ds under <store>/tokens/


def check_store_dir(store_dir: str) -> Path:
    """data.store_dir: a directory with a store's manifest (make prepare writes it last), else one line."""
    root = Path(store_dir).expanduser()
    kind = path_kind(root, "data.store_dir")
    if kind == "dir":
        path_kind(root / STORE_META, "data.store_dir")   # a directory this user cannot look into: its own line
    if kind == "file":
        raise ConfigError(f"data.store_dir={store_dir} is a file, not a directory: give the directory make prepare "
                          "STORE=1 wrote")
    if kind == "missing":
        raise ConfigError(f"data.store_dir={store_dir}: no such directory: write a token store there with make prepare "
                          f"RECIPE=<this recipe> STORE=1 OUT={store_dir}")
    if not (root / STORE_META).is_file() and (root / "prepared.json").is_file():
        raise ConfigError(f"data.store_dir={store_dir} holds prepared data (prepared.json: the packed MLM directories "
                          "make prepare wrote before token stores), not a token store: write one with make prepare "
                          "RECIPE=<this recipe> STORE=1 OUT=<a new directory>, or train from the source with "
                          "data.source=files (a run makes its own store on first use)")
    if not (root / STORE_META).is_file():
        raise ConfigError(f"data.store_dir={store_dir} holds no token store ({STORE_META} missing: an interrupted "
                          "preparation writes it last): write it with make prepare RECIPE=<this recipe> STORE=1 "
                          f"OUT={store_dir}, or run that again to finish it")
    return root


class TokenStore:
    """A store's shards, memory-mapped on first read (each process its own maps: DataLoader workers too)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.meta = json.loads((self.root / STORE_META).read_text())
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self.shards = [s for s in self.meta["shards"] if s["tokens"]]
        self._tokens: dict[int, np.ndarray] = {}
        self._ends: dict[int, np.ndarray] = {}

    def tokens(self, shard: int) -> np.ndarray:
        if shard not in self._tokens:
            self._tokens[shard] = np.memmap(self.root / self.shards[shard]["file"], dtype=self.dtype, mode="r")
        return self._tokens[shard]

    def ends(self, shard: int) -> np.ndarray:
        """The shard's document ends, in tokens (uint64)."""
        if shard not in self._ends:
            self._ends[shard] = np.memmap(self.root / f"{self.shards[shard]['file']}.index", dtype="<u8", mode="r")
        return self._ends[shard]

    def __getstate__(self):   # a DataLoader worker maps the files again rather than pickling the maps
        return {**self.__dict__, "_tokens": {}, "_ends": {}}


class StoredRows:
    """What a store's rows share as a dataset the loaders read (StoreBlocks; best_fit.BestFitRows): `rows`, a range
    of row numbers (the training or the evaluation share), each row `seq` tokens wide; the special tokens' table."""

    def __init__(self, store: TokenStore, seq: int, special_ids: list[int], rows: range):
        self.store, self.seq, self.rows = store, seq, rows
        self.special = np.zeros(max(max(special_ids, default=0) + 1, 1), dtype=bool)
        self.special[list(special_ids)] = True

    def special_of(self, ids: np.ndarray) -> np.ndarray:
        """1 where a token id is a special token's."""
        return (self.special[np.minimum(ids, len(self.special) - 1)] & (ids < len(self.special))).astype(np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> np.ndarray:
        """Every row's width (batching.sequence_lengths): all `seq` (a best-fit row's padding included)."""
        return np.full(len(self), self.seq, dtype=np.int64)

    def training_order(self, seed: int):
        """The training loader's sampler: each epoch's order computed from the position (batching.PermutedOrder),
        so no rank holds a list of the store's rows."""
        from .batching import PermutedOrder
        return PermutedOrder(len(self), seed)

    def select(self, rows: range):
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.rows = rows
        return other

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]


class StoreBlocks(StoredRows):
    """The packed blocks of `seq` tokens of a store, numbered shard after shard (a shard's tail is left out).
    A row is {input_ids, special_tokens_mask[, document_ids]} as data.source=files' packed MLM rows are: a document
    cut at a block's start goes on there as document 0 (tasks/mlm.py's packing)."""

    def __init__(self, store: TokenStore, seq: int, special_ids: list[int], documents: bool, rows: range | None = None):
        counts = [s["tokens"] // seq for s in store.shards]
        self.first = np.cumsum([0] + counts)   # shard i holds blocks first[i] .. first[i+1] - 1
        super().__init__(store, seq, special_ids, rows if rows is not None else range(int(self.first[-1])))
        self.documents = documents

    def __getitems__(self, indices) -> list[dict]:
        """Rows `indices` at once: each block a slice of its shard's map, the special tokens of all of them in one
        lookup (batching.Indexed hands a micro batch over in one call)."""
        blocks = np.asarray([self.rows[int(i)] for i in indices], dtype=np.int64)
        shards = np.searchsorted(self.first, blocks, side="right") - 1
        starts = (blocks - self.first[shards]) * self.seq
        ids = np.stack([self.store.tokens(int(shard))[start:start + self.seq] for shard, start in zip(shards, starts)]
                       ).astype(np.int64) if len(blocks) else np.zeros((0, self.seq), dtype=np.int64)
        special = self.special_of(ids)
        rows = [{"input_ids": ids[j], "special_tokens_mask": special[j]} for j in range(len(blocks))]
        if self.documents:
            within = np.arange(self.seq)
            for row, shard, start in zip(rows, shards, starts):
                ends = self.store.ends(int(shard))
                first = int(np.searchsorted(ends, start, side="right"))   # the document the block starts in
                near = ends[first:first + self.seq + 1]   # a block holds at most seq documents' ends
                row["document_ids"] = np.searchsorted(near, start + within, side="right").astype(np.int64)
        return rows


class JoinedBlocks:
    """Several stores' blocks one after the other (a mixture's sources: mixture.joined_sources), read as one split."""

    def __init__(self, parts: list):
        self.parts = parts
        self.first = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.first[-1])

    def lengths(self) -> np.ndarray:
        return np.concatenate([p.lengths() for p in self.parts])

    def __getitem__(self, i: int) -> dict:
        part = int(np.searchsorted(self.first, i, side="right")) - 1
        return self.parts[part][i - int(self.first[part])]

    def __getitems__(self, indices) -> list[dict]:
        return [self[int(i)] for i in indices]
