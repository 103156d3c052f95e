"""The task kinds a recipe trains (task.kind): a row each here, and a file each beside this one (mlm.py,
classification.py) holding the whole kind behind one contract (bert_recipes/interface.py: `Task`): how its text
becomes model inputs, its collator, which head it trains on each architecture, its loss for the pipeline, its
evaluation rows, metrics and predictions, its trial batch and its model card's words. A new kind is one file and
one row. The rows are data and import nothing: config validation reads them before a launch, and the data layer
(bert_recipes/data/sources.py) reads the sample files a kind trains on from its row."""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskKind:
    """One row.
    title: what the kind trains, for lines and the model card;
    masked_lm: pretraining on masked tokens: the masking fields (data.mlm_probability_end, max_predictions_per_seq,
      whole_word_masking), packing and document masks, mixtures and downstream scores apply to it, and it may train
      its own tokenizer; the planner and the MFU count its vocabulary head;
    labelled: each row has a label (data.label_column, task.num_labels, task.label_names);
    test_predictions: data.test_splits writes its predictions (a submission file);
    answer_files: the final evaluation also writes its answers in the task's own files (SQuAD's predictions.json
      and null_odds.json), as `AnswerFiles` gives them;
    per_token: its head scores every token (token classification), not one a sequence: the planner's count;
    metrics: the evaluation's metric names (None: task.metrics, or its defaults by task.num_labels);
    sample: the embedded sample's files it trains on: (datasets builder, path under data.sample_dir with {split},
      the splits there), or None: the sample has none for it (data.source=sample is refused in one line);
    pipeline_tag: the Hub's task tag for an export;
    sentence_embeddings: it trains an embedding a text: its step is contrastive.accelerate_step (the loss over the
      whole global batch, not a micro batch's), and its export is also a sentence-transformers model."""
    title: str
    masked_lm: bool
    labelled: bool
    test_predictions: bool
    answer_files: bool
    per_token: bool
    metrics: tuple[str, ...] | None
    sample: tuple[str, str, tuple[str, ...]] | None
    pipeline_tag: str
    sentence_embeddings: bool = False


TASKS = {
    "mlm": TaskKind("masked-language-model pretraining", masked_lm=True, labelled=False, test_predictions=False,
                    answer_files=False, per_token=True, metrics=("eval_loss", "perplexity", "mlm_accuracy"),
                    sample=("text", "pretrain/{split}.txt", ("train", "validation")), pipeline_tag="fill-mask"),
    "classification": TaskKind("sequence classification", masked_lm=False, labelled=True, test_predictions=True,
                               answer_files=False, per_token=False, metrics=None,
                               sample=("json", "classify/{split}.jsonl", ("train", "validation", "test")),
                               pipeline_tag="text-classification"),
    "token_classification": TaskKind("token classification (named entities, BIO tags)", masked_lm=False,
                                     labelled=True, test_predictions=False, answer_files=False,
                                     per_token=True, metrics=("f1", "precision", "recall", "accuracy"),
                                     sample=("json", "ner/{split}.jsonl", ("train", "validation", "test")),
                                     pipeline_tag="token-classification"),
    "question_answering": TaskKind("extractive question answering (SQuAD)", masked_lm=False, labelled=True,
                                   test_predictions=False, answer_files=True, per_token=True,
                                   metrics=("exact_match", "f1"),
                                   sample=("json", "qa/{split}.jsonl", ("train", "validation")),
                                   pipeline_tag="question-answering"),
    "retrieval": TaskKind("retrieval embeddings (contrastive, in-batch negatives)", masked_lm=False, labelled=False,
                          test_predictions=False, answer_files=False, per_token=False,
                          metrics=("ndcg@10", "mrr@10", "recall@100"),
                          sample=("json", "retrieval/{split}.jsonl", ("train", "validation", "test")),
                          pipeline_tag="sentence-similarity", sentence_embeddings=True),
}


def kind_of(kind: str):
    """The kind's file (bert_recipes/tasks/<kind>.py): imported on first use (it imports torch)."""
    if kind not in TASKS:
        raise ValueError(f"task.kind={kind}: no such task kind (bert_recipes/tasks/: {', '.join(TASKS)})")
    return importlib.import_module(f".{kind}", __name__)


def reported_metrics(task) -> list[str]:
    """The metric names an evaluation of this task (a TaskConfig) reports: its row's, else task.metrics or the
    defaults for task.num_labels (a regression also reports its MSE as eval_loss)."""
    from ..metrics import default_metrics   # the metric scripts' names (stdlib only)
    row = TASKS[task.kind]
    if row.metrics is not None:
        return list(row.metrics)
    return list(task.metrics or default_metrics(task.num_labels)) + (["eval_loss"] if task.num_labels == 1 else [])
