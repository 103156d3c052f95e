"""The suite's warm start, the server half (tests/warm/sitecustomize.py is the proxy half).

    python tests/warm/server.py SOCKET LOG      (tests/conftest.py starts it once per session)

Importing torch, transformers' BERT, accelerate, datasets and DeepSpeed costs a process about 6-10 s of CPU
(python -X importtime: torch 2-3 s; transformers' BERT with torch.distributed.tensor, torch._dynamo, sympy
and scipy 2-4 s), and the suite starts over 300 such processes (tests/census: 209 ranks and 109 launchers on
2026-12-02), about half of its CPU. This server imports all of it once, then forks one child per request:
the child is the requesting process's twin (its standard streams, working directory, environment and
command line) and runs the script as `__main__`. The requester waits, forwards signals and ends as the
child ended (sitecustomize.py). The processes and what runs in them are the real ones: `accelerate
launch`, torch's elastic agent, one process per rank, gloo, DeepSpeed; only the interpreter's start-up
is skipped.

A request is served cold (the requester goes on as a plain interpreter) when its script is not the
repository's or a launcher of the venv, or when its environment differs from the server's in a variable
the server's imports may have read (LAUNCH_VARIABLES lists the ones a launch sets and nothing reads at
import). Every decision is a line in LOG."""
from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.prefix) / "bin"
# Variables the server's imports do not read (each is read when a run starts, or only by our own tools):
# what accelerate launch sets (ACCELERATE_*, FSDP_*, and PYTHONPATH for DeepSpeed, applied to the child's
# sys.path), torch's elastic agent, make and the Makefile, the SLURM stand-ins, the tests' and tools' own
# (ARGS, PYTHON, OUT, HARNESS_SCRIPT, GPUS_PER_NODE), the venv's activation, inductor's pointer for its compiled code (set in the
# process that compiled, inherited as a cold process would), pytest's test name and terminal size.
LAUNCH_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTORCH_NVML_BASED_CUDA_CHECK", "PYTHONPATH",
                    "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", "_", "PWD", "OLDPWD", "SHLVL", "MAKEFLAGS",
                    "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "PATH", "COLUMNS", "LINES", "PYTHON", "OUT",
                    "HARNESS_SCRIPT", "GPUS_PER_NODE", "CPU", "SCONTROL_LOG", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                    "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT"}   # a batch script that activates the venv (slurm/*.sbatch)
# make exports the variables given on its command line (make demo RUNS=...): the Makefile's own, read by make
LAUNCH_VARIABLES |= set(re.findall(r"^([A-Z_]+)\s*\?=", (REPO / "Makefile").read_text(), re.M))
LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_", "PET_", "SLURM_", "NCCL_", "BERT_RECIPES_",
                   "_TORCHINDUCTOR_")


def preload() -> None:
    """Everything a rank, a launcher or a tool of the repository imports, imported once."""
    sys.path.insert(0, str(REPO))
    import importlib
    import pkgutil

    import accelerate.commands.accelerate_cli   # noqa: F401  (the launcher)
    import datasets                              # noqa: F401
    import evaluate                              # noqa: F401  (the metrics)
    import matplotlib                            # noqa: F401  (curves.png)
    import sklearn                               # noqa: F401  (sets KMP_DUPLICATE_LIB_OK, as in pytest's process)
    import torch.utils.tensorboard               # noqa: F401  (the default tracker)
    import deepspeed                             # noqa: F401  (finds the CPU accelerator, as every CPU rank does)
    import torch.distributed.run                 # noqa: F401  (torchrun, the elastic agent)
    import transformers                          # noqa: F401
    from transformers import BertForMaskedLM, BertForPreTraining, BertForSequenceClassification  # noqa: F401

    import bert_recipes
    for module in pkgutil.walk_packages(bert_recipes.__path__, "bert_recipes."):
        importlib.import_module(module.name)
    import gc
    gc.collect()
    gc.freeze()   # the imported objects stay out of the collector's way: fewer pages copied on write after fork


def cold_reason(request: dict, own_env: dict, added: dict) -> str | None:
    script = Path(request["cwd"], request["argv"][0]).resolve()
    if not (script.is_file() and (REPO in script.parents and script.parent != Path(__file__).parent
                                  or script.parent == BIN)):
        return f"not a repository script or launcher: {request['argv'][0]}"
    env, differ = request["env"], []
    for key in sorted(set(env) | set(own_env)):
        if env.get(key) == own_env.get(key) or key in LAUNCH_VARIABLES or key.startswith(LAUNCH_PREFIXES):
            continue
        if key == "DS_ACCELERATOR" and env.get(key) == "cpu":   # what the preloaded DeepSpeed found
            continue
        if key in added and env.get(key) == added[key]:       # set by the same imports in the requester's parent
            continue
        differ.append(f"{key}={env.get(key)!r} (server: {own_env.get(key)!r})")
    return f"environment: {', '.join(differ)}" if differ else None


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = int.from_bytes(data[:8], "big")
    data = data[8:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise OSError("request cut short")
        data += more
    return json.loads(data), fds


def serve(socket_path: str, log_path: str, own_env: dict, added: dict) -> None:
    """own_env: the server's environment before its imports; added: what the imports set in it (a cold
    process's imports would set the same)."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    os.rename(socket_path + ".tmp", socket_path)   # requesters see the socket only once it listens
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    workers: dict[int, socket.socket] = {}
    log = open(log_path, "a", buffering=1)
    log.write(f"ready {time.time():.3f}\n")
    while os.getppid() == parent:   # pytest gone: stop
        for _ in selector.select(timeout=0.05):
            conn, _ = listener.accept()
            conn.settimeout(5)
            try:
                request, fds = read_request(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            reason = cold_reason(request, own_env, added)
            if reason:
                log.write(f"cold\t{reason}\t{' '.join(request['argv'])[:300]}\n")
                for fd in fds:
                    os.close(fd)
                conn.sendall(b"cold\n")
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                run_child(request, fds, conn, [listener, *workers.values()], added)   # never returns
            for fd in fds:
                os.close(fd)
            workers[pid] = conn
            conn.sendall(f"pid {pid}\n".encode())
            log.write(f"warm\t{pid}\t{' '.join(request['argv'])[:300]}\n")
        while workers:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = workers.pop(pid, None)
            if conn is not None:
                ended = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
                try:
                    conn.sendall(f"{ended}\n".encode())
                except OSError:
                    pass
                conn.close()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)


def set_streams(unbuffered: bool) -> None:
    """Standard streams over the requester's descriptors, buffered as a fresh interpreter's: -u (or
    PYTHONUNBUFFERED) writes through to the descriptor; else stdout is line-buffered on a terminal and
    block-buffered otherwise, stderr line-buffered."""
    import io
    encoding = sys.__stdout__.encoding   # the locale's, as a fresh interpreter picks it
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(binary, encoding=encoding, errors=errors, write_through=unbuffered,
                                  line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)))
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)


def run_child(request: dict, fds: list[int], conn: socket.socket, inherited: list[socket.socket], added: dict) -> None:
    """In the forked child: become the requester's twin and run its script as __main__."""
    code = 1
    try:
        for other in inherited:
            other.close()
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.nice(max(0, request["nice"] - os.nice(0)))   # a requester started under `nice` runs niced
        env = {**added, **request["env"]}
        os.environ.clear()
        os.environ.update(env)
        set_streams(request["unbuffered"] or bool(env.get("PYTHONUNBUFFERED")))
        script = os.path.abspath(request["argv"][0])
        sys.argv = list(request["argv"])
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) not in sys.path]
        sys.path[:1] = [os.path.dirname(script)] + [os.path.abspath(p) for p in extra]
        import random
        random.seed()
        import numpy
        numpy.random.seed()   # a fresh interpreter's global generators start from the OS's entropy
        import threading
        conn.settimeout(None)

        def orphaned():   # the requester was killed (SIGKILL cannot be forwarded): end the same way
            try:
                conn.recv(1)
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=orphaned, daemon=True).start()
        import runpy
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            import traceback
            traceback.print_exc()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:   # as the interpreter prints an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        for thread in threading.enumerate():   # the interpreter's exit: non-daemon threads first, then atexit
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    before = dict(os.environ, BERT_RECIPES_WARM_SOCKET=sys.argv[1])
    preload()
    serve(sys.argv[1], sys.argv[2], before, {k: v for k, v in os.environ.items() if k not in before})
