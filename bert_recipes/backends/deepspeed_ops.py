"""DeepSpeed's JIT-built ops and torch's build lock: an interrupted build is one line, not a silent hang.

DeepSpeed builds its CPU ops on first use (the shared-memory collectives of every CPU launch, CPU Adam for
offload, async I/O and pinned memory for NVMe) through torch.utils.cpp_extension, which takes a lock file,
`<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/<py>_<cpu|cuXYZ>>/<op>/lock` (torch's FileBaton), on every
load, built or not. The lock names no owner and has no timeout: a build cut off by Ctrl-C, a SLURM time limit, a
preemption or a kill leaves it behind, and every later load polls it forever, printing nothing.

FileBaton keeps the lock's file descriptor open from the moment it creates the file until it removes it, so a
lock no live process has open is stale, whatever its age. Such a lock is removed, with one line: it protects
nothing any more, torch would otherwise wait forever, and removing it is the one thing a user can do about it
(the next load runs ninja in that directory, which rebuilds what the cut-off build left unfinished). A lock a
live process holds is a build in progress (another run on this node): waited for, with one line naming the
process and since when. Only processes this user may inspect are seen: torch's extension cache is per user.

Run by each node's first process before the process group starts, so before any rank of the node loads an op.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def extension_roots(env=os.environ) -> list[Path]:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR/<op>, else ~/.cache/torch_extensions/<py_cpu>/<op>
    (cpp_extension._get_build_directory; torch's default root honours XDG_CACHE_HOME)."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return [Path(env["TORCH_EXTENSIONS_DIR"])]
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return sorted(p for p in cache.glob("py*") if p.is_dir())


def holders(lock: Path) -> list[int]:
    """The pids of the live processes that have `lock` open (FileBaton's open descriptor), from /proc."""
    target, found = str(lock.resolve()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:   # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def _age(lock: Path) -> str:
    seconds = time.time() - lock.stat().st_mtime
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def settle_build_locks(say=lambda line: print(line, file=sys.stderr, flush=True), poll_s: float = 0.5,
                       env=os.environ) -> list[Path]:
    """Every op's build lock under the extension roots: a stale one (no live process has it open) is removed
    with one line; one a live build holds is waited for, with one line, until its build ends (or its builder
    dies, leaving it stale: then removed). -> the locks removed."""
    removed = []
    for lock in [lock for root in extension_roots(env) for lock in sorted(root.glob("*/lock"))]:
        told = False
        while True:
            try:
                age = _age(lock)
            except FileNotFoundError:   # released: the build finished
                break
            pids = holders(lock)
            if not pids:
                lock.unlink(missing_ok=True)
                removed.append(lock)
                say(f"[ops] removed a stale DeepSpeed op-build lock, {lock} ({age} old; no live process holds it: "
                    f"a build of {lock.parent.name} was cut off): safe to remove, {lock.parent.name} is built again "
                    "on its first load")
                break
            if not told:
                since = time.strftime("%H:%M:%S", time.localtime(lock.stat().st_mtime))
                say(f"[ops] waiting for a build of {lock.parent.name} in progress since {since} ({age}; {lock} is "
                    f"held by pid {pids[0]}: {_command(pids[0])}); this run goes on when it ends")
                told = True
            time.sleep(poll_s)
    return removed


def settle_before_ranks_load(plan, env=os.environ) -> None:
    """settle_build_locks on each node's first process (LOCAL_RANK 0, or a plain process) of a DeepSpeed run,
    before the process group starts: the node's other ranks cannot reach an op's load before it is done."""
    if plan.kind in ("deepspeed", "pipeline") and env.get("LOCAL_RANK", "0") == "0":
        settle_build_locks(env=env)
