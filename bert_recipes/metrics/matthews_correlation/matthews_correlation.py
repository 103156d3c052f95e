"""Matthews correlation coefficient (multiclass form of Gorodkin 2004), as scikit-learn; the GLUE CoLA metric."""
import datasets
import evaluate
import numpy as np


class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: int labels",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        labels = np.union1d(p, r)
        index = {c: i for i, c in enumerate(labels)}
        cm = np.zeros((len(labels), len(labels)), dtype=np.float64)
        for pi, ri in zip(p, r):
            cm[index[ri], index[pi]] += 1
        t, pk = cm.sum(axis=1), cm.sum(axis=0)   # true and predicted counts per class
        c, s = np.trace(cm), cm.sum()
        denom = np.sqrt((s * s - pk @ pk) * (s * s - t @ t))
        return {"matthews_correlation": 0.0 if denom == 0 else float((c * s - t @ pk) / denom)}
