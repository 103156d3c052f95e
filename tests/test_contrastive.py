"""The contrastive loss and its GradCache step (bert_recipes/contrastive.py), against sentence-transformers: the loss is
MultipleNegativesRankingLoss's, and one cached step gives CachedMultipleNegativesRankingLoss's loss and gradient;
the step over micro batches equals one forward over the batch (with dropout, replayed); on 2 real processes with the
embeddings gathered, the loss and the averaged gradient are one process's over the whole batch."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bert_recipes.contrastive import cached_step, in_batch_loss
from bert_recipes.embeddings import pool
from conftest import REPO, launch_script, tiny_encoder

SCALE = 20.0   # sentence-transformers' default: temperature 0.05


def embedder(model_dir):
    """The encoder in training mode, its mean-pooled embedding of a micro batch's inputs, and its tokenizer call."""
    from transformers import AutoModel, AutoTokenizer
    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir)
    model.train()

    def embed(inputs):
        return pool(model(**inputs).last_hidden_state, inputs["attention_mask"], "mean")

    def tokenize(texts):
        return dict(tokenizer(texts, padding="max_length", truncation=True, max_length=32, return_tensors="pt"))
    return model, embed, tokenize


def micro_batches(tokenize, columns, micro):
    """Columns of texts (queries, positives, negatives) -> micro batches of `micro` rows, each a list of inputs."""
    return [[tokenize(c[s:s + micro]) for c in columns] for s in range(0, len(columns[0]), micro)]


def pair_texts(sample_dir: Path, n: int = 8) -> list[list[str]]:
    """n queries (a docstring's first words), their positives (the docstring) and hard negatives (the next one)."""
    docs = [json.loads(line)["text"] for line in (sample_dir / "classify/train.jsonl").read_text().splitlines()][:n + 1]
    return [[d[:40] for d in docs[:n]], docs[:n], docs[1:n + 1]]


def one_forward(model_dir, columns):
    """The reference: every row embedded in one forward with its graph, the loss, backward. -> loss, gradients."""
    model, embed, tokenize = embedder(model_dir)
    loss = in_batch_loss(*(lambda e: (e[0], e[1:]))([embed(tokenize(c)) for c in columns]), SCALE)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cached(model_dir, columns, micro, **kwargs):
    """Our cached step over micro batches of `micro` rows, each replay inside a context that records its number."""
    from contextlib import contextmanager
    model, embed, tokenize = embedder(model_dir)
    batches, entered = micro_batches(tokenize, columns, micro), []

    @contextmanager
    def around(i):
        entered.append(i)
        yield
    loss = cached_step(embed, batches, SCALE, lambda t: (t / len(batches)).backward(), scale_back=len(batches),
                       around=around, **kwargs)
    assert entered == list(range(len(batches)))
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads(a: dict, b: dict, tol: float):
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert worst <= tol, worst


def test_the_loss_is_multiple_negatives_ranking_loss(tmp_path, shared_tokenizer):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from bert_recipes.embeddings import write_sentence_transformer
    model_dir = tiny_encoder(tmp_path / "m", shared_tokenizer)
    write_sentence_transformer(model_dir, "mean")
    reference = MultipleNegativesRankingLoss(SentenceTransformer(str(model_dir), device="cpu"), scale=SCALE)
    g = torch.Generator().manual_seed(0)
    q, p, n = (torch.randn(6, 16, generator=g) for _ in range(3))
    for docs in ([p], [p, n]):
        ours = in_batch_loss(q, docs, SCALE)
        assert float(ours) == pytest.approx(float(reference.compute_loss_from_embeddings([q, *docs], None)), abs=1e-6)
    assert float(in_batch_loss(q, [p], SCALE)) != pytest.approx(float(in_batch_loss(q, [p], 1.0)), abs=1e-3)


def test_a_cached_step_is_cached_multiple_negatives_ranking_loss(tmp_path, sample_dir, shared_tokenizer):
    """sentence-transformers' CachedMultipleNegativesRankingLoss (mini batches of 2) on a SentenceTransformer of the
    same weights, without dropout: the same loss and the same gradient as our cached step over micro batches of 2."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from bert_recipes.embeddings import write_sentence_transformer
    model_dir = tiny_encoder(tmp_path / "m", shared_tokenizer, dropout=0.0)
    columns = pair_texts(sample_dir)
    loss, grads = cached(model_dir, columns, 2)
    write_sentence_transformer(model_dir, "mean")
    st = SentenceTransformer(str(model_dir), device="cpu")
    st.max_seq_length = 32
    st.train()
    reference = CachedMultipleNegativesRankingLoss(st, scale=SCALE, mini_batch_size=2)
    theirs = reference([st.preprocess(c) for c in columns], None)
    theirs.backward()
    assert float(loss) == pytest.approx(float(theirs), abs=1e-5)
    their_grads = {n.split("model.", 1)[-1]: p.grad for n, p in st.named_parameters() if p.grad is not None}
    assert set(their_grads) == set(grads)
    assert_grads(grads, their_grads, 1e-5)


def test_micro_batches_give_one_forwards_loss_and_gradient(tmp_path, sample_dir, shared_tokenizer):
    model_dir = tiny_encoder(tmp_path / "m", shared_tokenizer, dropout=0.0)
    columns = pair_texts(sample_dir)
    loss, grads = one_forward(model_dir, columns)
    for micro in (8, 2):
        ours, our_grads = cached(model_dir, columns, micro)
        assert float(ours) == pytest.approx(float(loss), abs=1e-6), micro
        assert_grads(our_grads, grads, 1e-5)   # float32's rounding of other shapes


def test_dropout_is_drawn_once_and_replayed(tmp_path, sample_dir, shared_tokenizer, monkeypatch):
    """With dropout on, the cached step equals a forward with the graph over the same micro batches in the same order
    (the same masks); with the random state not replayed, the second pass draws other masks and it does not."""
    model_dir = tiny_encoder(tmp_path / "m", shared_tokenizer, dropout=0.1)
    columns = pair_texts(sample_dir)
    model, embed, tokenize = embedder(model_dir)
    torch.manual_seed(7)
    embedded = [[embed(inputs) for inputs in batch] for batch in micro_batches(tokenize, columns, 2)]
    loss = in_batch_loss(*(lambda e: (e[0], e[1:]))([torch.cat(c) for c in zip(*embedded)]), SCALE)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.manual_seed(7)
    ours, our_grads = cached(model_dir, columns, 2)
    assert float(ours) == pytest.approx(float(loss), abs=1e-6)
    assert_grads(our_grads, grads, 1e-6)
    import bert_recipes.contrastive as contrastive
    from contextlib import nullcontext
    monkeypatch.setattr(contrastive, "replayed", lambda *args: nullcontext())
    torch.manual_seed(7)
    _, unreplayed = cached(model_dir, columns, 2)
    assert max(float((unreplayed[n] - grads[n]).abs().max()) for n in grads) > 1e-4   # the control


def test_two_processes_gathered_give_one_process_whole_batch(tmp_path, sample_dir, shared_tokenizer):
    model_dir = tiny_encoder(tmp_path / "m", shared_tokenizer, dropout=0.0)
    columns = pair_texts(sample_dir)
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(columns))
    out = tmp_path / "two.pt"
    log = launch_script("tests/contrastive_harness.py", [str(model_dir), str(texts), "2", str(out)], 2,
                        launcher="torchrun", timeout=300)
    assert "rank 0 of 2 processes, backend gloo" in log and "rank 1 of 2 processes" in log, log[-2000:]
    two = torch.load(out)
    loss, grads = one_forward(model_dir, columns)
    assert float(two["loss"]) == pytest.approx(float(loss), abs=1e-6)
    assert_grads(two["grads"], grads, 1e-5)
    # the control: one rank's half alone (no gathering) is another loss
    half = [c[:len(c) // 2] for c in columns]
    assert float(cached(model_dir, half, 2)[0]) != pytest.approx(float(loss), abs=1e-3)
