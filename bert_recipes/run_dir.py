"""A run's output directory (run.output_dir): never two runs mixed in it, neither one after the other (a new run
where checkpoints exist is refused, a resume with a changed config says what changed) nor at once (one run holds
it: OutputDirLock, run.lock); shared by every rank; started (the resolved config, the tokenizer) only once every
check has passed. Checkpoints inside it: bert_recipes/checkpoint.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from .checkpoint import CONFIG_FILE, complete_checkpoints
from .config import ConfigError
from .disk import disk_full
from .places import check_writable_dir, creating
from .ranks import all_max, barrier, broadcast, on_rank0, print0, written_by_all


_NOT_THE_RUN = {"checkpoint.resume", "run.overwrite", "run.output_dir", "train.halt_at_step", "logging.progress_bar",
                "run.lock_wait_s", "run.lock_stale_s", "checkpoint.accept_data_change"}


def config_differences(old_yaml: str, new_yaml: str) -> list[str]:
    """'section.key: old -> new' for every setting that differs (ignoring those that only steer
    this invocation: resume, overwrite, where the directory is, halt_at_step, the progress bar, a data change
    accepted); a rule
    the old config predates is one line in words, first (predated_rules)."""
    rules, changes = _differences(old_yaml, new_yaml)
    return rules + changes


def _differences(old_yaml: str, new_yaml: str) -> tuple[list[str], list[str]]:
    import yaml
    old, new = yaml.safe_load(old_yaml) or {}, yaml.safe_load(new_yaml) or {}
    flat = lambda d: {f"{s}.{k}": v for s, section in d.items() if isinstance(section, dict)   # noqa: E731
                      for k, v in section.items()}
    a, b = flat(old), flat(new)
    rules, explained = predated_rules(a, b)
    return rules, [f"{k}: {_shown(a.get(k))} -> {_shown(b.get(k))}" for k in sorted(set(a) | set(b))
                   if k not in _NOT_THE_RUN | explained and a.get(k) != b.get(k)]


def predated_rules(old: dict, new: dict) -> tuple[list[str], set[str]]:
    """A saved config (flat 'section.key' dicts, as config_differences reads them) from before a
    key existed followed the rule of its time: -> (a line for each rule that changes from here on, the keys
    those lines account for). A key it lacks that changes nothing is no difference either."""
    key = "optim.lamb_trust_ratio"
    if key in old or key not in new:
        return [], set()
    if "lamb" not in (old.get("optim.name"), new.get("optim.name")) or new[key] == "all":
        return [], {key}   # AdamW has no trust ratio; "all" is the old rule
    return [f"LAMB's trust ratio changed: the checkpoint was trained with it on every tensor (the rule before "
            f"{key} existed, = all); from here on only where weight decay applies ({key}={new[key]}, apex "
            f"FusedLAMB's and NVIDIA BERT's); --{key}=all keeps the old rule"], {key}


def _shown(value) -> str:
    """A setting as a change names it; a long list (data files resolved from a pattern: hundreds of shards) by
    its length and its ends."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{len(value)} items: {value[0]!r}, ..., {value[-1]!r}]"
    return repr(value)


def check_output_dir(output_dir: Path, config_yaml: str, resume: str | None, overwrite: bool) -> list[str]:
    """Never mix two runs in one directory: a new run where checkpoints exist is refused unless
    run.overwrite; a resume with a changed config is allowed with a note naming the changes. The
    directory must be creatable: not a file, not below a file, on a writable filesystem."""
    check_writable_dir(output_dir, "run.output_dir")
    found = complete_checkpoints(output_dir)
    if not found:
        return []
    latest = found[-1]
    saved = latest / CONFIG_FILE
    changes = config_differences(saved.read_text(), config_yaml) if saved.exists() else []
    if resume is None and not overwrite:
        if changes:
            shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
            raise ConfigError(f"run.output_dir={output_dir} holds checkpoints (up to {latest.name}) of a different "
                              f"run ({shown}): pick another run.output_dir, continue that run with --resume auto, "
                              "or replace it with --run.overwrite=true")
        raise ConfigError(f"run.output_dir={output_dir} already holds checkpoints of this run (up to {latest.name}): "
                          "continue it with --resume auto, or start over with --run.overwrite=true")
    if resume is not None and changes:
        rules, rest = _differences(saved.read_text(), config_yaml)
        return [f"[resume] {rule}" for rule in rules] + (
            ["[resume] the config differs from the checkpoint's: " + "; ".join(rest)] if rest else [])
    return []


def check_shared_output_dir(output_dir: Path, engine) -> None:
    """Rank 0 creates each checkpoint directory and every rank writes its own files into it, so all
    ranks must see one output_dir. Rank 0 leaves a marker beside it; a rank that cannot see it is on
    a node whose disk is not shared: refused, on every rank, before anything else is written."""
    if engine.num_processes == 1:
        return
    import secrets

    marker = output_dir.parent / f".{output_dir.name}.shared-check-{broadcast(secrets.token_hex(8))}"
    if engine.is_main:
        with creating("run.output_dir", output_dir):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    barrier()
    blind = int(all_max([float(not marker.exists())], engine.control)[0])
    barrier()
    if engine.is_main:
        marker.unlink()
    if blind:
        raise ConfigError(f"run.output_dir={output_dir} is not shared by every rank: some cannot see a file rank 0 "
                          "wrote beside it (a node-local disk). Checkpoints are written by all ranks into "
                          "directories rank 0 creates, so put run.output_dir on a filesystem every node mounts "
                          "(NFS, Lustre, GPFS); the data and tokenizer caches may stay node-local")


def start_output_dir(output_dir: Path, config_yaml: str, overwrite: bool, resume: str | None) -> None:
    """Rank 0, once the run is known to start: clear an old run when run.overwrite asks for it
    (never on a resume), then write the resolved config."""
    if overwrite and resume is None:
        for name in ("checkpoints", "model", "logs", "tokenizer", "metrics.json", "curves.png", "downstream"):
            target = output_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / CONFIG_FILE).write_text(config_yaml)


def start_writing(output_dir: Path, config_yaml: str, tokenizer, overwrite: bool, resume: str | None, engine,
                  train_state: dict, resumed: bool = False) -> None:
    """A run's first write, once every check has passed: rank 0 starts the output directory (the resolved config)
    and copies the tokenizer in, unless a resumed run's directory holds it already (the run's own: the way back
    when a resume names another tokenizer, checkpoint.check_tokenizer_fits); every rank agrees on it
    (ranks.written_by_all): a full disk is one line, on every rank exit code 5."""
    def write():
        with creating("run.output_dir", output_dir):   # an OSError the checks could not foresee: one line
            start_output_dir(output_dir, config_yaml, overwrite, resume)
            if not (resumed and (output_dir / "tokenizer" / "tokenizer.json").is_file()):
                tokenizer.save_pretrained(output_dir / "tokenizer")
    written_by_all(write if engine.is_main else lambda: None, engine.control, engine.is_main, lambda: None,
                   lambda err: disk_full(err, output_dir, "the run's config and tokenizer", train_state["step"], None,
                                         "nothing was trained: free space there, then run again"))


# ---------------------------------------------------------------------------- one run at a time
LOCK_FILE = "run.lock"
HEARTBEAT_S = 10.0        # how often the holder renews its heartbeat (a thread: data preparation can take hours)
REQUEUE_WAIT_S = 300.0    # run.lock_wait_s=None under a SLURM requeue: the old allocation's time to save and leave


def lock_wait(wait_s: float | None, env=os.environ) -> float:
    """run.lock_wait_s, resolved: None waits only under a SLURM requeue (SLURM_RESTART_COUNT > 0)."""
    if wait_s is not None:
        return float(wait_s)
    return REQUEUE_WAIT_S if int(env.get("SLURM_RESTART_COUNT") or 0) > 0 else 0.0


class OutputDirLock:
    """One run per output directory: <output_dir>/run.lock, created exclusively (O_EXCL) by the job's rank 0, holds
    {host, pid, started, heartbeat, token, job}; a thread renews the heartbeat every HEARTBEAT_S. Another run finds
    it and waits (lock_wait) or stops with one line naming the holder. A hold whose holder is gone is taken over
    with one line: on the same host its process is dead (or its pid was reused since), on another host its
    heartbeat is older than run.lock_stale_s. Released at the run's end, whatever ended it; a run refused after
    taking it leaves no directory it created behind."""

    def __init__(self, output_dir: Path, stale_s: float):
        self.output_dir, self.stale_s = Path(output_dir), stale_s
        self.path = self.output_dir / LOCK_FILE
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self.created: list[Path] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------ taking it
    def acquire(self, wait_s: float, say=print) -> None:
        deadline, waiting = time.monotonic() + wait_s, False
        while True:
            if self._create():
                self.thread = threading.Thread(target=self._beat, name="run.lock heartbeat", daemon=True)
                self.thread.start()
                return
            holder = self._read()
            if holder is None:   # being written or removed this instant: look again
                time.sleep(0.2)
                continue
            gone = self.gone(holder)
            if gone:
                say(f"[lock] run.output_dir={self.output_dir}: took over the hold of {describe_holder(holder)}: {gone}")
                self._remove_if(holder.get("token"))
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(f"run.output_dir={self.output_dir} is in use by another run: {describe_holder(holder)} "
                                  f"({self.path}); wait until it ends, stop it, or give this run another "
                                  "run.output_dir" + ("" if not waiting else f" (waited {wait_s:g}s: run.lock_wait_s)"))
            if not waiting:
                say(f"[lock] run.output_dir={self.output_dir} is held by {describe_holder(holder)}: waiting up to "
                    f"{wait_s:g}s for it to end (run.lock_wait_s; a SLURM requeue waits for the old allocation)")
                waiting = True
            time.sleep(min(2.0, left))

    def _create(self) -> bool:
        """Create the lock file exclusively (and the directories above it, remembered) -> whether this run holds it."""
        missing = []
        here = self.output_dir
        while not here.exists():
            missing.append(here)
            here = here.parent
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                directory.mkdir()
                self.created.append(directory)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self._content(time.time())))
        return True

    def _content(self, started: float) -> dict:
        job = {k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT") if k in os.environ}
        return {"host": socket.gethostname(), "pid": os.getpid(), "started": started, "heartbeat": time.time(),
                "token": self.token, "job": job}

    def _read(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):   # half-written (its writer killed mid-write): its age decides
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return None
            return {"host": "?", "pid": None, "heartbeat": time.time() - age, "token": None, "unreadable": True}
        return holder if isinstance(holder, dict) else None

    def gone(self, holder: dict) -> str | None:
        """Why the holder is gone (its hold stale), or None while it may still run."""
        age = time.time() - float(holder.get("heartbeat") or 0)
        if holder.get("unreadable"):
            return f"the lock file is unreadable and {age:.0f}s old" if age > self.stale_s else None
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            if not pid_alive(pid):
                return f"its process {pid} is gone (same host)"
            started = process_start(pid)
            if started is not None and started > float(holder.get("started") or 0) + 2:
                return f"its pid {pid} now belongs to a process started later (same host)"
            return None
        if age > self.stale_s:
            return f"no heartbeat from {holder.get('host')} for {age:.0f}s (run.lock_stale_s={self.stale_s:g})"
        return None

    def _remove_if(self, token) -> None:
        """Remove the lock file if it is still the one read (another run may have taken it over meanwhile)."""
        holder = self._read()
        if holder is not None and holder.get("token") == token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    # ------------------------------------------------------------ holding it
    def _beat(self) -> None:
        started = time.time()
        while not self.stop.wait(HEARTBEAT_S):
            holder = self._read()
            if holder is None or holder.get("token") != self.token:
                print(f"[lock] run.output_dir={self.output_dir}: this run's hold ({self.path}) was removed or taken "
                      "over by another run; another run may be writing here too", flush=True)
                return
            started = holder.get("started", started)
            tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(self._content(started)))
            os.replace(tmp, self.path)

    def release(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        holder = self._read()
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for directory in reversed(self.created):   # a run refused after taking it leaves what it created as it was
            with contextlib.suppress(OSError):
                directory.rmdir()                   # (only if empty)


def describe_holder(holder: dict) -> str:
    """'pid 123 on host n1 (SLURM job 45), started 2026-12-04 10:00:00 UTC, heartbeat 4s ago'."""
    job = holder.get("job") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["started"])) if holder.get("started") else "?"
    age = time.time() - float(holder.get("heartbeat") or 0)
    return (f"pid {holder.get('pid')} on host {holder.get('host')}"
            + (f" (SLURM job {job['SLURM_JOB_ID']})" if job.get("SLURM_JOB_ID") else "")
            + f", started {when}, heartbeat {age:.0f}s ago")


def pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    return True


def process_start(pid: int) -> float | None:
    """When the process `pid` started (seconds since the epoch), or None where that cannot be read."""
    try:
        import psutil
        return psutil.Process(pid).create_time()
    except Exception:   # noqa: BLE001 (no psutil, gone meanwhile, not allowed: no verdict from it)
        return None


@contextlib.contextmanager
def holding_output_dir(output_dir: Path, wait_s: float | None, stale_s: float, engine):
    """The run's hold on its output directory, taken by rank 0 (every rank learns the outcome: a refusal is the same
    one config error everywhere) and released when the block ends, however it ends."""
    lock = OutputDirLock(output_dir, stale_s) if engine.is_main else None
    on_rank0(engine.is_main, broadcast, lambda: lock.acquire(lock_wait(wait_s), say=print0))
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
