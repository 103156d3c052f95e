"""Every shipped recipe under every ZeRO stage (accelerate_configs/backends.tsv's first row of each), on 2 processes:
its first two optimizer steps, cut to a CPU's size but with what the recipe decides kept (tests/recipes_harness.py
says what is cut and what stays), or the one line that refuses it. A recipe is refused only where its optimizer needs
whole parameter tensors (LAMB, StableAdamW: backends/consistency.WHOLE_TENSORS); every other one trains on every
stage. The launch's log holds a library warning at most twice per rank, over the launch's 22 runs."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from bert_recipes.backends.consistency import WHOLE_TENSORS
from bert_recipes.backends.plan import first_row
from bert_recipes.config import load_config
from conftest import REPO, backend_rows, launch_script

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
STAGES = {stage: first_row("deepspeed", stage) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, sample_dir, shared_tokenizer):
    from glue_shaped import build_glue_like
    root = tmp_path_factory.mktemp("recipes")
    return [root / "cache", sample_dir, shared_tokenizer, build_glue_like(root / "glue", sample_dir)]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_recipe_takes_its_first_steps_or_is_refused_in_one_line(stage, inputs, tmp_path):
    name = STAGES[stage]
    assert backend_rows()[name].plan.zero_stage == stage
    cache, sample, tokenizer, glue = inputs
    log = launch_script("tests/recipes_harness.py", [str(tmp_path), str(sample), str(cache), str(tokenizer), str(glue)],
                        2, backend=name, timeout=900)
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results) == RECIPES
    for recipe, result in results.items():
        optimizer = load_config(REPO / f"recipes/{recipe}.yaml").optim.name
        if optimizer in WHOLE_TENSORS:
            assert result == {"refused": result.get("refused")} and "\n" not in result["refused"], (recipe, result)
            assert f"optim.name={optimizer} needs whole parameter tensors" in result["refused"], (recipe, result)
            assert f"ZeRO-{stage}" in result["refused"], (recipe, result)
            continue
        assert "refused" not in result, (recipe, result)
        backend = result["backend"]
        assert result["steps"] == 2 and result["num_processes"] == 2, (recipe, result)
        assert backend["distributed_type"] == "DistributedType.DEEPSPEED" and backend["zero_stage"] == stage, \
            (recipe, backend)
    # a library warning comes a few times in the launch's 22 runs, not with every gradient bucket (ZeRO-3's numactl
    # processes reset the warning registry: 3,804 lines before backends/deepspeed.ask_numa_once): twice a rank at most
    warned = Counter(line for line in log.splitlines() if re.search(r"\w+Warning: ", line))
    assert all(n <= 2 * 2 for n in warned.values()), "\n".join(f"{n} {line}" for line, n in warned.most_common(3))
