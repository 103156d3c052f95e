"""Retrieval embeddings (task.kind=retrieval), the whole kind behind the task contract (bert_recipes/interface.py:
`Task`): an encoder trained on (query, positive passage[, hard negatives]) pairs with the in-batch softmax over
cosine similarities (sentence-transformers' MultipleNegativesRankingLoss: bert_recipes/contrastive.py), its texts
pooled into one embedding each (task.pooling: bert_recipes/embeddings.py), scored by nDCG@10, MRR@10 and recall@100
(bert_recipes/metrics/retrieval.py) and exported as a sentence-transformers model.

Training rows hold each column's token ids (data.text_column the query, data.text_pair_column the positive,
data.negative_columns the hard negatives); a micro batch is one forward over every column's texts, the queries
first, then the positives, then each negative column (`columns` says which a row is). The step that trains on them
is contrastive.accelerate_step: the loss over the whole global batch by default (GradCache), so the run is the same
on any process count and accumulation.

Evaluation rows are single texts: every query of the evaluated split, then its corpus (every distinct positive of the
split; with data.beir_dir, a BEIR folder's queries, corpus and qrels instead). Each is embedded once, on every rank a
shard (engine.evaluate); the metrics rank each query's corpus by the gathered embeddings."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

from ..config import ConfigError, DataConfig, TaskConfig
from ..contrastive import in_batch_loss
from ..data.tokenizing import map_splits, tokenizer_fingerprint
from ..embeddings import pool
from ..modeling import ExportedAs

QUERY, DOCUMENT = 0, 1   # an evaluation row's role


def columns_of(data: DataConfig) -> list[str]:
    """The training rows' text columns, in the order the loss reads them: query, positive, hard negatives."""
    if not data.text_pair_column:
        raise ConfigError("task.kind=retrieval needs data.text_pair_column: the positive passage's column "
                          "(data.text_column is the query's), e.g. data.text_pair_column=positive")
    return [data.text_column, data.text_pair_column, *(data.negative_columns or [])]


def tokenize(raw, tokenizer, task: TaskConfig, data: DataConfig):
    """-> the training split's rows as each column's token ids (`input_ids`: a list of lists, query first), and each
    evaluation split's as single texts: its queries (role QUERY, `relevant`: the row numbers of their relevant
    passages), then its corpus (role DOCUMENT)."""
    from datasets import Dataset, DatasetDict
    names, seq = columns_of(data), data.max_seq_length
    for split, rows in raw.items():   # an evaluation split needs its queries and positives only
        missing = [c for c in (names if split == "train" else names[:2]) if c not in rows.column_names]
        if missing and (split == "train" or not data.beir_dir):
            raise ConfigError(f"column '{missing[0]}' not in the {split} split (columns: {rows.column_names}); set "
                              "data.text_column (queries), data.text_pair_column (positives), data.negative_columns")

    def encode_pairs(batch):
        encoded = [tokenizer(batch[c], truncation=True, max_length=seq, return_token_type_ids=False,
                             return_attention_mask=False)["input_ids"] for c in names]
        return {"input_ids": [list(texts) for texts in zip(*encoded)]}

    def encode_texts(batch):
        return {"input_ids": tokenizer(batch["text"], truncation=True, max_length=seq, return_token_type_ids=False,
                                       return_attention_mask=False)["input_ids"]}

    key = ["retrieval", tokenizer_fingerprint(tokenizer), seq, names]
    out = dict(map_splits(DatasetDict({"train": raw["train"]}), encode_pairs, key, "tokenizing pairs",
                          data.num_proc, raw["train"].column_names))
    for split, rows in raw.items():
        if split == "train":
            continue
        texts = evaluation_texts(rows, data, beir=split == "eval" and data.beir_dir)
        out[split] = Dataset.from_dict(texts).map(encode_texts, batched=True, remove_columns=["text"],
                                                  desc=f"tokenizing {split}")
    return DatasetDict(out)


def evaluation_texts(rows, data: DataConfig, beir) -> dict[str, list]:
    """An evaluation split as texts to embed: its queries, then its corpus; each query's relevant passages as their
    row numbers. From the split's pairs (its distinct positives the corpus), or from data.beir_dir."""
    if beir:
        from ..metrics.retrieval import read_beir
        try:
            corpus, queries, relevant = read_beir(data.beir_dir)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    else:
        corpus, queries, relevant = {}, {}, {}
        ids = {}
        for n, (query, positive) in enumerate(zip(rows[data.text_column], rows[data.text_pair_column])):
            doc = ids.setdefault(positive, f"d{len(ids)}")
            corpus[doc] = positive
            queries[f"q{n}"] = query
            relevant[f"q{n}"] = {doc}
    at = {doc: len(queries) + i for i, doc in enumerate(corpus)}
    return {"text": [*queries.values(), *corpus.values()],
            "text_id": [*queries, *corpus],
            "role": [QUERY] * len(queries) + [DOCUMENT] * len(corpus),
            "relevant": [sorted(at[d] for d in relevant[q]) for q in queries] + [[]] * len(corpus)}


def notes(tokenized, task: TaskConfig) -> list[str]:
    """The evaluation's size: queries against a corpus of passages."""
    roles = tokenized["eval"]["role"]
    queries = sum(r == QUERY for r in roles)
    return [f"[data] retrieval evaluation: {queries} queries against {len(roles) - queries} passages"]


# ----------------------------------------------------------------------------- the collator
class RetrievalCollator:
    """A training micro batch: every column's texts as rows of one batch (the queries, then the positives, then each
    negative column), `columns` the columns' numbers (their count: the batch's equal blocks); an evaluation batch: its texts, `labels` each row's number in its
    split. Padded to the longest (a multiple of 8), or to `fixed_length`, with an attention mask."""

    def __init__(self, tokenizer, fixed_length: int | None = None):
        self.pad_id = tokenizer.pad_token_id
        self.fixed_length = fixed_length
        self.bins: list[int] | None = None
        self.epoch = 0
        self.unpad, self.attention_path = False, None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        import numpy as np
        first = examples[0]["input_ids"]
        if first and isinstance(first[0], list):   # training: each row a list of texts, one a column
            texts = [e["input_ids"][c] for c in range(len(first)) for e in examples]
            tags = {"columns": torch.arange(len(first))}
        else:
            texts = [e["input_ids"] for e in examples]
            tags = {"labels": torch.tensor([e["idx"] for e in examples])}
        longest = max(len(t) for t in texts)
        width = self.fixed_length or -(-longest // 8) * 8
        ids = np.full((len(texts), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for row, t in enumerate(texts):
            ids[row, :len(t)], mask[row, :len(t)] = t, 1
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask), **tags}

    def evaluation_copy(self):
        return copy.copy(self)

    def follow(self, schedule) -> None:
        """A masking rate's levels: retrieval masks nothing."""


def collator(data: DataConfig, task: TaskConfig, seed: int, tokenizer, fixed_length: int | None):
    return RetrievalCollator(tokenizer, fixed_length=fixed_length)


# ----------------------------------------------------------------------------- the model
def config_fields(task: TaskConfig) -> dict:
    """The pooling and the softmax's scale the model trains with (the export's config.json keeps them)."""
    return {"sentence_pooling": task.pooling, "sentence_scale": 1.0 / task.temperature}


@dataclass
class EmbeddingOutput(ModelOutput):
    """What the model returns: `logits` each text's pooled embedding; `loss` the in-batch loss over this micro batch
    alone, where the batch gives its `columns` (a trial step's; training's runs over the global batch). A
    ModelOutput (a dict), whose tensors ZeRO-3's hooks find: a plain class hides them, and its parameters stay
    gathered."""
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class PooledEncoding:
    """The encoder (transformers' base model of the config's type, without BERT's pooler: nothing trains it) whose
    forward pools its last hidden states into one embedding a text (config.sentence_pooling). Its weights and export
    are the base model's: sentence-transformers' Transformer module loads them."""
    exported_class = ""

    @property
    def sentence_pooling(self) -> str:
        """The pooling its export's sentence-transformers files name (export.write_export writes them)."""
        return self.config.sentence_pooling

    def forward(self, input_ids=None, attention_mask=None, labels=None, columns=None, **kwargs):
        hidden = super().forward(input_ids=input_ids, attention_mask=attention_mask, return_dict=True,
                                 **kwargs).last_hidden_state
        embedded = pool(hidden, attention_mask, self.sentence_pooling)
        loss = None
        if columns is not None:
            parts = embedded.chunk(columns.numel())
            loss = in_batch_loss(parts[0], parts[1:], self.config.sentence_scale)
        return EmbeddingOutput(logits=embedded, loss=loss)


_CLASSES: dict = {}


def _encoder_class(base):
    """The base model class with PooledEncoding's forward (one class per base); its export's config.json names the
    base class (modeling.ExportedAs)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Pooled{base.__name__}", (ExportedAs, PooledEncoding, base),
                              {"exported_class": base.__name__})
    return _CLASSES[base]


def _no_pooler(base) -> dict:
    import inspect
    return {"add_pooling_layer": False} if "add_pooling_layer" in inspect.signature(base.__init__).parameters else {}


class PooledEncoder:
    """cls(config): a fresh encoder of the config's model type (built as the architectures build theirs, not by
    from_config, whose zero.Init under ZeRO-3 draws other weights); from_pretrained: a checkpoint's encoder, any
    head it has dropped (an MLM export's, a classifier's)."""

    def __new__(cls, config):
        from transformers import MODEL_MAPPING
        base = MODEL_MAPPING[type(config)]
        return _encoder_class(base)(config, **_no_pooler(base))

    @staticmethod
    def from_pretrained(name, *args, config=None, **kwargs):
        from transformers import AutoConfig, MODEL_MAPPING
        config = config or AutoConfig.from_pretrained(name)
        base = MODEL_MAPPING[type(config)]
        return _encoder_class(base).from_pretrained(name, *args, config=config, **_no_pooler(base), **kwargs)


def head(arch):
    return PooledEncoder


def loss(task: TaskConfig):
    """The pipeline's last-stage loss: the pipeline does not train this kind (its engine refuses it in one line)."""
    raise ConfigError("task.kind=retrieval: the pipeline engine does not train it; use ddp, fsdp or a ZeRO config")


def trial_labels(task: TaskConfig, ids: torch.Tensor, rate: float, k: int | None, g: torch.Generator) -> dict:
    """A trial batch as queries (its first half) and their positives (the rest)."""
    return {"columns": torch.arange(2)}


# ----------------------------------------------------------------------------- evaluation
def eval_rows(task: TaskConfig, logits, labels, masked_positions=None) -> dict:
    """Each text's embedding (fp32) and its row number in the evaluated split."""
    return {"embedding": logits.float(), "row": labels}


def metrics(task: TaskConfig, rows: dict, split=None) -> dict[str, float]:
    """nDCG@10, MRR@10 and recall@100 of the split's queries against its corpus (metrics.retrieval.scores), from
    every rank's embeddings, each text once."""
    from ..metrics.retrieval import scores
    if split is None:
        raise ValueError("retrieval's metrics need the evaluated split (its queries, corpus and qrels)")
    found, at = torch.as_tensor(rows["embedding"]), torch.as_tensor(rows["row"]).long()
    embedded = torch.empty_like(found)
    embedded[at] = found
    roles, ids, relevant = split["role"], split["text_id"], split["relevant"]
    queries = [i for i, r in enumerate(roles) if r == QUERY]
    corpus = [i for i, r in enumerate(roles) if r == DOCUMENT]
    wanted = {ids[i]: {ids[d] for d in relevant[i]} for i in queries}
    ranked = scores(embedded[queries], embedded[corpus], [ids[i] for i in queries], [ids[i] for i in corpus], wanted)
    return {**ranked, "eval_queries": len(queries), "eval_corpus": len(corpus), "eval_samples": len(roles)}


def baseline(task: TaskConfig, data) -> float | None:
    return None


def card_task(task: TaskConfig) -> str:
    return f"sentence embeddings for retrieval ({task.pooling} pooling, cosine similarity)"
