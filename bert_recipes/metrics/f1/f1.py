"""F1 score. average='binary' scores the positive class (label 1); 'macro' averages the
per-class F1 over every class present in predictions or references (as scikit-learn)."""
import datasets
import evaluate
import numpy as np


def _f1(p, r, label):
    tp = np.sum((p == label) & (r == label))
    fp = np.sum((p == label) & (r != label))
    fn = np.sum((p != label) & (r == label))
    return 0.0 if tp == 0 else float(2 * tp / (2 * tp + fp + fn))


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: int labels",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references, average="binary", pos_label=1):
        p, r = np.asarray(predictions), np.asarray(references)
        if average == "binary":
            return {"f1": _f1(p, r, pos_label)}
        if average == "macro":
            labels = np.union1d(p, r)
            return {"f1": float(np.mean([_f1(p, r, c) for c in labels]))}
        raise ValueError(f"average must be 'binary' or 'macro', got {average!r}")
