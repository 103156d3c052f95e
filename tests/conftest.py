"""Shared fixtures: offline environment, the embedded sample built once per session, a tiny
BERT recipe (2 layers, hidden 32, sequence 32) and launchers for in-process and real
multi-process runs."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# MLflow's telemetry, off as on a CI host (which it detects): imported by the trackers test, it otherwise sets
# _MLFLOW_TELEMETRY_SESSION_ID in this process, and every process started after it differed from the warm
# server's environment and started cold (2026-12-04 here: 120 warm, 309 cold, 28 minutes against about 20)
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"
# One intra-op thread for torch in this process and every one it starts (the launches already ran their
# ranks so): tiny models gain nothing from a second thread, and a second thread made every op wait for
# whichever core DeepSpeed's background op build held (tests/build_ds_ops.py). Measured 2026-12-01: the GPU
# session's rehearsal took 289 s with the build running and torch's 2 threads, 186 s with 1 (117 s without
# the build); its timed training steps were 20x slower in the first case.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Under `make test` the suite inherits the outer make's level and flags, and every `make -n` a test runs
# would then print "make[1]: Entering/Leaving directory" lines around its commands (this failed CI).
for _var in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS"):
    os.environ.pop(_var, None)


# The venv's commands first, as in an activated venv: one ninja for every DeepSpeed op build (the venv's 1.13 and
# a system 1.11 hash the same command differently, and each rebuilt the ops the other had built: about 50 s a
# time, seen four times in one suite on 2026-12-02).
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

# ----------------------------------------------------------------------------- DeepSpeed's op builds, once
DS_MODULES = ("test_backends", "test_memory", "test_slurm", "test_reliability")   # files whose runs use DeepSpeed
DS_WORDS = ("zero", "deepspeed", "offload", "pipeline", "nvme")                    # tests named for a DeepSpeed row
# Each checkout builds its own ops: torch's JIT cache is keyed by the op's name alone, so two checkouts
# sharing ~/.cache/torch_extensions rebuild each other's ops on every load (their source paths differ;
# seen 2026-12-01: async_io built three times in one suite, about 8 minutes each).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# ... and compiles them at -O1 without debug info (tests/g++-quick): a third less of the suite's longest work.
os.environ.setdefault("CXX", str(REPO / "tests/g++-quick"))


# ----------------------------------------------------------------------------- the warm start
# Every Python process the suite starts for the repository's scripts and launchers (ranks, accelerate launch,
# torchrun, tools/) is forked from one server that has imported torch, transformers, accelerate, datasets and
# DeepSpeed once (tests/warm/server.py; the process that asked stays as its stand-in: tests/warm/sitecustomize.py).
# Those imports were about half of the suite's CPU (tests/census, 2026-12-02: 209 ranks and 109 launchers, 6-10 s
# of imports each). BERT_RECIPES_WARM=0 runs every process cold; a test that must see a cold process sets it in
# that process's environment (a SIGSTOP cannot be forwarded to the forked twin).
_WARM: dict = {}


def _start_warm_server() -> None:
    import tempfile
    if os.environ.get("BERT_RECIPES_WARM", "1") == "0" or "BERT_RECIPES_WARM_SOCKET" in os.environ:
        return
    tmp = Path(tempfile.mkdtemp(prefix="bert-recipes-warm-"))
    socket_path, log = str(tmp / "server.sock"), tmp / "server.log"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests/warm"), os.environ.get("PYTHONPATH")]))
    _WARM.update(log=log, server=subprocess.Popen([sys.executable, str(REPO / "tests/warm/server.py"), socket_path,
                                                   str(log)], cwd=REPO, stdout=subprocess.DEVNULL,
                                                  stderr=open(tmp / "server.err", "w")))
    os.environ["BERT_RECIPES_WARM_SOCKET"] = socket_path   # the server compares requests with its own environment


def wait_for_warm_server(timeout: float = 120) -> None:
    """Before the first launch: until the server has imported everything (its log's first line, "ready"), or
    it died or timed out (then the processes start cold, as they would without it). Without this wait the
    session's first launcher started cold while its ranks, a moment later, started warm."""
    import time
    deadline = time.time() + timeout
    while "log" in _WARM and not _WARM.get("waited") and time.time() < deadline and _WARM["server"].poll() is None:
        if _WARM["log"].exists() and _WARM["log"].read_text().startswith("ready"):
            break
        time.sleep(0.2)
    _WARM["waited"] = True   # once: a server that never got ready does not hold up every launch


def warm_summary() -> str:
    """One line: how many processes started warm, how many cold and why."""
    import collections
    if "log" not in _WARM or not _WARM["log"].exists():
        return "warm start: off (BERT_RECIPES_WARM=0)"
    lines = _WARM["log"].read_text().splitlines()
    warm = sum(line.startswith("warm\t") for line in lines)
    cold = collections.Counter(line.split("\t")[1].split(":")[0] for line in lines if line.startswith("cold\t"))
    return (f"warm start: {warm} processes forked warm, {sum(cold.values())} started cold by the server's rule "
            f"({dict(cold)}; log {_WARM['log']})")


def started_warm(fragment: str) -> int:
    """How many processes whose command line holds `fragment` the warm server forked."""
    if "log" not in _WARM or not _WARM["log"].exists():
        return 0
    return sum(line.startswith("warm\t") and fragment in line for line in _WARM["log"].read_text().splitlines())


# What the project's commands write into the working tree by default (runs/<name>, data/sample, data/prepared):
# a test writes under its tmp_path instead, and reads none of it, so the suite runs the same before and after
# `make demo` (the README's order). The suite fails when it changed them.
TREE_OUTPUTS = ("runs", "data")
_TREE: dict = {}
_TREE_WRITERS: list = []


def pytest_sessionstart(session):
    _TREE.update({root: snapshot(REPO / root) for root in TREE_OUTPUTS})
    _start_warm_server()


@pytest.fixture(autouse=True)
def _tree_outputs_unchanged(request):
    """The test that changed runs/ or data/ fails at its teardown, by name (the session check below only
    says that one did). Even creating the empty directory counts: a clean clone has neither."""
    yield
    now = {root: snapshot(REPO / root) for root in TREE_OUTPUTS}
    changed = [root + "/" for root in TREE_OUTPUTS if now[root] != _TREE[root]]
    if changed:
        for root in TREE_OUTPUTS:   # what the suite created goes, so a later writer is caught too
            if _TREE[root] is None and (REPO / root).exists():
                shutil.rmtree(REPO / root)
        _TREE.update({root: snapshot(REPO / root) for root in TREE_OUTPUTS})   # told once, by the test that did it
        _TREE_WRITERS.append(request.node.nodeid)
        pytest.fail(f"{request.node.nodeid} changed the working tree's {', '.join(changed)}: a test writes under "
                    "its tmp_path, never where a run writes by default", pytrace=False)


_ENV_CHANGED: list[str] = []


@pytest.fixture(autouse=True)
def _environment_restored(request):
    """What a test leaves in os.environ is put back after it, and the test is named at the end of the session: the
    warm server forks only for a launch whose environment is its own, so one leaked variable (MLflow's request
    settings, twice so far: 42 minutes instead of 20) makes every later launch start cold. A test sets variables
    through monkeypatch (undone before this), or restores them itself (run_in_process does)."""
    before = dict(os.environ)
    yield
    own = "PYTEST_CURRENT_TEST"   # pytest's own, set and removed by pytest around every phase
    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k) and k != own)
    if changed:
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                del os.environ[key]
        _ENV_CHANGED.append(f"{request.node.nodeid} ({', '.join(changed)})")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(warm_summary())
    if _ENV_CHANGED:
        terminalreporter.write_line("os.environ changed by, and restored after: " + "; ".join(_ENV_CHANGED))


def pytest_collection_modifyitems(session, config, items):
    """The backend matrix (tests/test_backends.py, whose offload rows load CPU Adam) runs after the other
    files, and its NVMe rows last: async_io is DeepSpeed's longest build. tests/build_ds_ops.py builds the
    ops in the background meanwhile: when DeepSpeed tests are selected, it starts now, at the lowest
    priority, so it takes the cores only when the tests leave them idle. (The matrix's module stays in one
    piece: its shared runs are made once.)"""
    matrix = [item for item in items if item.module.__name__ == "test_backends"]
    nvme = [item for item in matrix if "nvme" in item.name]
    matrix = [item for item in matrix if item not in nvme]
    items[:] = [item for item in items if item not in nvme and item not in matrix] + matrix + nvme
    if any(item.module.__name__ in DS_MODULES or any(word in item.name for word in DS_WORDS) for item in items):
        _clear_stale_build_locks()
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
               "BERT_RECIPES_WARM": "0"}   # its own session, to outlive pytest (the warm server's children do not)
        # its own session: it outlives an interrupted pytest, so a build is never killed half-way (torch's
        # build lock would then make every later load wait)
        _BUILDS.append(subprocess.Popen(["nice", "-n", "19", sys.executable, str(REPO / "tests/build_ds_ops.py")],
                                        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True))


_BUILDS: list = []


def _clear_stale_build_locks(grace_s: float = 120.0) -> None:
    """torch's build lock (`<op>/lock` in the extension cache) has no owner and no timeout: a build killed
    half-way (kill -9, an OOM) leaves it behind, and every later load of that op waits forever (seen
    2026-12-02: a NVMe row waited 20 minutes on a lock a killed build had left at 07:10). A lock is stale
    when it is older than `grace_s` and no live process works in its op's directory (ninja runs there);
    a stale one is removed with a line, so the op is built again."""
    import time

    import psutil
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    locks = [lock for lock in root.glob("*/lock") if time.time() - lock.stat().st_mtime > grace_s]
    if not locks:
        return
    busy = set()
    for proc in psutil.process_iter():
        try:
            busy.add(Path(proc.cwd()).resolve())
        except (psutil.Error, OSError):
            continue
    for lock in locks:   # resolved: under a symlinked .venv the lock's path and ninja's cwd differ in spelling only
        where = lock.parent.resolve()
        if not any(where == cwd or where in cwd.parents for cwd in busy):
            lock.unlink(missing_ok=True)
            print(f"[conftest] removed a stale build lock, {lock} (no build works there): "
                  f"DeepSpeed builds {lock.parent.name} again", file=sys.stderr)


def pytest_sessionfinish(session, exitstatus):
    for build in _BUILDS:   # collect a finished build's exit status (no zombie); a running one goes on
        build.poll()
    changed = [root for root, before in _TREE.items() if snapshot(REPO / root) != before]
    if changed or _TREE_WRITERS:   # a process a test left behind may write after its teardown
        who = ", ".join(_TREE_WRITERS) or "no test by its teardown (a process left running?)"
        print(f"\n[conftest] the suite changed the working tree's runs/ or data/: {who}; a test writes under its "
              "tmp_path, never where a run writes by default", file=sys.stderr)
        session.exitstatus = 1
    if "server" in _WARM:   # it also stops by itself when pytest is gone
        _WARM["server"].terminate()


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory) -> Path:
    from bert_recipes.data.sample import build_sample
    out = tmp_path_factory.mktemp("sample")
    build_sample(out)
    return out


@pytest.fixture(scope="session")
def shared_tokenizer() -> Path:
    """One WordPiece tokenizer (vocab 1000) for runs that must be compared with each other, committed
    under tests/data/: the tokenizers library's trainer breaks ties in hash order, so two trainings on
    the same text differ (and the sample's text depends on the host's Python), which would re-draw every
    learning margin in the suite each session. Made once from the sample's first 1,200 lines with
    bert_recipes.data.tokenizer.train_wordpiece(..., 1000, lowercase=True)."""
    return REPO / "tests" / "data" / "wordpiece-1000"


@pytest.fixture(scope="session")
def datasets_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_datasets_cache")


def tiny_args(out_dir: Path, sample_dir: Path, cache: Path, task: str = "mlm", **extra) -> list[str]:
    """Overrides that shrink any recipe to a seconds-long CPU run."""
    args = {
        "run.output_dir": out_dir, "run.seed": 7,
        "data.source": "sample", "data.sample_dir": sample_dir, "data.cache_dir": cache,
        "data.max_seq_length": 32, "data.max_eval_samples": 96,
        "model.hidden_size": 32, "model.num_hidden_layers": 2, "model.num_attention_heads": 2,
        "model.intermediate_size": 64, "model.max_position_embeddings": 64,
        "tokenizer.vocab_size": 1000,
        "optim.lr": 3e-3, "optim.warmup_steps": 2,
        "train.global_batch_size": 16, "train.micro_batch_size": 8, "train.max_steps": 24,
        "logging.log_every": 4, "logging.trackers": "[]", "logging.progress_bar": False, "logging.plot": False,
    }
    if task == "mlm":
        args.update({"task.kind": "mlm", "data.max_train_samples": 1200})
    else:
        args.update({"task.kind": "classification", "task.num_labels": 8, "data.max_train_samples": 512,
                     "optim.lr": 2e-3})
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def column(split, key: str) -> list:
    """A split's column as lists: a datasets split's own, or a token store's blocks (packed MLM) read in one call."""
    if hasattr(split, "column_names"):
        return split[key]
    return [row[key].tolist() for row in split.__getitems__(range(len(split)))]


def write_pairs(path: Path, n: int, seed: int) -> Path:
    """A sentence-pair task one word decides ("fresh" 1, "rotten" 0), as jsonl with columns a, b, label
    (and a regression score): learnt in a few dozen steps by any tiny BERT."""
    import torch
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        label = int(torch.randint(2, (1,), generator=g))
        word = ["apple", "orange", "pear"][int(torch.randint(3, (1,), generator=g))]
        rows.append({"a": f"the {word} is {'fresh' if label else 'rotten'}", "b": f"about the {word}",
                     "label": label, "score": 4.0 * label + 0.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_encoder(out: Path, tokenizer_dir: Path, dropout: float = 0.1) -> Path:
    """A seeded tiny BERT encoder (hidden 32, 2 layers, sequence 64) with its tokenizer, in an export's layout."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                                 hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_in_process(overrides: list[str], recipe: str | None = None) -> dict:
    """Run train.main in this process (one process); Accelerate's singletons are reset around it."""
    import train
    from accelerate.state import AcceleratorState, GradientState
    from bert_recipes.config import load_config
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        assert var not in os.environ, f"{var} is set: in-process runs must be single-process"
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    environment = dict(os.environ)
    try:
        return train.main(load_config(recipe, overrides))
    finally:   # what a run sets in its process (a tracker's variables) must not reach the next launch: the warm
        os.environ.clear()   # server starts a process cold when its environment differs from the server's
        os.environ.update(environment)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(size_bytes, read_only=False) -> a fresh tmpfs mounted below tmp_path: a small disk that fills, or
    a read-only place (the tests run as root, where file modes stop nothing). Each is unmounted, by its
    path, whatever happens; skipped with one line where nothing can be mounted (not root, no CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(size: int, read_only: bool = False) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
        mounted.append(where)
        return where
    yield mount
    for where in mounted:
        subprocess.run(["umount", "--lazy", str(where)], capture_output=True)


def snapshot(path: Path) -> dict | None:
    """{file: (size, mtime)} under path (None if it does not exist): "nothing written" is an equal snapshot."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def refused_launched(overrides: list[str], watched: Path, backend: str = "ddp", config: Path | None = None) -> str:
    """train.py launched on one process as the Make targets launch it (bert_recipes.launch: the rank's exit code,
    not torch's report), held to refused_in_process's rules: exit code 2, exactly one `config error:` line, no
    traceback, nothing created or changed under `watched`. -> that line."""
    before = snapshot(watched)
    (cmd,), env = launch_commands("train.py", [f"--{o}" for o in overrides], 1, backend=backend, config=config)
    done = subprocess.run([sys.executable, "-m", "bert_recipes.launch", *cmd], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("config error:")]
    assert done.returncode == 2 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert snapshot(watched) == before, f"{watched} changed"
    return lines[0]


def assert_same_weights(a, b, tol: float) -> None:
    """Two exports (model.safetensors paths, or their loaded dicts) hold the same tensors within tol."""
    import torch
    from safetensors.torch import load_file
    wa, wb = (load_file(w) if isinstance(w, (str, Path)) else w for w in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=tol, rtol=0, msg=k)


def run_cli_in_process(argv: list[str], capsys, stdout_too: bool = False) -> tuple[int, str]:
    """train.py's command line (train.run_cli, what `python train.py` calls) in this process, Accelerate's
    process-wide state reset before and after. -> (exit code, stderr; stdout then stderr with stdout_too)."""
    import train
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    environment = dict(os.environ)
    try:
        code = train.run_cli(argv)
    finally:   # as run_in_process: nothing a run sets in os.environ outlives it
        os.environ.clear()
        os.environ.update(environment)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    captured = capsys.readouterr()
    return code, (captured.out + captured.err) if stdout_too else captured.err


def refused_in_process(argv: list[str], watched: Path, capsys) -> str:
    """Run train.py's command line in this process and hold it to the rules for a user's mistake: exit code
    2, exactly one `config error:` line, no traceback, nothing created or changed under `watched`. -> that line."""
    before = snapshot(watched)
    code, err = run_cli_in_process(argv, capsys)
    lines = [line for line in err.splitlines() if line.startswith("config error:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert snapshot(watched) == before, "the output directory changed"
    return lines[0]


def backend_rows():
    """The backend matrix: the same table the Makefile and tools/ read."""
    from bert_recipes.backends.plan import backend_rows as rows
    return rows()


# The rows a feature runs on, from accelerate_configs/backends.tsv by their launch files: one row of each engine kind
# and ZeRO stage on one node, plus the first row that offloads to the host (an NVMe row runs in
# tests/test_backends.py). DDP's run is the reference; every other row's losses are DDP's within a test's TOL (fp32,
# dropout off; the gaps measured on CPU were below 1e-6).
ENGAGED = {"ddp": "DistributedType.MULTI_CPU", "fsdp": "DistributedType.FSDP", "deepspeed": "DistributedType.DEEPSPEED"}


def feature_rows() -> list[str]:
    from bert_recipes.backends.plan import first_row
    return [first_row("ddp"), first_row("fsdp"), *(first_row("deepspeed", stage) for stage in (1, 2, 3)),
            first_row("deepspeed", offload="cpu")]


def runs_by_row(root: Path, args):
    """run(name) -> the metrics.json of args(output_dir) launched on 2 processes under the backend row `name`, each
    row once (a module-scoped fixture shares it between the rows' tests)."""
    done = {}

    def run(name: str) -> dict:
        if name not in done:
            done[name] = launch(2, args(root / name), backend=name)
        return done[name]
    return run


def assert_row_is_ddp(name: str, ours: dict, ddp: dict, tol: float):
    """A row's run: 2 processes, its backend engaged, its losses learning and DDP's within tol, step for step."""
    final, rows = ours["final"], ours["history"]["train"]
    kind = backend_rows()[name].plan.kind
    assert final["num_processes"] == 2 and final["backend"]["distributed_type"] == ENGAGED[kind], (name, final)
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(rows, ddp["history"]["train"])]
    assert len(gaps) == len(ddp["history"]["train"]) and max(gaps) < tol, (name, gaps)


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_commands(script: str, args: list[str], nproc: int, launcher: str = "accelerate", env: dict | None = None,
                    backend: str = "ddp", config: Path | None = None) -> tuple[list[list[str]], dict]:
    """The command lines (one per "machine") and environment that run a repository script as a real
    multi-process job on CPU, under a row of the backend matrix. Each row gets the CPU launch that
    really engages it (the table's cpu_env; see FEASIBILITY: the obvious ones silently fall back);
    A GPU-only row (FSDP) goes through tests/fsdp_cpu_harness.py, which forces Accelerate's FSDP onto
    CPU processes: a test's tool only, never a user's launch (backends.tsv gives FSDP no CPU launch)."""
    wait_for_warm_server()
    bin_dir = Path(sys.executable).parent
    row = backend_rows()[backend]
    plan = row.plan
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if row.gpu_only:
        base_env.update(ACCELERATE_USE_CPU="1", CUDA_VISIBLE_DEVICES="", HARNESS_SCRIPT=script)
        script, row = "tests/fsdp_cpu_harness.py", dataclasses.replace(row, cpu_yaml=row.config)
    else:
        base_env = row.cpu_launch_env(base_env)
    args = [str(REPO / script)] + args
    port = str(_port())
    if launcher == "torchrun":
        cmds = [[str(bin_dir / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port] + args]
    elif plan.num_machines > 1:   # 2 "machines" x 1 process on 127.0.0.1
        cmds = [[str(bin_dir / "accelerate"), "launch", "--config_file", str(REPO / row.cpu_config),
                 "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                 "--main_process_ip", "127.0.0.1", "--main_process_port", port] + args for rank in (0, 1)]
    else:
        cmds = [[str(bin_dir / "accelerate"), "launch", "--config_file", str(config or REPO / row.cpu_config),
                 "--num_processes", str(nproc), "--main_process_port", port] + args]
    return cmds, base_env


def launch_script(script: str, args: list[str], nproc: int, launcher: str = "accelerate", timeout: int = 900,
                  env: dict | None = None, backend: str = "ddp", config: Path | None = None,
                  check: bool = True) -> str:
    """Run a repository script as a real multi-process job on CPU (see launch_commands); return its
    output. check: assert that every launcher exited 0."""
    import tempfile
    import time
    cmds, base_env = launch_commands(script, args, nproc, launcher, env, backend, config)
    files = [tempfile.TemporaryFile("w+") for _ in cmds]   # files, not pipes: two launchers cannot block on a full pipe
    procs = [subprocess.Popen(cmd, cwd=REPO, env=base_env, stdout=f, stderr=subprocess.STDOUT, text=True)
             for cmd, f in zip(cmds, files)]
    codes, deadline = [], time.time() + timeout
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            codes.append("timed out")
    logs = []
    for f in files:
        f.seek(0)
        logs.append(f.read())
        f.close()
    log = "\n".join(logs)
    if "timed out" in codes:   # a hang costs `timeout`, and says where it stood
        pytest.fail(f"{' '.join(cmds[0][:4])} ... {script} did not end within {timeout}s: killed; its last lines:\n"
                    f"{log[-4000:]}", pytrace=False)
    assert not check or codes == [0] * len(procs), f"launch failed ({codes}):\n{log[-8000:]}"
    return log


def launch_watched(overrides: list[str], react, nproc: int = 2, backend: str = "ddp", launcher: str = "accelerate",
                   env: dict | None = None, timeout: int = 600, config: Path | None = None,
                   script: str = "train.py") -> tuple[int, str, float]:
    """Launch train.py (or `script`: tests/checksum_harness.py for a test that reads final.rank_checksums)
    and call react(line, proc) on every output line as it comes (to signal or kill while it runs).
    -> (launcher exit code, whole output, seconds from react's first True to the exit)."""
    import time
    args = [f"--{o}" for o in overrides]
    (cmd,), base_env = launch_commands(script, args, nproc, launcher, env, backend, config)
    import threading
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, acted_at, fired = [], None, []
    # a silent hang too: no line has to come for it to fire
    watchdog = threading.Timer(timeout, lambda: (fired.append(True), proc.kill()))
    watchdog.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if react(line, proc) and acted_at is None:
                acted_at = time.time()
        proc.wait()
    finally:
        watchdog.cancel()
    if fired:
        pytest.fail(f"train.py under {launcher} did not end within {timeout}s: killed; its last lines:\n"
                    f"{''.join(lines)[-4000:]}", pytrace=False)
    return proc.returncode, "".join(lines), time.time() - (acted_at or time.time())


def worker_pids(proc) -> dict[int, int]:
    """{rank: pid} of the train.py processes a launcher started: the processes of its rendezvous port (under
    the warm start a rank's process is a child of the launcher's forked twin, not of `proc`; signalling it
    reaches the twin of the rank: tests/warm/)."""
    import psutil
    args = list(proc.args)
    port = next(args[i + 1] for i, a in enumerate(args) if a in ("--main_process_port", "--master_port"))
    out = {}
    for child in psutil.process_iter():
        try:
            env = child.environ()
            if env.get("MASTER_PORT") == port and "RANK" in env and any("train.py" in part for part in child.cmdline()):
                out[int(env["RANK"])] = child.pid
        except psutil.Error:
            pass
    return out


def launch(nproc: int, overrides: list[str], recipe: str | None = None, launcher: str = "accelerate",
           timeout: int = 900, env: dict | None = None, backend: str = "ddp", config: Path | None = None) -> dict:
    """Run train.py as a real multi-process job on CPU, under a row of the backend matrix; return
    its metrics.json (final, history, config). Through tests/checksum_harness.py, which adds each rank's
    full-weight checksum (final.rank_checksums) to what train.py computes and changes nothing else."""
    out_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run.output_dir=")))
    args = (["--recipe", recipe] if recipe else []) + [f"--{o}" for o in overrides]
    log = launch_script("tests/checksum_harness.py", args, nproc, launcher=launcher, timeout=timeout, env=env, backend=backend,
                        config=config)
    (out_dir.parent / f"{out_dir.name}.log").write_text(log)
    return json.loads((out_dir / "metrics.json").read_text())
