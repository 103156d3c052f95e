"""SQuAD's post-processing (bert_recipes/metrics/squad.py) against the field's own: transformers' run_qa.py
post-processing (utils_qa.postprocess_qa_predictions at 31f57e9), run once on fixed windows and logits, its outputs
kept in tests/data/qa-postprocessing-reference.json with their source. The answers, and for SQuAD v2.0 the null
odds, are the same, exactly; the controls: the same logits with the null answer's threshold moved, and with a
shorter maximum answer, give other answers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bert_recipes.metrics.squad import answers, scores

REFERENCE = json.loads((Path(__file__).parent / "data/qa-postprocessing-reference.json").read_text())


@pytest.mark.parametrize("case", ["v1", "v2", "v2_threshold"])
def test_the_answers_are_run_qas(case):
    ref = REFERENCE[case]
    start = np.asarray(REFERENCE["start_logits"], dtype=np.float32)
    end = np.asarray(REFERENCE["end_logits"], dtype=np.float32)
    found, null_odds = answers(REFERENCE["examples"], REFERENCE["features"], start, end,
                               with_negative=ref["version_2_with_negative"],
                               null_threshold=ref["null_score_diff_threshold"])
    assert found == ref["predictions"]
    assert null_odds == ref["null_odds"]


def test_the_controls_change_the_answers():
    start = np.asarray(REFERENCE["start_logits"], dtype=np.float32)
    end = np.asarray(REFERENCE["end_logits"], dtype=np.float32)
    v2 = REFERENCE["v2"]["predictions"]
    moved, _ = answers(REFERENCE["examples"], REFERENCE["features"], start, end, with_negative=True,
                       null_threshold=100.0)
    assert moved != v2 and all(text for text in moved.values())   # no null answer wins by 100
    shorter, _ = answers(REFERENCE["examples"], REFERENCE["features"], start, end, max_answer_length=3)
    assert shorter != REFERENCE["v1"]["predictions"]


def test_exact_match_and_f1_follow_the_official_normalisation():
    """The official script's rules on hand-built answers: case, punctuation and articles do not count; F1 is the
    normalised words' overlap, the best over a question's gold answers; an unanswerable question (gold: none) scores 1
    for the empty answer only; v2.0 splits HasAns / NoAns. The control: a raw string comparison scores lower."""
    golds = {"a": ["The Eiffel Tower", "Eiffel Tower in Paris"], "b": ["Denver Broncos"], "c": []}
    found = {"a": "eiffel tower!", "b": "the Broncos", "c": ""}
    got = scores(found, golds)
    f1_b = 2 * (1 / 1) * (1 / 2) / (1 + 1 / 2)   # "broncos" against "denver broncos"
    assert got["exact_match"] == pytest.approx(100 * 2 / 3) and got["f1"] == pytest.approx(100 * (1 + f1_b + 1) / 3)
    assert got["HasAns_exact"] == pytest.approx(50.0) and got["NoAns_exact"] == 100.0
    assert scores({"c": "something"}, {"c": []})["f1"] == 0.0
    raw = sum(found[q] in golds[q] or (not golds[q] and found[q] == "") for q in golds) / 3 * 100
    assert raw < got["exact_match"]
