"""The repository's metric scripts load offline through `evaluate` and agree with scikit-learn / scipy."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from bert_recipes.metrics import METRICS_DIR, available_metrics, compute_metrics, load_metric


def test_all_expected_metrics_ship():
    assert set(available_metrics()) >= {"accuracy", "f1", "matthews_correlation", "pearsonr", "spearmanr"}


def test_scripts_load_from_the_repository_offline():
    metric = load_metric("accuracy")
    assert type(metric).__name__ == "Accuracy"
    assert (METRICS_DIR / "accuracy" / "accuracy.py").exists()


@pytest.mark.parametrize("num_labels", [2, 5])
def test_classification_metrics_match_sklearn(num_labels):
    rng = np.random.default_rng(num_labels)
    refs = rng.integers(0, num_labels, 300)
    preds = np.where(rng.random(300) < 0.6, refs, rng.integers(0, num_labels, 300))
    got = compute_metrics(["accuracy", "f1", "matthews_correlation"], preds, refs, num_labels)
    average = "binary" if num_labels == 2 else "macro"
    assert got["accuracy"] == pytest.approx(sklearn.metrics.accuracy_score(refs, preds))
    assert got["f1"] == pytest.approx(sklearn.metrics.f1_score(refs, preds, average=average))
    assert got["matthews_correlation"] == pytest.approx(sklearn.metrics.matthews_corrcoef(refs, preds))


def test_regression_metrics_match_scipy():
    rng = np.random.default_rng(0)
    refs = np.round(rng.random(200) * 5, 1)   # ties, as in STS-B's 0-5 scores
    preds = refs + rng.normal(0, 1, 200)
    got = compute_metrics(["pearsonr", "spearmanr"], preds, refs, num_labels=1)
    assert got["pearsonr"] == pytest.approx(scipy.stats.pearsonr(preds, refs)[0])
    assert got["spearmanr"] == pytest.approx(scipy.stats.spearmanr(preds, refs)[0])


def test_degenerate_inputs_do_not_crash():
    assert compute_metrics(["matthews_correlation"], [1, 1, 1], [1, 1, 1], 2)["matthews_correlation"] == 0.0
    assert compute_metrics(["f1"], [0, 0], [0, 0], 2)["f1"] == 0.0
