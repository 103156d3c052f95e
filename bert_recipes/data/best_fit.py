"""data.packing: best_fit: a token store's documents packed whole into rows of data.max_seq_length tokens, as
ModernBERT's GreedyBestFitSequencePacker packs (AnswerDotAI/ModernBERT src/sequence_packer.py: each sequence into the
row whose free space fits it most tightly, from a bounded window). Concatenate-and-chunk (data.packing: true) cuts
a document wherever a block ends; here a document is cut only where it is longer than a row (ModernBERT truncates
it there and drops the rest; here each further piece of a row's length is packed as a document of its own), and a
row's unused tail is padding (the pad token, special: never masked, its own document: no real token attends to it).

The pack plan is computed once per store and row length (plan_rows, at preparation or on a run's first use, under a
file lock) and saved beside the store: `best_fit_<seq>/rows.npy` (each row's first piece) and `pieces.npy` (each
piece's shard, first token and length). Streaming in store order with at most OPEN_ROWS rows open: a piece goes into
the open row with the least free space that holds it; where none does, a new row opens, and with OPEN_ROWS open the
fullest one is closed first. The rows are data, like blocks: an epoch's order is a function of (seed, epoch,
position) (batching.PermutedOrder), so a resume seeks on any process count. No torch at import time."""
from __future__ import annotations

import array
import json
from pathlib import Path

import numpy as np

from ..config import ConfigError
from .store import StoredRows, TokenStore

OPEN_ROWS = 64          # rows open at once (ModernBERT's window: 5 x the device batch of sequences)
PLAN_VERSION = 1
PIECE = np.dtype([("shard", "<i4"), ("start", "<i8"), ("length", "<i4")])


def plan_dir(store: TokenStore, seq: int) -> Path:
    return store.root / f"best_fit_{seq}"


def plan_rows(store: TokenStore, seq: int) -> Path:
    """The store's pack plan for rows of `seq` tokens, computed once (a file lock beside it: two runs or ranks that
    share the store compute it once) and written through a .partial directory. -> its directory."""
    out = plan_dir(store, seq)
    if (out / "plan.json").is_file():
        return out
    from filelock import FileLock
    try:
        return _plan_once(store, seq, out, FileLock(f"{out}.lock"))
    except OSError as err:   # a store another machine prepared, read-only here
        raise ConfigError(f"data.packing=best_fit: no pack plan for rows of {seq} tokens beside the store in "
                          f"{store.root}, and none can be written there ({err.strerror or err}): make one where the "
                          f"store can be written, with tools/prepare.py --store (a recipe of data.packing: best_fit and "
                          f"data.max_seq_length: {seq}), or use data.packing=true") from None


def _plan_once(store: TokenStore, seq: int, out: Path, lock) -> Path:
    with lock:
        if (out / "plan.json").is_file():
            return out
        import shutil
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        rows, pieces, tokens = pack(store, seq)
        np.save(partial / "rows.npy", rows)
        np.save(partial / "pieces.npy", pieces)
        (partial / "plan.json").write_text(json.dumps({
            "version": PLAN_VERSION, "seq": seq, "open_rows": OPEN_ROWS, "rows": len(rows) - 1,
            "pieces": len(pieces), "tokens": tokens, "padding": 1 - tokens / max((len(rows) - 1) * seq, 1)}))
        partial.rename(out)
    return out


def pack(store: TokenStore, seq: int) -> tuple[np.ndarray, np.ndarray, int]:
    """-> (rows: each row's first piece, and the pieces' count last; pieces: PIECE records; the tokens packed)."""
    row_first = array.array("q", [0])
    shards, starts, lengths = array.array("i"), array.array("q"), array.array("i")
    open_rows: dict[int, list] = {}     # row id -> [free space, its pieces as (shard, start, length)]
    by_space: dict[int, list[int]] = {}  # free space -> the open rows with it
    free = 0                             # bit s set: some open row has s tokens free
    ids = 0

    def take(space: int) -> int:
        nonlocal free
        row = by_space[space].pop()
        if not by_space[space]:
            free &= ~(1 << space)
        return row

    def put(row: int, space: int) -> None:
        nonlocal free
        by_space.setdefault(space, []).append(row)
        free |= 1 << space

    def close(row: int) -> None:
        for shard, start, length in open_rows.pop(row)[1]:
            shards.append(shard)
            starts.append(start)
            lengths.append(length)
        row_first.append(len(lengths))

    for shard in range(len(store.shards)):
        ends = np.asarray(store.ends(shard), dtype=np.int64)
        begins = np.concatenate([[0], ends[:-1]])
        counts = -(-(ends - begins) // seq)   # pieces a document: cut only where it is longer than a row
        piece_starts = np.repeat(begins, counts) + seq * (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
        piece_ends = np.minimum(piece_starts + seq, np.repeat(ends, counts))
        for start, length in zip(piece_starts.tolist(), (piece_ends - piece_starts).tolist()):
            fits = free >> length
            if fits:   # the open row with the least free space that holds it
                space = length + ((fits & -fits).bit_length() - 1)
                row = take(space)
            else:
                if len(open_rows) >= OPEN_ROWS:   # the fullest open row closes
                    close(take((free & -free).bit_length() - 1))
                row, space, ids = ids, seq, ids + 1
                open_rows[row] = [seq, []]
            open_rows[row][1].append((shard, start, length))
            if space - length:
                put(row, space - length)
            else:
                close(row)
    for row in sorted(open_rows):   # the rest, in the order they opened
        close(row)
    pieces = np.empty(len(lengths), dtype=PIECE)
    pieces["shard"], pieces["start"], pieces["length"] = shards, starts, lengths
    return np.asarray(row_first, dtype=np.int64), pieces, int(pieces["length"].sum())


class BestFitRows(StoredRows):
    """A store's best-fit rows (plan_rows): a row is {input_ids, special_tokens_mask, attention_mask (0 on the
    padding), document_ids (each piece its own document, the padding one more)}."""

    def __init__(self, store: TokenStore, seq: int, special_ids: list[int], pad_id: int, rows: range | None = None):
        where = plan_rows(store, seq)
        self.row_first = np.load(where / "rows.npy", mmap_mode="r")
        self.pieces = np.load(where / "pieces.npy", mmap_mode="r")
        self.plan = json.loads((where / "plan.json").read_text())
        super().__init__(store, seq, special_ids, rows if rows is not None else range(len(self.row_first) - 1))
        self.pad_id = pad_id

    def __getitems__(self, indices) -> list[dict]:
        out = []
        for i in indices:
            row = self.rows[int(i)]
            ids = np.full(self.seq, self.pad_id, dtype=np.int64)
            documents = np.zeros(self.seq, dtype=np.int64)
            at = 0
            for n, piece in enumerate(self.pieces[self.row_first[row]:self.row_first[row + 1]]):
                length = int(piece["length"])
                ids[at:at + length] = self.store.tokens(int(piece["shard"]))[piece["start"]:piece["start"] + length]
                documents[at:at + length] = n
                at += length
            documents[at:] = documents[at - 1] + 1 if at else 0
            real = np.zeros(self.seq, dtype=np.int64)
            real[:at] = 1
            special = self.special_of(ids) | (1 - real)
            out.append({"input_ids": ids, "special_tokens_mask": special, "attention_mask": real,
                        "document_ids": documents})
        return out

    def __getstate__(self):   # a DataLoader worker maps the plan again
        return {**self.__dict__, "row_first": None, "pieces": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        where = plan_dir(self.store, self.seq)
        self.row_first = np.load(where / "rows.npy", mmap_mode="r")
        self.pieces = np.load(where / "pieces.npy", mmap_mode="r")
