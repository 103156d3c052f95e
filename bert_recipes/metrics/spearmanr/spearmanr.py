"""Spearman rank correlation: Pearson on ranks, ties given their average rank (as scipy)."""
import datasets
import evaluate
import numpy as np


def _rank(x):
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    return (sums / counts)[inverse]


class Spearmanr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: floats",
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}))

    def _compute(self, predictions, references):
        p = _rank(np.asarray(predictions, dtype=np.float64))
        r = _rank(np.asarray(references, dtype=np.float64))
        p, r = p - p.mean(), r - r.mean()
        denom = np.sqrt((p @ p) * (r @ r))
        return {"spearmanr": 0.0 if denom == 0 else float(p @ r / denom)}
