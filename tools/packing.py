"""The two packings of a token store side by side, at each row length: concatenate-and-chunk (data.packing: true) and
best-fit (data.packing: best_fit, bert_recipes/data/best_fit.py). Chunking leaves no padding but cuts documents
where a block ends and drops each shard's tail; best-fit cuts a document only where it is longer than a row and
pads what is left of a row. For each: rows, the share of the tokens that is padding (or dropped), the documents cut
into pieces, the plan's time, and a micro batch's read (the median of 20 reads of 256 random rows with their document
ids, as a run with data.document_mask reads them; tests/data/wordpiece-1000's special tokens).

    python tools/prepare.py --make-corpus data/corp/long.txt --size 40M --paragraphs 20
    python tools/prepare.py --recipe recipes/tiny-mlm.yaml --out data/corp-long --store --workers 2 \\
        --data.source=files --data.train_files=[data/corp/long.txt] --tokenizer.name_or_path=tests/data/wordpiece-1000
    python tools/packing.py data/corp-long --seq 128,512,1024
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def chunked(store, seq: int) -> dict:
    """Concatenate-and-chunk: each shard cut into blocks of `seq` (its tail dropped). A document is cut where a block
    boundary falls strictly inside it."""
    blocks = cut = documents = tokens = dropped = 0
    for shard in range(len(store.shards)):
        ends = np.asarray(store.ends(shard), dtype=np.int64)
        begins = np.concatenate([[0], ends[:-1]])
        n = int(ends[-1]) if len(ends) else 0
        blocks += n // seq
        tokens += n
        dropped += n % seq
        documents += len(ends)
        cut += int(((ends - 1) // seq > begins // seq).sum())   # a boundary k x seq with begin < k x seq < end
    return {"rows": blocks, "padding": 0.0, "dropped": dropped / max(tokens, 1), "documents": documents,
            "cut": cut / max(documents, 1)}


def best_fit(store, seq: int) -> dict:
    from bert_recipes.data.best_fit import pack
    t = time.perf_counter()
    rows, pieces, tokens = pack(store, seq)
    seconds = time.perf_counter() - t
    documents = longer = 0
    for shard in range(len(store.shards)):   # a document is cut only where it is longer than a row
        ends = np.asarray(store.ends(shard), dtype=np.int64)
        documents += len(ends)
        longer += int((np.diff(ends, prepend=0) > seq).sum())
    return {"rows": len(rows) - 1, "padding": 1 - tokens / max((len(rows) - 1) * seq, 1), "dropped": 0.0,
            "documents": documents, "cut": longer / max(documents, 1), "seconds": seconds}


def read_ms(rows, reads: int = 20, batch: int = 256) -> float:
    rng = np.random.default_rng(0)
    times = []
    for _ in range(reads):
        picked = rng.integers(0, len(rows), batch)
        t = time.perf_counter()
        rows.__getitems__(picked)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1000


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from bert_recipes.data.best_fit import BestFitRows
    from bert_recipes.data.store import StoreBlocks, TokenStore, check_store_dir
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="a token store (tools/prepare.py --store, or a run's own in its data cache)")
    parser.add_argument("--seq", default="128,512,1024", help="row lengths, comma-separated")
    args = parser.parse_args(argv)
    store = TokenStore(check_store_dir(args.store))
    tokens = sum(s["tokens"] for s in store.shards)
    documents = sum(len(store.ends(shard)) for shard in range(len(store.shards)))
    print(f"[packing] {args.store}: {tokens:,} tokens in {documents:,} documents ({tokens / max(documents, 1):,.0f} "
          "tokens a document on average)")
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "tests/data/wordpiece-1000"))
    print("| row length | packing | rows | padding | tokens dropped | documents cut | plan time | 256 rows read |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seq.split(",")):
        blocks = StoreBlocks(store, seq, tokenizer.all_special_ids, documents=True)
        fitted = BestFitRows(store, seq, tokenizer.all_special_ids, tokenizer.pad_token_id)   # its plan: made once
        for name, figures, rows in (("chunk", chunked(store, seq), blocks), ("best_fit", best_fit(store, seq), fitted)):
            seconds = f"{figures['seconds']:.1f} s" if "seconds" in figures else "-"
            print(f"| {seq} | {name} | {figures['rows']:,} | {figures['padding']:.1%} | {figures['dropped']:.2%} | "
                  f"{figures['cut']:.1%} | {seconds} | {read_ms(rows):.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
