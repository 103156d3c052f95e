"""Every rank's random generators in a checkpoint, in Accelerate's file and keys (what save_state writes
for the Accelerate engine), so every engine's checkpoint holds one format; loaded with weights_only."""
from __future__ import annotations

import json
from pathlib import Path

import torch


RNG_FILE = "random_states_{rank}.pkl"


def save_rng_state(path: str | Path, rank: int, on_gpu: bool) -> None:
    import random

    import numpy as np
    states = {"step": 0, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    if on_gpu:
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    torch.save(states, Path(path) / RNG_FILE.format(rank=rank))


def load_rng_state(path: str | Path, rank: int, on_gpu: bool) -> bool:
    """This rank's generators as save_rng_state (or Accelerate) left them; a checkpoint from before the
    one format holds rng_rank<r>.json instead, read as well. -> whether a state was found."""
    import random

    import numpy as np
    from accelerate.utils import load   # torch.load, weights_only, with numpy's state types allowed
    saved = Path(path) / RNG_FILE.format(rank=rank)
    if not saved.exists():
        return _load_rng_json(Path(path) / f"rng_rank{rank}.json", on_gpu)
    states = load(saved)
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if on_gpu and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    return True


def _load_rng_json(saved: Path, on_gpu: bool) -> bool:
    """The pipeline's format before RNG_FILE (checkpoints written up to 2026-11-30)."""
    import random

    import numpy as np
    if not saved.exists():
        return False
    state = json.loads(saved.read_text())
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] is not None and on_gpu:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    return True
