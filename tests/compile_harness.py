"""Test-harness shim: run train.py under `accelerate launch` and report what torch.compile did in this rank.

Each rank writes <run.output_dir>.compile/rank<RANK>.json when train.py's run_cli returns (beside the run's
directory, named from its --run.output_dir argument, so the launch's environment stays the warm server's):
    {"recompiles": [the first line of each of dynamo's "Recompiling function" records],
     "unique_graphs": graphs dynamo built, "frames": frames it compiled,
     "steps_seen": optimizer steps (train.train_step calls)}
Recompiles are read from dynamo's public log switch (torch._logging.set_logs(recompiles=True)), caught by a
handler on the torch._dynamo logger; the graph and frame counts from torch._dynamo.utils.counters (a test's
instrument only: nothing in the package reads it). Lives in tests/, never in train.py.

    accelerate launch --config_file ... tests/compile_harness.py --recipe ...
"""
import json
import logging
import os
import runpy
import sys
from pathlib import Path

import torch

repo = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(repo))

recompiles: list[str] = []


class _Recompiles(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function" in message:
            recompiles.append(message.splitlines()[0] + " | " + " ".join(message.splitlines()[1:3]))


torch._logging.set_logs(recompiles=True)
logging.getLogger("torch._dynamo").addHandler(_Recompiles())

import train  # noqa: E402
from bert_recipes.exits import leave  # noqa: E402

steps = {"n": 0}
_step = train.train_step


def _counted(run, batches):
    steps["n"] += 1
    return _step(run, batches)


train.train_step = _counted   # the loop calls it by its module name: every step is counted


def _report():
    from torch._dynamo.utils import counters
    output_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--run.output_dir="))
    out = Path(output_dir + ".compile")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({
        "recompiles": recompiles, "unique_graphs": counters["stats"]["unique_graphs"],
        "frames": counters["frames"]["ok"], "steps_seen": steps["n"]}))


code = train.run_cli(sys.argv[1:])
_report()
leave(code)
