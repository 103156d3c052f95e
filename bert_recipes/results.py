"""What a run delivers besides its last state: the best evaluation kept apart, evaluations of further splits and
of a mixture's sources, test-set predictions in a submission format and the final evaluation's answers in the task's
own files (the export and its upload to the Hub:
bert_recipes/export.py).
Each takes the engine (bert_recipes/engine.py), so it works on every backend."""
from __future__ import annotations

import json
from pathlib import Path

from .checkpoint import checkpoint_root, save_checkpoint
from .config import CheckpointConfig, TaskConfig
from .tasks import TASKS, kind_of
from .ranks import barrier, print0

BEST = "best"


def lower_is_better(metric: str) -> bool:
    return "loss" in metric or metric == "perplexity"


def is_better(metric: str, value: float, best: dict | None) -> bool:
    if best is None:
        return True
    return value < best["value"] if lower_is_better(metric) else value > best["value"]


def keep_best(ckpt: CheckpointConfig, engine, state: dict, metrics: dict, output_dir: Path, config_yaml: str) -> bool:
    """After an evaluation: when checkpoint.metric_for_best improved, save this state as
    checkpoints/best (a complete checkpoint the rotation never prunes). Collective. -> saved?"""
    name = ckpt.metric_for_best
    if not name or name not in metrics or not is_better(name, metrics[name], state.get("best")):
        return False
    state["best"] = {"step": metrics["step"], "metric": name, "value": metrics[name], "metrics": dict(metrics)}
    save_checkpoint(output_dir, metrics["step"], state, config_yaml, ckpt.keep_last, engine, name=BEST)
    print0(f"[best] step {metrics['step']}: {name} {metrics[name]:.4f}, kept in {checkpoint_root(output_dir) / BEST}")
    return True


def restore_best(engine, state: dict, output_dir: Path) -> dict | None:
    """At the end: load the best evaluation's state (if it is not the last one). -> its metrics."""
    best = state.get("best")
    if not best or best["step"] == state["step"]:
        return None
    engine.load(checkpoint_root(output_dir) / BEST)
    print0(f"[best] the export, the test predictions and the final metrics come from step {best['step']} "
                  f"({best['metric']} {best['value']:.4f}), not the last step {state['step']}")
    return dict(best["metrics"])


def extra_evaluations(task: TaskConfig, engine, data) -> dict:
    """data.extra_eval_splits, each as <split>/<metric> (MNLI's mismatched set beside the matched one)."""
    out = {}
    for key in (k for k in data if k.startswith("eval:")):
        split = key.removeprefix("eval:")
        metrics = kind_of(task.kind).metrics(task, engine.evaluate(data[key]), data[key])
        out.update({f"{split}/{k}": v for k, v in metrics.items()})
        print0(f"[eval] {split}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in metrics.items()))
    return out


def evaluate_sources(task: TaskConfig, engine, data, mixture) -> dict:
    """data.mixture's evaluation (bert_recipes/data/mixture.Mixture): each source's rows on their own, and all of them
    together: the overall metrics, and each source's as <name>/<metric>. Every row is evaluated once."""
    import numpy as np
    metrics = kind_of(task.kind).metrics
    rows = {name: engine.evaluate(data[f"eval@{name}"]) for name in mixture.names}
    joined = {key: np.concatenate([r[key] for r in rows.values()]) for key in next(iter(rows.values()))}
    out = metrics(task, joined)
    for name, r in rows.items():
        out.update({f"{name}/{k}": v for k, v in metrics(task, r, data[f"eval@{name}"]).items()})
    return out


def write_answer_files(task: TaskConfig, engine, split, rows: dict | None, output_dir: Path) -> list[Path]:
    """A kind whose row has answer_files (question answering): the final evaluation's answers, as its kind writes them,
    into output_dir (SQuAD: predictions.json, and null_odds.json with unanswerable questions, as the official
    evaluation scripts read them). rows: that evaluation's, or None: evaluate the model now (the best state was
    restored, or the run ended on an evaluation made before a resume). Collective."""
    if not TASKS[task.kind].answer_files:
        return []
    rows = engine.evaluate() if rows is None else rows
    written = []
    if engine.is_main:
        for name, answers in kind_of(task.kind).answer_files(task, rows, split).items():
            path = output_dir / name
            path.write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            written.append(path)
        print0("[predict] the final evaluation's answers -> " + ", ".join(str(p) for p in written))
    barrier()
    return written


def write_predictions(task: TaskConfig, engine, data, test_index: dict, output_dir: Path) -> list[Path]:
    """data.test_splits -> output_dir/predictions/<split>.tsv: `index<TAB>prediction`, one row per
    example in the split's order, the index from the split's own idx column (GLUE's submission
    format), each prediction as the task kind writes it (classification: a label name, else a class id, or a
    value for a regression). Collective."""
    written = []
    for key in (k for k in data if k.startswith("test:")):
        split = key.removeprefix("test:")
        preds = engine.predict(data[key])
        if not engine.is_main:
            continue
        shown = kind_of(task.kind).prediction_text(task, preds)
        path = output_dir / "predictions" / f"{split}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("index\tprediction\n" + "".join(f"{i}\t{p}\n" for i, p in zip(test_index[split], shown)))
        print0(f"[predict] {split}: {len(shown)} predictions -> {path}")
        written.append(path)
    barrier()
    return written
