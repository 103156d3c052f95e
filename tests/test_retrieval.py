"""Retrieval's parts, against sentence-transformers itself: the pooling equals its `Pooling` on every mode and padding
side; an encoder folder with the sentence-transformers files added (bert_recipes/embeddings.py) loads with
`SentenceTransformer` and encodes as our pooling of the encoder's hidden states does; nDCG@10, MRR@10 and recall@100
(bert_recipes/metrics/retrieval.py) equal `InformationRetrievalEvaluator`'s on one model and a BEIR folder made from
the sample (ties and a non-relevant qrels row included)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bert_recipes.embeddings import POOLING, pool, write_sentence_transformer
from bert_recipes.metrics.retrieval import read_beir, scores
from conftest import tiny_encoder


def beir_folder(out: Path, sample_dir: Path) -> Path:
    """BEIR's layout from the sample's docstrings: each of 60 queries is a docstring's first sentence; its relevant
    documents are that docstring and, for every third query, the next one too; one qrels row scores 0 (not
    relevant); a relevant document repeated under another id ties with it (the ascending id ranks the relevant one
    first); one query has no qrels row."""
    docs = [json.loads(line)["text"] for line in (sample_dir / "classify/validation.jsonl").read_text().splitlines()]
    docs = docs[:200]
    corpus = [{"_id": f"d{n:03d}", "title": "", "text": text} for n, text in enumerate(docs)]
    corpus[7]["text"] += " \u2028 \x85 (line separators JSON keeps unescaped)"
    corpus.append({"_id": "d999", "title": "", "text": docs[3]})   # ties with d003, q1's relevant document
    queries, qrels = [], ["query-id\tcorpus-id\tscore"]
    for n in range(60):
        queries.append({"_id": f"q{n}", "text": docs[n * 3].split(". ")[0][:80]})
        qrels.append(f"q{n}\td{n * 3:03d}\t1")
        if n % 3 == 0:
            qrels.append(f"q{n}\td{n * 3 + 1:03d}\t2")
    qrels.append("q1\td150\t0")
    queries.append({"_id": "q-none", "text": "a query nothing answers"})
    (out / "qrels").mkdir(parents=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in corpus))
    (out / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (out / "qrels/test.tsv").write_text("\n".join(qrels) + "\n")
    return out


@pytest.mark.parametrize("mode", POOLING)
def test_pooling_is_sentence_transformers_on_either_padding_side(mode):
    from sentence_transformers.sentence_transformer.modules import Pooling
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 6, 8, generator=g)
    right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    for mask in (right, right.flip(1)):   # right and left padding
        theirs = Pooling(8, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})
        assert torch.equal(pool(hidden, mask, mode), theirs["sentence_embedding"]), (mode, mask)
    other = next(m for m in POOLING if m != mode)
    assert not torch.equal(pool(hidden, right, mode), pool(hidden, right, other))   # the modes differ


def test_an_unknown_pooling_is_one_line():
    with pytest.raises(ValueError, match=r"task.pooling=max: no such pooling; use one of mean, cls, lasttoken"):
        pool(torch.zeros(1, 2, 4), torch.ones(1, 2), "max")


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_the_export_loads_as_a_sentence_transformer_with_our_embeddings(tmp_path, shared_tokenizer, mode):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    model_dir = tiny_encoder(tmp_path / "model", shared_tokenizer)
    weights = (model_dir / "model.safetensors").read_bytes()
    added = write_sentence_transformer(model_dir, mode)
    assert {"modules.json", "config_sentence_transformers.json", "1_Pooling"} <= set(added), added
    assert (model_dir / "model.safetensors").read_bytes() == weights   # the export's weights, untouched
    texts = ["Return the value of x.", "Open a file and return a stream.", "a"]
    st = SentenceTransformer(str(model_dir), device="cpu")
    assert st.similarity_fn_name == "cosine"
    theirs = st.encode(texts, convert_to_tensor=True)
    tokenizer, encoder = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = pool(encoder(**batch).last_hidden_state, batch["attention_mask"], mode)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    other = pool(encoder(**batch).last_hidden_state, batch["attention_mask"], "cls" if mode == "mean" else "mean")
    assert not torch.allclose(other, theirs, atol=1e-3)   # the control: the other pooling is not what it loaded


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_scores_are_the_information_retrieval_evaluators(tmp_path, sample_dir, shared_tokenizer, similarity):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    model_dir = tiny_encoder(tmp_path / "model", shared_tokenizer)
    write_sentence_transformer(model_dir, "mean", similarity)
    corpus, queries, relevant = read_beir(beir_folder(tmp_path / "beir", sample_dir))
    assert "q-none" not in queries and relevant["q1"] == {"d003"} and relevant["q0"] == {"d000", "d001"}
    st = SentenceTransformer(str(model_dir), device="cpu")
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, ndcg_at_k=[10], mrr_at_k=[10],
                                              precision_recall_at_k=[100], accuracy_at_k=[1], map_at_k=[10],
                                              show_progress_bar=False, batch_size=32)
    theirs = evaluator(st)
    query_ids, corpus_ids = list(queries), list(corpus)
    q = st.encode([queries[i] for i in query_ids], convert_to_tensor=True, batch_size=32)
    c = st.encode([corpus[i] for i in corpus_ids], convert_to_tensor=True, batch_size=32)
    ours = scores(q, c, query_ids, corpus_ids, relevant, similarity=similarity)
    for name in ("ndcg@10", "mrr@10", "recall@100"):
        assert ours[name] == pytest.approx(theirs[f"{similarity}_{name}"], abs=1e-9), (name, ours, theirs)
    # chunks of 7 queries' scores rank as one chunk; a query without a relevant document is left out, as ST leaves it
    assert scores(q, c, query_ids, corpus_ids, relevant, similarity=similarity) == \
        scores(torch.cat([q, q[:1]]), c, query_ids + ["q-none"], corpus_ids, relevant, similarity=similarity)
    from bert_recipes.metrics.retrieval import ranked
    assert ranked(q, c, corpus_ids, 100, similarity, cells=7 * len(c)) == ranked(q, c, corpus_ids, 100, similarity)
    assert len(ranked(q[:2], c[:5], corpus_ids[:5], 100, similarity)[0]) == 5   # a depth beyond the corpus
    assert 0 < ours["ndcg@10"] < 1 and ours["recall@100"] > ours["ndcg@10"], ours   # neither empty nor perfect
    shuffled = {query: relevant[other] for query, other in zip(query_ids, query_ids[1:] + query_ids[:1])}
    assert scores(q, c, query_ids, corpus_ids, shuffled)["ndcg@10"] < ours["ndcg@10"] / 2   # the control


def test_a_beir_folder_without_its_files_or_with_unknown_documents_is_one_line(tmp_path, sample_dir):
    with pytest.raises(ValueError, match=r"data.beir_dir=.*: no qrels/dev.tsv there"):
        read_beir(beir_folder(tmp_path / "a", sample_dir), "dev")
    folder = beir_folder(tmp_path / "b", sample_dir)
    with open(folder / "qrels/test.tsv", "a") as f:
        f.write("q2\tnowhere\t1\n")
    with pytest.raises(ValueError, match=r"names documents not in corpus.jsonl \(nowhere"):
        read_beir(folder)
    folder = beir_folder(tmp_path / "c", sample_dir)
    with open(folder / "qrels/test.tsv", "a") as f:
        f.write("q2\td002\thigh\n")
    with pytest.raises(ValueError, match=r"qrels/test.tsv line 83 is \['q2', 'd002', 'high'\]; each line is query-id, "
                                         r"corpus-id and a numeric score"):
        read_beir(folder)
