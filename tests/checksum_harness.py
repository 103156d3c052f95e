"""Test-harness shim: run train.py (or CHECKSUM_SCRIPT) and add every rank's full-weight checksum to its final
metrics (metrics.json's final.rank_checksums: one [sum, sum of |w|] row per rank, in float64), so a test can
prove that the ranks end with identical weights.

A real run does not gather the full weights for this: under ZeRO-3 or FSDP that is every parameter gathered
onto every rank at the end, for a number only the tests read. tests/conftest.launch runs train.py through this
file; it patches the Accelerate engine's end-of-run facts (AccelerateEngine.final) and nothing else, then runs
the script unchanged. It lives in tests/, never in the package.

    accelerate launch --config_file ... tests/checksum_harness.py --recipe ...
"""
import contextlib
import os
import runpy
import sys
from pathlib import Path

import torch

repo = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(repo))

from bert_recipes.engine import AccelerateEngine  # noqa: E402


@contextlib.contextmanager
def full_weights(accelerator, model):
    """{name: full tensor} as this rank sees the model, gathered where the backend shards them (ZeRO-3:
    DeepSpeed's GatheredParameters; FSDP2: DTensor.full_tensor). Collective under sharded backends."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if hasattr(model, "zero_optimization_stage") and model.zero_optimization_stage() == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
            yield {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    else:
        yield {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
               for k, v in unwrapped.state_dict().items()}


def rank_checksums(accelerator, model) -> list[list[float]]:
    """[sum, sum of |w|] in float64 of the full weights as each rank sees them; equal rows mean
    the ranks agree. Collective: every rank must call it."""
    with full_weights(accelerator, model) as weights:
        tensors = list(weights.values())
        local = torch.tensor([[sum(float(t.double().sum()) for t in tensors),
                               sum(float(t.double().abs().sum()) for t in tensors)]],
                             dtype=torch.float64, device=accelerator.device)
    return accelerator.gather(local).tolist()


_final = AccelerateEngine.final


def _final_with_checksums(self) -> dict:
    return {**_final(self), "rank_checksums": rank_checksums(self.accelerator, self.model)}


AccelerateEngine.final = _final_with_checksums
script = repo / os.environ.get("CHECKSUM_SCRIPT", "train.py")
sys.argv = [str(script)] + sys.argv[1:]
runpy.run_path(str(script), run_name="__main__")
