"""Test-harness shim: run train.py with Accelerate's FSDP plugin forced onto CPU processes.

Accelerate 1.15 enables FSDP only for GPU distributed types, never for MULTI_CPU, so an FSDP
config on CPU would otherwise run unsharded (train.py refuses that). This shim patches the
Accelerator right after construction -- the only place it touches -- and then runs train.py
unchanged. It lives in tests/, never in train.py.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/fsdp.yaml \
        tests/fsdp_cpu_harness.py --recipe ...
"""
import os
import runpy
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

_original_init = Accelerator.__init__


def _init_with_fsdp_on_cpu(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    state = AcceleratorState()
    if state.__dict__.get("fsdp_plugin") is None:
        state.fsdp_plugin = FullyShardedDataParallelPlugin()   # reads the FSDP_* variables `accelerate launch` set
    state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP   # both singletons answer distributed_type
    if self.mixed_precision != "no":
        state.fsdp_plugin.set_mixed_precision(self.mixed_precision)
    # MULTI_CPU picks device cpu:0, which FSDP1 rejects ("Inconsistent compute device and device_id")
    PartialState().device = torch.device("cpu")
    state.device = torch.device("cpu")


Accelerator.__init__ = _init_with_fsdp_on_cpu
repo = Path(__file__).resolve().parents[1]
script = repo / os.environ.get("HARNESS_SCRIPT", "train.py")   # e.g. tools/memory.py --measure
sys.path.insert(0, str(repo))
sys.argv = [str(script)] + sys.argv[1:]
runpy.run_path(str(script), run_name="__main__")
