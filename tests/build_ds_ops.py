"""Build DeepSpeed's CPU ops ahead of the tests that load them (tests/conftest.py starts this at the lowest
priority when the session begins): the shared-memory collectives (every DeepSpeed launch on CPU), CPU
Adam (the offload rows) and async I/O with pinned memory (the NVMe rows, which the suite runs last).
DeepSpeed JIT-builds each on first use into torch's extension cache: in a fresh clone about 4 minutes of
two cores (async_io alone 2.5), which the tests would otherwise wait for. The builds are DeepSpeed's
own (its builders, as a launch makes them); a test that needs an op before it is built waits at torch's
build lock, as it would have waited for its own build."""
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepspeed.accelerator import get_accelerator   # noqa: E402

from bert_recipes.backends.deepspeed import ask_cpuinfo_once   # noqa: E402

ask_cpuinfo_once()   # as a run's ranks do: py-cpuinfo asked once, not once per op

for name in ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder", "PinMemoryBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is None or not builder.is_compatible(verbose=False):
        print(f"[build_ds_ops] {name}: not buildable here, skipped", file=sys.stderr)
        continue
    builder.load(verbose=False)
    print(f"[build_ds_ops] {name}: built", file=sys.stderr)
