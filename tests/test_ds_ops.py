"""torch's build lock for DeepSpeed's JIT-built ops (bert_recipes/backends/deepspeed_ops.py): a lock a cut-off
build left behind is removed with one line, after which torch's own lock is free to take again (what every load
of the op takes, built or not); a build really in progress is waited for, with one line, and the run goes on
when it ends, or removes the lock with a second line when its builder dies instead.

Real pieces, no compile: the op's directory is the one torch's cpp_extension names (`_get_build_directory`), the
lock is taken by torch's FileBaton (its file, loaded on its own: no torch import) in a live process, and "cut off"
is that process killed with SIGKILL while it holds it. Bounds: a stale lock is settled within 10 s (a /proc scan,
well under a second), a build in progress within 30 s of its end; the file's tests take about 10 s in all."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bert_recipes.backends.deepspeed_ops import holders, settle_before_ranks_load, settle_build_locks

BATON = str(Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "utils" / "file_baton.py")

# A build as torch's _jit_compile runs one: FileBaton(<op>/lock).try_acquire() (os.open O_CREAT|O_EXCL, the
# descriptor kept open), the build (here a sleep), then release() (close, remove). Killed, it never releases.
BUILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("file_baton", sys.argv[1])
baton_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(baton_module)
baton = baton_module.FileBaton(sys.argv[2])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
baton.release()
"""


def torch_baton(lock: Path):
    from torch.utils.file_baton import FileBaton
    return FileBaton(str(lock))


def start_build(lock: Path, seconds: float) -> subprocess.Popen:
    builder = subprocess.Popen([sys.executable, "-c", BUILD, BATON, str(lock), str(seconds)], stdout=subprocess.PIPE,
                               text=True)
    assert builder.stdout.readline().strip() == "held", builder.communicate()
    return builder


def test_a_stale_build_lock_is_removed_with_one_line_and_torch_takes_it_again(tmp_path, monkeypatch):
    """A build of cpu_adam in torch's default extension root (~/.cache/torch_extensions/py<ver>_<cpu|cu..>/,
    under XDG_CACHE_HOME) killed ten minutes ago while it held the lock: torch's next load could not take the
    lock and would poll it forever (FileBaton.wait has no timeout); settled, it is one line and the lock is torch's
    to take again. Bound: 10 s."""
    from torch.utils.cpp_extension import _get_build_directory
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    op = Path(_get_build_directory("cpu_adam", verbose=False))   # the directory torch itself builds the op in
    assert op.parent.parent == (tmp_path / "cache" / "torch_extensions").resolve()
    lock = op / "lock"
    builder = start_build(lock, 600)
    builder.send_signal(signal.SIGKILL)   # cut off: a Ctrl-C's kill, a SLURM time limit, a preemption
    builder.wait()
    os.utime(lock, (time.time() - 600, time.time() - 600))   # ten minutes ago
    assert lock.exists() and holders(lock) == [] and not torch_baton(lock).try_acquire()   # what a load meets

    said: list[str] = []
    start = time.time()
    removed = settle_build_locks(said.append, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert time.time() - start < 10 and removed == [lock]
    assert said == [f"[ops] removed a stale DeepSpeed op-build lock, {lock} (10 min old; no live process holds it: "
                    "a build of cpu_adam was cut off): safe to remove, cpu_adam is built again on its first load"]
    baton = torch_baton(lock)
    assert baton.try_acquire()   # the next load takes the lock and builds: no wait
    baton.release()


@pytest.mark.parametrize("ends", ["finishes", "dies"])
def test_a_build_in_progress_is_waited_for_with_one_line(tmp_path, ends):
    """Another process holds the lock as a build does (torch's FileBaton, its descriptor open): one line naming it
    and since when, then the wait. It finishes after 2 s: nothing removed, the run goes on. It dies after 2 s (the
    other run was killed): the lock is stale from then on, removed with a second line. Bound: 30 s."""
    lock = tmp_path / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    builder = start_build(lock, 2 if ends == "finishes" else 600)
    killer = threading.Timer(2, builder.kill) if ends == "dies" else None
    try:
        assert holders(lock) == [builder.pid] and not torch_baton(lock).try_acquire()
        said: list[str] = []
        start = time.time()
        if killer:
            killer.start()
        removed = settle_build_locks(said.append, poll_s=0.1, env={"TORCH_EXTENSIONS_DIR": str(lock.parent.parent)})
        waited = time.time() - start
    finally:
        if killer:
            killer.cancel()
        builder.kill()
        builder.wait()
    assert 1.5 < waited < 30, waited
    assert said[0].startswith("[ops] waiting for a build of deepspeed_shm_comm in progress since "), said
    assert f"{lock} is held by pid {builder.pid}" in said[0] and said[0].endswith("this run goes on when it ends")
    if ends == "finishes":
        assert removed == [] and len(said) == 1, said
    else:
        assert removed == [lock] and len(said) == 2 and said[1].startswith("[ops] removed a stale DeepSpeed "), said
    assert not lock.exists()


def test_each_nodes_first_process_of_a_deepspeed_run_settles_the_locks(tmp_path, capsys):
    """train.main calls settle_before_ranks_load before the process group starts: a DeepSpeed run's LOCAL_RANK 0
    (or a plain process) settles; the node's other ranks and the other backends do not look."""
    from bert_recipes.backends.plan import LaunchPlan
    lock = tmp_path / "torch_extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    env = {"TORCH_EXTENSIONS_DIR": str(lock.parent.parent)}
    for plan, local_rank in ((LaunchPlan(), "0"), (LaunchPlan(deepspeed=True), "1")):
        lock.touch()
        settle_before_ranks_load(plan, {**env, "LOCAL_RANK": local_rank})
        assert lock.exists()
    settle_before_ranks_load(LaunchPlan(deepspeed=True), {**env, "LOCAL_RANK": "0"})
    assert not lock.exists() and capsys.readouterr().err.startswith("[ops] removed a stale DeepSpeed op-build lock")
