"""Retrieval scores from embeddings, on BEIR-format data, as sentence-transformers' `InformationRetrievalEvaluator`
scores them (tests/test_retrieval.py checks the equality on one model and one data set): each query's corpus
ranked by cosine similarity (descending, ties by ascending corpus id), a document relevant when its qrels score is
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

CUTOFFS = {"ndcg": 10, "mrr": 10, "recall": 100}   # the scores BEIR reports first, and recall deep enough to rerank


def read_beir(root: Path, split: str = "test") -> tuple[dict, dict, dict]:
    """-> corpus {id: text}, queries {id: text} (those with a relevant document), relevant {query id: {doc ids}}."""
    root = Path(root)
    missing = [name for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv") if not (root / name).exists()]
    if missing:
        raise ValueError(f"data.beir_dir={root}: no {', '.join(missing)} there; a BEIR folder holds corpus.jsonl, "
                         f"queries.jsonl and qrels/<split>.tsv")
    corpus = {}
    for line in (root / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            doc = json.loads(line)
            corpus[str(doc["_id"])] = (f"{doc['title']} {doc.get('text', '')}".strip() if doc.get("title")
                                       else doc.get("text", ""))
    queries = {str(q["_id"]): q["text"] for q in map(json.loads, filter(str.strip, (root / "queries.jsonl")
                                                                      .read_text(encoding="utf-8").splitlines()))}
    relevant: dict[str, set] = {}
    with open(root / "qrels" / f"{split}.tsv", encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t")
        next(rows, None)   # the header
        for row in rows:
            if len(row) >= 3 and float(row[2]) > 0:
                relevant.setdefault(str(row[0]), set()).add(str(row[1]))
    unknown = sorted({d for docs in relevant.values() for d in docs} - set(corpus))[:3]
    if unknown:
        raise ValueError(f"data.beir_dir={root}: qrels/{split}.tsv names documents not in corpus.jsonl "
                         f"({', '.join(unknown)} ...); the qrels and the corpus must be one data set's")
    relevant = {q: docs for q, docs in relevant.items() if q in queries}
    return corpus, {q: queries[q] for q in relevant}, relevant


def ranked(query_embeddings: torch.Tensor, corpus_embeddings: torch.Tensor, corpus_ids: list[str], depth: int,
           chunk: int = 256) -> list[list[str]]:
    """Each query's first `depth` corpus ids by cosine similarity, ties by ascending id."""
    order = sorted(range(len(corpus_ids)), key=corpus_ids.__getitem__)   # ids ascending: the stable sort's ties
    docs = torch.nn.functional.normalize(corpus_embeddings[order].float(), p=2, dim=1)
    sorted_ids = [corpus_ids[i] for i in order]
    out = []
    for s in range(0, len(query_embeddings), chunk):
        queries = torch.nn.functional.normalize(query_embeddings[s:s + chunk].float(), p=2, dim=1)
        top = torch.sort(-(queries @ docs.T), dim=1, stable=True).indices[:, :depth]
        out += [[sorted_ids[i] for i in row] for row in top.tolist()]
    return out


def scores(query_embeddings: torch.Tensor, corpus_embeddings: torch.Tensor, query_ids: list[str],
           corpus_ids: list[str], relevant: dict, cutoffs: dict | None = None) -> dict[str, float]:
    """-> {"ndcg@10": ..., "mrr@10": ..., "recall@100": ...} (CUTOFFS), each a mean over the queries, in [0, 1]."""
    cutoffs = cutoffs or CUTOFFS
    hits = ranked(query_embeddings, corpus_embeddings, corpus_ids, max(cutoffs.values()))
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
