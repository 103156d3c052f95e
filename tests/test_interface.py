"""One engine interface (bert_recipes/interface.py): both engines implement every member train.py
uses, with the Protocol's parameters; train.main checks the attributes after prepare on every run
(so every backend test also checks them on real processes); the device is decided once."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from bert_recipes.engine import AccelerateEngine
from bert_recipes.interface import MEMBERS, Engine, check_engine, missing_members
from bert_recipes.pipeline import PipelineEngine
from conftest import REPO


@pytest.mark.parametrize("engine", [AccelerateEngine, PipelineEngine])
def test_both_engines_implement_every_method_with_its_parameters(engine):
    methods = [n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")]
    assert len(methods) >= 19 and set(methods) <= set(MEMBERS)
    for name in methods:
        ours, theirs = inspect.signature(getattr(Engine, name)), inspect.signature(getattr(engine, name))
        assert list(ours.parameters) == list(theirs.parameters), (engine.__name__, name, theirs)


def test_a_missing_member_is_named():
    class Half:
        def print0(self, *args):
            pass
        name = "half"
    missing = missing_members(Half())
    assert "train_step" in missing and "counts_data" in missing and "print0" not in missing and "name" not in missing
    with pytest.raises(TypeError, match=r"Half does not implement the Engine interface .* missing .*train_step"):
        check_engine(Half())


def test_train_py_reads_the_device_from_the_plan_only():
    """The places that used to decide "on a GPU?" themselves now read the plan's decision
    (backend.launch_plan_here) or take the device as an input; only decide_on_gpu asks CUDA.
    (tools/memory.py plans for a device it is told; only its --gpu-memory default reads this GPU.)"""
    asks = subprocess.run(["grep", "-rn", "torch.cuda.is_available()", "train.py", "bert_recipes", "tools/allreduce.py"], cwd=REPO, capture_output=True, text=True).stdout.splitlines()
    assert [line.split(":")[0] for line in asks] == ["bert_recipes/backend.py"], asks
    probe = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from bert_recipes.backend import launch_plan_here; "
             "p = launch_plan_here({'ACCELERATE_USE_CPU': '1'}); print(p.on_gpu, p.pin_memory)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
