"""torch's build lock for DeepSpeed's JIT-built ops (bert_recipes/backends/deepspeed_ops.py): a lock a cut-off
build left behind is removed with one line, and the op then loads; a build really in progress is waited for,
with one line, and the run goes on when it ends."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bert_recipes.backends.deepspeed_ops import holders, settle_build_locks
from conftest import REPO

BUILT = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"   # the suite's build (tests/build_ds_ops.py)

LOAD = """
from bert_recipes.backends.deepspeed_ops import settle_build_locks
settle_build_locks()
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
print("loaded")
"""


def test_a_stale_build_lock_is_removed_with_one_line_and_the_op_loads(tmp_path):
    """A real extension directory (DeepSpeed's shared-memory collectives, the op every CPU launch loads) with the
    `lock` a killed build leaves: torch alone would poll it forever (FileBaton.wait, on every load, built or not);
    here it is one line and the op loads, within 240 s (a copy of the suite's build loads in seconds; without one,
    DeepSpeed builds the op, about a minute)."""
    root = tmp_path / "torch_extensions"
    op = root / "deepspeed_shm_comm"
    if (BUILT / "deepspeed_shm_comm.so").exists():
        shutil.copytree(BUILT, op, ignore=shutil.ignore_patterns("lock"))
    else:
        op.mkdir(parents=True)
    (op / "lock").touch()
    os.utime(op / "lock", (time.time() - 600, time.time() - 600))   # cut off ten minutes ago
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu", "BERT_RECIPES_WARM": "0"}
    proc = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[ops]")]
    assert proc.returncode == 0 and proc.stdout.strip().endswith("loaded"), proc.stderr[-3000:]
    assert lines == [f"[ops] removed a stale DeepSpeed op-build lock, {op / 'lock'} (10 min old; no live process "
                     "holds it: a build of deepspeed_shm_comm was cut off): safe to remove, deepspeed_shm_comm is "
                     "built again on its first load"], proc.stderr[-3000:]
    assert not (op / "lock").exists() and (op / "deepspeed_shm_comm.so").exists()


HOLD = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)   # as torch's FileBaton.try_acquire takes it
print("held", flush=True)
time.sleep(float(sys.argv[2]))
os.close(fd)                                       # ... and FileBaton.release gives it back
os.remove(sys.argv[1])
"""


def test_a_build_in_progress_is_waited_for_with_one_line(tmp_path, monkeypatch):
    """Another process holds the lock as a build does (its descriptor open): one line naming it and since when,
    the wait until it lets go (3 s), nothing removed, then the run goes on."""
    op = tmp_path / "torch_extensions" / "cpu_adam"
    op.mkdir(parents=True)
    lock = op / "lock"
    builder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "held"
        assert holders(lock) == [builder.pid]
        said: list[str] = []
        start = time.time()
        removed = settle_build_locks(said.append, poll_s=0.1, env={"TORCH_EXTENSIONS_DIR": str(op.parent)})
        waited = time.time() - start
    finally:
        builder.kill()
        builder.wait()
    assert removed == [] and 1.5 < waited < 60, (removed, waited)
    assert len(said) == 1 and said[0].startswith("[ops] waiting for a build of cpu_adam in progress since "), said
    assert f"{lock} is held by pid {builder.pid}" in said[0] and said[0].endswith("this run goes on when it ends")
