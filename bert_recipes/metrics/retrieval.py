"""Retrieval scores from embeddings, on BEIR-format data, as sentence-transformers' `InformationRetrievalEvaluator`
scores them (tests/test_retrieval.py checks the equality on one model and one data set): each query's corpus
ranked by the model's similarity, cosine or dot (descending, ties by ascending corpus id), a document relevant when
its qrels score is
above 0; nDCG@k over binary relevance (the ideal ranking puts min(k, relevant) relevant documents first), MRR@k (the
reciprocal rank of the first relevant document in the top k, else 0), recall@k (the relevant documents in the top
k over all of them). A query without a relevant document is left out, as BEIR leaves it out. A graded qrels score
(2 for highly relevant) counts as relevant, no more: sentence-transformers' evaluator is binary, where BEIR's own
pytrec_eval weighs the grade in nDCG; on binary qrels (MS MARCO's, SciFact's) the two agree.

BEIR's layout (beir-cellar/beir, the datasets on the Hub under BeIR/): `corpus.jsonl` ({"_id", "title", "text"}),
`queries.jsonl` ({"_id", "text"}), `qrels/<split>.tsv` (a header, then query-id, corpus-id, score). A document's
text is its title and text joined by a space, as sentence-transformers' BEIR examples join them."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

CUTOFFS = {"ndcg": 10, "mrr": 10, "recall": 100}   # the scores BEIR reports first, and recall deep enough to rerank


def _lines(path: Path) -> list[str]:
    """A jsonl file's lines: split at newlines only (JSON may hold U+2028 or U+0085 unescaped, which splitlines cuts)."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def read_beir(root: Path, split: str = "test") -> tuple[dict, dict, dict]:
    """-> corpus {id: text}, queries {id: text} (those with a relevant document), relevant {query id: {doc ids}}."""
    root = Path(root)
    missing = [name for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv") if not (root / name).exists()]
    if missing:
        raise ValueError(f"data.beir_dir={root}: no {', '.join(missing)} there; a BEIR folder holds corpus.jsonl, "
                         f"queries.jsonl and qrels/<split>.tsv")
    corpus = {}
    for doc in map(json.loads, _lines(root / "corpus.jsonl")):
        corpus[str(doc["_id"])] = (f"{doc['title']} {doc.get('text', '')}".strip() if doc.get("title")
                                   else doc.get("text", ""))
    queries = {str(q["_id"]): q["text"] for q in map(json.loads, _lines(root / "queries.jsonl"))}
    relevant: dict[str, set] = {}
    with open(root / "qrels" / f"{split}.tsv", encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t")
        next(rows, None)   # the header
        for n, row in enumerate(rows, 2):
            try:
                score = float(row[2]) if len(row) >= 3 else None
            except ValueError:
                score = None
            if score is None:
                raise ValueError(f"data.beir_dir={root}: qrels/{split}.tsv line {n} is {row!r}; each line is "
                                 f"query-id, corpus-id and a numeric score, tab-separated")
            if score > 0 and str(row[0]) in queries:
                relevant.setdefault(str(row[0]), set()).add(str(row[1]))
    unknown = sorted({d for docs in relevant.values() for d in docs} - set(corpus))[:3]
    if unknown:
        raise ValueError(f"data.beir_dir={root}: qrels/{split}.tsv names documents not in corpus.jsonl "
                         f"({', '.join(unknown)} ...); the qrels and the corpus must be one data set's")
    return corpus, {q: queries[q] for q in relevant}, relevant


def ranked(query_embeddings: torch.Tensor, corpus_embeddings: torch.Tensor, corpus_ids: list[str], depth: int,
           similarity: str = "cosine", cells: int = 1 << 25) -> list[list[str]]:
    """Each query's first `depth` corpus ids by similarity, ties by ascending id: the top `depth` of each row
    (topk), the tied scores at its edge chosen by the lowest ids, as sentence-transformers reselects them. Queries go
    in chunks of at most `cells` scores (128 MB of float32), whatever the corpus size."""
    order = sorted(range(len(corpus_ids)), key=corpus_ids.__getitem__)   # positions are ids' ranks from here
    docs, sorted_ids = corpus_embeddings[order].float(), [corpus_ids[i] for i in order]
    queries = query_embeddings.float()
    if similarity == "cosine":
        docs, queries = F.normalize(docs, p=2, dim=1), F.normalize(queries, p=2, dim=1)
    depth, n = min(depth, len(docs)), len(docs)
    rank = torch.arange(n)
    out = []
    for s in range(0, len(queries), max(1, cells // max(n, 1))):
        scores = queries[s:s + max(1, cells // max(n, 1))] @ docs.T
        edge = scores.topk(depth, dim=1).values[:, -1:]
        key = torch.where(scores > edge, rank, torch.where(scores == edge, rank + n, 2 * n))
        chosen = key.topk(depth, dim=1, largest=False).indices.sort(dim=1).values   # by id, then by score (stable)
        top = chosen.gather(1, torch.sort(-scores.gather(1, chosen), dim=1, stable=True).indices)
        out += [[sorted_ids[i] for i in row] for row in top.tolist()]
    return out


def scores(query_embeddings: torch.Tensor, corpus_embeddings: torch.Tensor, query_ids: list[str],
           corpus_ids: list[str], relevant: dict, cutoffs: dict | None = None,
           similarity: str = "cosine") -> dict[str, float]:
    """-> {"ndcg@10": ..., "mrr@10": ..., "recall@100": ...} (CUTOFFS), each a mean over the queries that have a
    relevant document (the others are left out, as the evaluator leaves them out), in [0, 1]."""
    cutoffs = cutoffs or CUTOFFS
    kept = [i for i, q in enumerate(query_ids) if relevant.get(q)]
    query_ids, query_embeddings = [query_ids[i] for i in kept], query_embeddings[kept]
    hits = ranked(query_embeddings, corpus_embeddings, corpus_ids, max(cutoffs.values()), similarity)
    out = {f"{name}@{k}": 0.0 for name, k in cutoffs.items()}
    for query, top in zip(query_ids, hits):
        wanted = relevant[query]
        found = [doc in wanted for doc in top]
        if "ndcg" in cutoffs:
            k = cutoffs["ndcg"]
            dcg = sum(1 / math.log2(i + 2) for i, hit in enumerate(found[:k]) if hit)
            ideal = sum(1 / math.log2(i + 2) for i in range(min(k, len(wanted))))
            out[f"ndcg@{k}"] += dcg / ideal
        if "mrr" in cutoffs:
            k = cutoffs["mrr"]
            out[f"mrr@{k}"] += next((1 / (i + 1) for i, hit in enumerate(found[:k]) if hit), 0.0)
        if "recall" in cutoffs:
            k = cutoffs["recall"]
            out[f"recall@{k}"] += sum(found[:k]) / len(wanted)
    return {name: value / max(len(query_ids), 1) for name, value in out.items()}
