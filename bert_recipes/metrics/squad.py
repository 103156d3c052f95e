"""SQuAD's answers from a question-answering model's start and end logits over the windows (features) of each example,
as the field takes them (transformers' run_qa.py post-processing; tests/data/qa-postprocessing-reference.json holds
its outputs on fixed inputs, which these must equal): in every window, the n_best highest start and end positions
that fall in the context, ordered, at most max_answer_length tokens apart; the example's best span by start + end
logit; with unanswerable questions (SQuAD v2.0), the null answer's score (the windows' lowest [CLS] start + end)
against the best span's, the empty answer where it wins by more than the threshold. -> {id: text}, and for v2.0
{id: null score minus the best span's} (null_odds.json)."""
from __future__ import annotations

import numpy as np


def answers(examples: dict, features: list[dict], start_logits, end_logits, with_negative: bool = False,
            n_best: int = 20, max_answer_length: int = 30, null_threshold: float = 0.0) -> tuple[dict, dict | None]:
    """examples: {"id": [...], "context": [...]}; features: each window's {"example_id", "offset_mapping"} (None
    where a token is not the context's); the logits: one row a feature."""
    windows: dict[str, list[int]] = {}
    for k, feature in enumerate(features):
        windows.setdefault(feature["example_id"], []).append(k)
    found, null_odds = {}, ({} if with_negative else None)
    for example_id, context in zip(examples["id"], examples["context"]):
        spans, null = [], None   # (score, start logit, end logit, first char, last char)
        for k in windows.get(example_id, []):
            starts, ends, offsets = start_logits[k], end_logits[k], features[k]["offset_mapping"]
            at_cls = starts[0] + ends[0]
            if null is None or at_cls < null[0]:
                null = (at_cls, starts[0], ends[0])
            for i in np.argsort(starts)[::-1][:n_best]:
                for j in np.argsort(ends)[::-1][:n_best]:
                    if i >= len(offsets) or j >= len(offsets) or offsets[i] is None or offsets[j] is None:
                        continue
                    if not 0 <= j - i < max_answer_length:
                        continue
                    spans.append((starts[i] + ends[j], starts[i], ends[j], offsets[i][0], offsets[j][1]))
        ranked = sorted(spans, key=lambda s: s[0], reverse=True)[:n_best]
        texts = [(context[a:b], score, s, e) for score, s, e, a, b in ranked]
        if not with_negative:
            found[example_id] = texts[0][0] if texts and not (len(texts) == 1 and texts[0][0] == "") else "empty"
            continue
        best = next(((text, s, e) for text, _, s, e in texts if text != ""), None)
        if best is None:   # no non-empty span at all: run_qa's stand-in prediction, scored 0
            best = ("empty", 0.0, 0.0)
        diff = float(null[0] - best[1] - best[2])
        null_odds[example_id] = diff
        found[example_id] = "" if diff > null_threshold else best[0]
    return found, null_odds


# ----------------------------------------------------------------------------- the scores
def normalized(text: str) -> str:
    """The official SQuAD evaluation's normalisation: lower case, punctuation and the articles a/an/the removed,
    whitespace collapsed."""
    import re
    import string
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the normalised words' overlap; for an unanswerable question (no words on either side) 1 when both are
    empty, else 0."""
    from collections import Counter
    ours, theirs = normalized(prediction).split(), normalized(gold).split()
    if not ours or not theirs:
        return float(ours == theirs)
    common = sum((Counter(ours) & Counter(theirs)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ours), common / len(theirs)
    return 2 * precision * recall / (precision + recall)


def scores(found: dict, golds: dict) -> dict:
    """Exact match and F1 in percent, each question's best over its gold answers (an unanswerable one's gold is
    the empty answer), averaged over `golds`; with unanswerable questions among them, also over those with an
    answer (HasAns_) and those without (NoAns_), as the official v2.0 script reports them."""
    em, f1, has = {}, {}, {}
    for qid, texts in golds.items():
        texts = [t for t in texts if normalized(t)] or [""]
        has[qid] = texts != [""]
        em[qid] = max(float(normalized(found.get(qid, "")) == normalized(t)) for t in texts)
        f1[qid] = max(token_f1(found.get(qid, ""), t) for t in texts)
    out = {"exact_match": 100 * sum(em.values()) / max(len(em), 1), "f1": 100 * sum(f1.values()) / max(len(f1), 1)}
    if not all(has.values()):
        for name, keep in (("HasAns", True), ("NoAns", False)):
            ids = [q for q in golds if has[q] == keep]
            if ids:
                out[f"{name}_exact"] = 100 * sum(em[q] for q in ids) / len(ids)
                out[f"{name}_f1"] = 100 * sum(f1[q] for q in ids) / len(ids)
    return out
