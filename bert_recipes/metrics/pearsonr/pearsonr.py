"""Pearson correlation between predicted and reference scores (GLUE STS-B)."""
import datasets
import evaluate
import numpy as np


class Pearsonr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: floats",
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}))

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        p, r = p - p.mean(), r - r.mean()
        denom = np.sqrt((p @ p) * (r @ r))
        return {"pearsonr": 0.0 if denom == 0 else float(p @ r / denom)}
