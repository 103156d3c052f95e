"""Metric scripts shipped with the repository, loaded through `evaluate.load(<local dir>)`.

`evaluate.load("accuracy")` needs the Hugging Face Hub, which offline machines cannot
reach; these scripts are the same metrics computed with numpy, and they load offline.
Each lives in `<name>/<name>.py` as `evaluate` expects (one import per line: evaluate's
dependency scanner misreads `import a, b`).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent


def available_metrics() -> list[str]:
    return sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").exists())


def default_metrics(num_labels: int) -> list[str]:
    return ["pearsonr", "spearmanr"] if num_labels == 1 else ["accuracy", "f1"]


@lru_cache(maxsize=None)
def load_metric(name: str):
    import evaluate
    if name not in available_metrics():
        raise ValueError(f"unknown metric '{name}' (available: {available_metrics()})")
    return evaluate.load(str(METRICS_DIR / name))


def compute_metrics(names: list[str], predictions, references, num_labels: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in names:
        kwargs = {}
        if name == "f1":
            kwargs["average"] = "binary" if num_labels == 2 else "macro"
        out.update(load_metric(name).compute(predictions=predictions, references=references, **kwargs))
    return {k: float(v) for k, v in out.items()}


def majority_baseline(train_labels, eval_labels) -> float:
    """Accuracy of always predicting the training set's most frequent label."""
    import torch
    values, counts = torch.unique(torch.as_tensor(train_labels), return_counts=True)
    return float((torch.as_tensor(eval_labels) == values[counts.argmax()]).float().mean())


def joined_rows(parts: list[dict]) -> dict:
    """Batches of rows (CPU tensors; every rank's, each sample once) -> one numpy array per key,
    what a task's metrics read (bert_recipes/tasks/<kind>.py); loss sums in float64."""
    import torch
    keys = {key for part in parts for key in part}
    rows = {k: torch.cat([p[k] for p in parts if k in p]).numpy() for k in keys}
    if "loss_sums" in rows:
        rows["loss_sums"] = rows["loss_sums"].astype("float64")
    return rows
