"""The recipes that name a reference (ModernBERT, BERT), value by value against the reference's own files.

recipes/references.tsv is the data: a row a recipe's key, with the reference's value in this repository's terms, the
reference's own text, where it says it (repository@commit path:line, or the paper's section), and the verdict: `same`,
or `different: <why>`. This tool reads each recipe as a run resolves it (its unset keys at the value a run takes) and
checks every row offline: a `same` row whose recipe value is not the reference's, or a `different` row whose value
is, fails. docs/recipes.md shows the table it prints.

    python tools/fidelity.py              # check every row; exit 1 with a line a row that does not hold
    python tools/fidelity.py --markdown   # the table of docs/recipes.md
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TABLE = REPO / "recipes/references.tsv"
COLUMNS = ("recipe", "key", "reference", "their", "source", "verdict")


def rows(path: Path = TABLE) -> list[dict]:
    with open(path, newline="") as f:
        found = list(csv.DictReader(f, delimiter="\t"))
    for n, row in enumerate(found, 2):
        if tuple(row) != COLUMNS or not (row["verdict"] == "same" or row["verdict"].startswith("different: ")):
            raise SystemExit(f"{path}:{n}: a row has the columns {', '.join(COLUMNS)} and a verdict `same` or "
                             "`different: <why>`")
    return found


def effective(cfg, key: str):
    """The value a run of `cfg` takes for `key`: the recipe's, or where it leaves the key unset, the run's default
    (the architecture's attention dropout; the attention output's is the attention's; evaluation masks at the
    training rate)."""
    from bert_recipes.architectures import ARCHITECTURES
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    if value is not None:
        return value
    if key == "model.attention_probs_dropout_prob":
        return ARCHITECTURES[cfg.model.architecture or "bert"].attention_dropout   # unset: bert (a fresh model)
    if key == "model.attention_output_dropout":
        return effective(cfg, "model.attention_probs_dropout_prob")
    if key == "data.eval_mlm_probability":
        return cfg.data.mlm_probability
    if key == "model.hidden_dropout_prob":   # a fresh BertConfig's (a named checkpoint keeps its own)
        return 0.1
    return None


def equal(ours, theirs) -> bool:
    if isinstance(theirs, bool) or isinstance(ours, bool):
        return ours is theirs
    if isinstance(theirs, (int, float)) and isinstance(ours, (int, float)):
        return math.isclose(ours, theirs, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(theirs, list) and isinstance(ours, (list, tuple)):
        return len(ours) == len(theirs) and all(equal(a, b) for a, b in zip(ours, theirs))
    return ours == theirs


def check(table: list[dict]) -> list[str]:
    """One line a row that does not hold; [] when every row does."""
    import yaml

    from bert_recipes.config import load_config
    configs, problems = {}, []
    for row in table:
        cfg = configs.setdefault(row["recipe"], load_config(REPO / row["recipe"]))
        ours, theirs = effective(cfg, row["key"]), yaml.safe_load(row["reference"])
        same = equal(ours, theirs)
        if row["verdict"] == "same" and not same:
            problems.append(f"{row['recipe']}: {row['key']}={ours!r}, and its reference ({row['source']}) says "
                            f"{row['reference']}: set it, or say why it differs in recipes/references.tsv")
        if row["verdict"] != "same" and same:
            problems.append(f"{row['recipe']}: {row['key']}={ours!r} is the reference's ({row['source']}), and "
                            "recipes/references.tsv says it differs: make the row `same`")
    return problems


def markdown(table: list[dict]) -> str:
    """docs/recipes.md's table: a row a recipe's key, the recipe's value beside the reference's."""
    from bert_recipes.config import load_config
    configs = {}
    lines = ["| recipe | key | here | reference | its text, where | verdict |", "|---|---|---|---|---|---|"]
    for row in table:
        cfg = configs.setdefault(row["recipe"], load_config(REPO / row["recipe"]))
        here = effective(cfg, row["key"])
        here = "true" if here is True else "false" if here is False else here
        lines.append(f"| `{Path(row['recipe']).stem}` | `{row['key']}` | {here} | {row['reference']} | "
                     f"`{row['their']}`: {row['source']} | {row['verdict']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/recipes.md's table")
    args = parser.parse_args(argv)
    table = rows()
    if args.markdown:
        print(markdown(table))
        return 0
    problems = check(table)
    for line in problems:
        print(line, file=sys.stderr)
    recipes = sorted({row["recipe"] for row in table})
    print(f"[fidelity] {len(table)} values of {len(recipes)} recipes against their references: "
          + ("every row holds" if not problems else f"{len(problems)} do not"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
