"""What a launch asks for, decided once: the LaunchPlan and the backend matrix.

`accelerate launch --config_file X.yaml` hands its settings to the script as ACCELERATE_* / FSDP_*
environment variables; `read_launch_plan` reads them, plus the DeepSpeed JSON they point at. Tools
that plan a launch without running it read the YAML itself with `plan_from_config_file`, into the
same LaunchPlan, so the backend vocabulary (name, kind, ZeRO stage, offload, sharding) is defined
once, here. The rows of accelerate_configs/backends.tsv (the Make targets) are BackendRows: data, each planned
from its own launch files.

The launch files get their libraries' own verdicts here, before any rank builds anything: Accelerate's on
its YAML (accelerate_verdict) and DeepSpeed's pydantic section models on its JSON (ds_json_verdict).

No torch at import time (torch is imported only to ask for the GPUs): the Make targets' preflight and
the memory planner read plans in a fraction of a second.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, first_line, load_json, load_yaml, read_text, yaml_problem

REPO = Path(__file__).resolve().parents[2]

BACKENDS_TSV = REPO / "accelerate_configs" / "backends.tsv"
# The engine kinds a launch can ask for (LaunchPlan.kind); a new kind: docs/changing.md.
KINDS = ("ddp", "fsdp", "deepspeed", "pipeline")
# The kinds no CPU launch runs: Accelerate 1.15 enables FSDP only on GPUs (on CPU processes it runs DDP under its
# name); their rows say gpu-only in the table's cpu_config column (tests/test_consistency.py holds them to it).
GPU_ONLY_KINDS = ("fsdp",)


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


@dataclass
class LaunchPlan:
    """What the launcher requested, before Accelerate interprets it."""
    deepspeed: bool = False
    fsdp: bool = False
    cpu: bool = False
    mixed_precision: str | None = None        # accelerate YAML's mixed_precision
    grad_accum_env: str | None = None         # accelerate YAML's deepspeed gradient_accumulation_steps
    grad_clip_env: str | None = None          # accelerate YAML's deepspeed gradient_clipping
    ds_config_path: str | None = None
    ds_config: dict = field(default_factory=dict)
    num_processes: int | None = None          # the YAML's num_processes (a running job reads WORLD_SIZE)
    num_machines: int = 1
    # Decided once, for the machine the run is on (launch_plan_here); None in a plan made for elsewhere
    # (the memory planner, tools that plan a launch): those take the device as an input.
    on_gpu: bool | None = None
    # DeepSpeed's accelerator, named where its own search would end at the CPU and warn on each rank ("Setting
    # accelerator to CPU. If you have GPU ..."): "cpu" on a machine without CUDA GPUs, else None (its search finds
    # CUDA; naming cpu with GPUs visible is refused, decide_on_gpu). Decided with on_gpu, by launch_plan_here.
    ds_accelerator: str | None = None
    # Resolved with the recipe, once, by resolve_run (preflight): what the engines and the loop read.
    world: int | None = None                  # processes
    replicas: int | None = None               # data-parallel replicas (world / stages under the pipeline)
    accum: int | None = None                  # micro batches per optimizer step
    precision: str | None = None              # the recipe's train.mixed_precision, checked against the launch files
    tf32: bool = False                        # TF32 matmuls: train.tf32 on a GPU
    packed_dropout: bool = False              # packed dropout masks (config.packed_dropout_here)
    padded: bool = False                      # padded batches with an attention mask (config.padded_batches)
    repeating_shapes: bool = False            # a fixed set of batch shapes (config.repeating_shapes): compile static
    attention_path: str | None = None         # documents that attend apart (config.documents_attend_apart): attention.py

    @property
    def pin_memory(self) -> bool:
        """Pinned host batches: worth it only when they are copied to a GPU."""
        return bool(self.on_gpu)

    # ------------------------------------------------------------ the backend vocabulary
    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0)) if self.deepspeed else 0

    @property
    def pipeline(self) -> bool:
        return self.deepspeed and "pipeline" in self.ds_config

    @property
    def kind(self) -> str:
        """The engine family: ddp | fsdp | deepspeed | pipeline."""
        if self.pipeline:
            return "pipeline"
        return "deepspeed" if self.deepspeed else "fsdp" if self.fsdp else "ddp"

    @property
    def offload(self) -> str:
        """Where ZeRO offloads to: none | cpu | nvme (the farther of optimizer and parameters)."""
        zero = self.ds_config.get("zero_optimization", {}) if self.deepspeed else {}
        devices = {(zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
        return "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"

    @property
    def offloads_optimizer(self) -> bool:
        """The optimizer step runs on the host (ZeRO offload_optimizer to cpu or nvme)."""
        zero = self.ds_config.get("zero_optimization", {}) if self.deepspeed and not self.pipeline else {}
        return (zero.get("offload_optimizer") or {}).get("device", "none") != "none"

    @property
    def name(self) -> str:
        """ddp | fsdp | zero0..3 with -offload (CPU) or -nvme | pipeline: the names of the Make
        targets, the memory planner's rows and the logs."""
        if self.kind != "deepspeed":
            return self.kind
        suffix = {"none": "", "cpu": "-offload", "nvme": "-nvme"}[self.offload]
        return f"zero{self.zero_stage}{suffix}"


def read_launch_plan(env=os.environ) -> LaunchPlan:
    plan = LaunchPlan(deepspeed=_true(env.get("ACCELERATE_USE_DEEPSPEED")), fsdp=_true(env.get("ACCELERATE_USE_FSDP")),
                      cpu=_true(env.get("ACCELERATE_USE_CPU")), mixed_precision=env.get("ACCELERATE_MIXED_PRECISION"),
                      grad_accum_env=env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                      grad_clip_env=env.get("ACCELERATE_GRADIENT_CLIPPING"),
                      ds_config_path=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
    if plan.deepspeed and plan.ds_config_path:
        path = Path(plan.ds_config_path)
        if not path.exists() and not path.is_absolute() and (REPO / path).exists():
            path = REPO / path   # a repository-relative path in a YAML, read from another directory
        if not path.exists():
            raise ConfigError(f"DeepSpeed config not found: {path} (from the accelerate config's deepspeed_config_file)")
        try:
            plan.ds_config = load_json(read_text(path, "DeepSpeed config", "ds_configs/zero2.json"), f"DeepSpeed config {path}")
        except json.JSONDecodeError as e:
            raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
        if not isinstance(plan.ds_config, dict):
            raise ConfigError(f"DeepSpeed config {path} is not a JSON object")
        ds_json_verdict(plan.ds_config, str(path))
    return plan


def launch_plan_here(env=os.environ) -> LaunchPlan:
    """The plan of a launched rank (or of a launch about to start here, `env` being its environment),
    with the device decided once (decide_on_gpu). Engines, the loop and the checks read plan.on_gpu and
    never decide again."""
    plan = read_launch_plan(env)
    cuda = nvidia_device_present() and _torch_sees_cuda()
    plan.on_gpu = decide_on_gpu(plan, env, cuda)
    plan.ds_accelerator = None if cuda else "cpu"
    return plan


def plan_from_config_file(path: str | Path) -> LaunchPlan:
    """The LaunchPlan an accelerate YAML would give a launched script (the same environment
    variables `accelerate launch` sets from it), for tools that plan without launching."""
    import yaml
    try:
        config = load_yaml(Path(path).read_text(), f"accelerate config {path}") or {}
    except OSError as err:
        raise ConfigError(f"accelerate config {path}: {err.strerror}; pass an existing file "
                          "(see accelerate_configs/)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"accelerate config {path} is not valid YAML: {yaml_problem(err)}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"accelerate config {path} is not a mapping of settings (see accelerate_configs/)")
    kind = accelerate_verdict(path, config)
    ds = config.get("deepspeed_config") or {}
    env = {"ACCELERATE_USE_DEEPSPEED": str(kind == "DEEPSPEED"), "ACCELERATE_USE_FSDP": str(kind == "FSDP"),
           "ACCELERATE_USE_CPU": str(config.get("use_cpu", False))}
    if config.get("mixed_precision") is not None:
        env["ACCELERATE_MIXED_PRECISION"] = str(config["mixed_precision"]).lower().replace("false", "no")
    for key, var in (("deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE"),
                     ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                     ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING")):
        if kind == "DEEPSPEED" and ds.get(key) is not None:
            env[var] = str(ds[key])
    plan = read_launch_plan(env)
    plan.num_processes = int(config.get("num_processes", 1))
    plan.num_machines = int(config.get("num_machines", 1))
    return plan


@contextlib.contextmanager
def quiet_fds():
    """The process's stdout and stderr (the file descriptors, which a library's logging handler writes to
    whatever sys.stdout was when it was made) sent to /dev/null meanwhile."""
    import sys
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1), os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


# Accelerate's enums, by the class name its refusal quotes ("'x' is not a valid DistributedType") -> the field
ACCELERATE_ENUMS = {"DistributedType": "distributed_type", "SageMakerDistributedType": "distributed_type",
                    "ComputeEnvironment": "compute_environment", "PrecisionType": "mixed_precision",
                    "DynamoBackend": "dynamo_config.dynamo_backend"}


def accelerate_verdict(path, config: dict) -> str:
    """Accelerate's own reading of its YAML, before the launch: load_config_from_file (it checks
    distributed_type, compute_environment and unknown keys), then the enums it leaves to `accelerate launch`
    (mixed_precision, as PrecisionType(value.lower()); dynamo_config.dynamo_backend, as
    DynamoBackend(value.upper())). Its refusal is one line naming the file and the field. -> the
    distributed_type, as Accelerate reads it."""
    import re

    with quiet_fds():   # importing Accelerate imports DeepSpeed, which prints its accelerator line
        import accelerate.utils as au
        from accelerate.commands.config.config_args import load_config_from_file
    try:
        # a compute_environment it does not know would make it read the file as a SageMaker config, and name
        # every cluster key as unknown: its own enum first
        au.ComputeEnvironment(config.get("compute_environment", au.ComputeEnvironment.LOCAL_MACHINE))
        loaded = load_config_from_file(str(path))
        precision = loaded.mixed_precision
        if precision is not None:   # accelerate launch: PrecisionType(args.mixed_precision.lower())
            au.PrecisionType(precision.lower() if isinstance(precision, str) else precision)
        backend = (loaded.dynamo_config or {}).get("dynamo_backend")
        if backend is not None:     # accelerate launch: DynamoBackend(args.dynamo_backend.upper())
            au.DynamoBackend(backend.upper() if isinstance(backend, str) else backend)
    except (ValueError, TypeError, AttributeError) as err:
        text = first_line(err)
        enum = re.search(r"is not a valid (\w+)", text)
        unknown = re.search(r"unknown keys \((.*?)\)", text)
        if enum and enum.group(1) in ACCELERATE_ENUMS:
            field = ACCELERATE_ENUMS[enum.group(1)]
            value = functools.reduce(lambda d, k: (d or {}).get(k), field.split("."), config)
            choices = ", ".join(str(c.value) for c in getattr(au, enum.group(1)))
            fix = f"use one of {choices}"
            said = f"{field}={value!r} is refused by Accelerate"
        elif unknown:
            said, fix = f"{unknown.group(1)} are not keys Accelerate knows", "remove them (accelerate_configs/ shows the keys)"
        else:
            said, fix = f"Accelerate refuses it ({text})", "compare it with accelerate_configs/"
        raise ConfigError(f"accelerate config {path}: {said}; {fix}") from None
    return str(getattr(loaded.distributed_type, "value", loaded.distributed_type))


def pipeline_replicas(plan: LaunchPlan, world_size: int) -> int:
    """Data-parallel replicas: the world size, or world / stages under the pipeline engine (whose
    `stages` consecutive ranks form one pipeline)."""
    if not plan.pipeline:
        return world_size
    stages = plan.ds_config.get("pipeline", {}).get("stages", 2)
    if not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"pipeline.stages must be a positive integer, got {stages!r}")
    if world_size % stages:
        raise ConfigError(f"{world_size} processes cannot form pipelines of {stages} stages (pipeline.stages in "
                          f"{plan.ds_config_path}): the world size must be a multiple of the stage count")
    return world_size // stages


# ---------------------------------------------------------------------------- the device
def decide_on_gpu(plan: LaunchPlan, env=os.environ, cuda_available: bool | None = None) -> bool:
    """The one answer to "does this run train on CUDA GPUs?", asked once by launch_plan_here and kept
    as plan.on_gpu, which is what everything reads: the process-group backend,
    the fp16 and bf16 checks, the optimizer kernel, pinned memory and the GPU statistics: CUDA is
    visible and the launch did not ask for CPU. DS_ACCELERATOR=cpu with GPUs visible is refused:
    Accelerate would still pick NCCL and CUDA devices and DeepSpeed would send CPU tensors over NCCL
    (the CPU launch rule hides the GPUs: make <mode> CPU=1 sets CUDA_VISIBLE_DEVICES=)."""
    if cuda_available is None:
        cuda_available = nvidia_device_present() and _torch_sees_cuda()
    cuda = cuda_available
    if env.get("DS_ACCELERATOR") == "cpu" and cuda:
        raise ConfigError("DS_ACCELERATOR=cpu asks DeepSpeed for a CPU run but CUDA GPUs are visible, so Accelerate "
                          "would use NCCL and CUDA devices; hide them (CUDA_VISIBLE_DEVICES=, as make <mode> CPU=1 "
                          "does) or unset DS_ACCELERATOR to train on the GPUs")
    return cuda and not plan.cpu


def nvidia_device_present() -> bool:
    """An NVIDIA GPU could be here: a /dev/nvidia<N> device (Linux, containers), WSL's /dev/dxg, or nvidia-smi.
    Without any of them CUDA sees no GPU, and the answer needs no torch (about 1.5 s to import)."""
    import shutil
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/dxg").exists() or shutil.which("nvidia-smi") is not None


def _torch_sees_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def bf16_supported(capability: tuple[int, int] | None) -> bool:
    """Native bf16 needs compute capability 8.0 (Ampere) or newer. torch.cuda.is_bf16_supported()
    also says yes on V100/T4, where bf16 is emulated and slow."""
    return capability is not None and tuple(capability) >= (8, 0)


def local_capability() -> tuple[int, int]:
    """This rank's GPU (LOCAL_RANK), read before any device is set, without touching GPU 0."""
    import torch
    return torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0")))


# ---------------------------------------------------------------------------- the backend matrix
@dataclass(frozen=True)
class BackendRow:
    """One row of accelerate_configs/backends.tsv: a Make target and how it launches. A row is data: its name is
    its label (the Make target, what the planner and the tools show), never derived from its kind; its kind,
    ZeRO stage, offload and sharding are read from its launch files (plan)."""
    name: str
    config: str          # the accelerate YAML on GPUs
    cpu_yaml: str | None  # the accelerate YAML on CPU processes; None: a GPU-only row
    cpu_env: str         # VAR=value the CPU launch needs (the Makefile prefixes the same)
    nodes: int = 1       # machines the launch spans (the Makefile's multi-node rule; = the YAML's num_machines)

    @property
    def gpu_only(self) -> bool:
        """The table's `gpu-only`: no CPU launch runs this backend (FSDP: Accelerate would run DDP)."""
        return self.cpu_yaml is None

    @property
    def cpu_config(self) -> str:
        if self.cpu_yaml is None:
            raise ConfigError(f"{self.name} runs on GPUs only (accelerate_configs/backends.tsv): on CPU processes use "
                              "a DDP or ZeRO row (make modes)")
        return self.cpu_yaml

    @property
    def plan(self) -> LaunchPlan:
        """The LaunchPlan its GPU launch file gives (read once a process; a copy each time: tools fill it in)."""
        return _file_plan(self.config)

    def cpu_launch_env(self, env: dict) -> dict:
        """`env` with this row's CPU launch variables. DeepSpeed on CPU needs DS_ACCELERATOR=cpu and
        must NOT see ACCELERATE_USE_CPU (Accelerate would silently run plain DDP instead)."""
        self.cpu_config   # a GPU-only row has no CPU launch: ConfigError
        assignments = dict(item.split("=", 1) for item in self.cpu_env.split())
        deepspeed = assignments.get("DS_ACCELERATOR") == "cpu"
        out = {k: v for k, v in env.items() if not (deepspeed and k == "ACCELERATE_USE_CPU")}
        return {**out, **assignments}


@functools.lru_cache(maxsize=None)
def _read_file_plan(config: str) -> LaunchPlan:
    return plan_from_config_file(REPO / config)


def _file_plan(config: str) -> LaunchPlan:
    import copy
    return copy.deepcopy(_read_file_plan(config))


TSV_COLUMNS = ("name", "accelerate_config", "cpu_config", "cpu_env", "nodes")


def backend_rows() -> dict[str, BackendRow]:
    """The backend matrix, read by the Makefile, tools/ and the tests alike: the one list of rows."""
    rows = {}
    for n, line in enumerate(BACKENDS_TSV.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        if len(cells) != len(TSV_COLUMNS) or not cells[4].isdigit():
            raise ConfigError(f"{BACKENDS_TSV}:{n}: a row has {len(TSV_COLUMNS)} tab-separated columns "
                              f"({', '.join(TSV_COLUMNS)}; nodes a number), got {cells!r}")
        name, config, cpu_config, cpu_env, nodes = cells
        cpu_yaml = None if cpu_config == "gpu-only" else config if cpu_config == "-" else cpu_config
        rows[name] = BackendRow(name, config, cpu_yaml, "" if cpu_env == "-" else cpu_env, int(nodes))
    return rows


def chosen_rows(names: str | None, option: str = "--rows") -> list[BackendRow]:
    """The rows a tool's option (--rows) names (comma-separated), in the table's order; every row without names. A
    name that is no row: ConfigError, one line naming it and the rows there are (never skipped in silence)."""
    rows = backend_rows()
    if not names:
        return list(rows.values())
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in rows]
    if unknown:
        raise ConfigError(f"{option}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a row of "
                          f"accelerate_configs/backends.tsv (its rows: {', '.join(rows)})")
    return [row for name, row in rows.items() if name in wanted]


def first_row(kind: str, zero_stage: int | None = None, offload: str = "none") -> str | None:
    """The first one-node row (in the table's order) whose launch files give this kind (ddp | fsdp | deepspeed |
    pipeline), ZeRO stage and offload: how a tool names a backend it suggests or compares, from the table."""
    for name, row in backend_rows().items():
        plan = row.plan
        if (row.nodes == 1 and plan.kind == kind and plan.offload == offload
                and (zero_stage is None or plan.zero_stage == zero_stage)):
            return name
    return None


# ---------------------------------------------------------------------------- DeepSpeed's own verdict on its JSON
def _ds_sections():
    """{section: DeepSpeed's reader of it}: its pydantic models, which need neither a world size nor the
    recipe's numbers (the whole DeepSpeedConfig needs both, and refuses "auto")."""
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from deepspeed.runtime.zero.config import get_zero_config
    return {"zero_optimization": get_zero_config, "bf16": get_bfloat16_config, "fp16": get_float16_config}


def without_autos(value):
    """A JSON value with every "auto" left out: Accelerate fills those before DeepSpeed reads them."""
    if isinstance(value, dict):
        return {k: without_autos(v) for k, v in value.items() if v != "auto"}
    if isinstance(value, list):
        return [without_autos(v) for v in value]
    return value


def ds_json_verdict(ds: dict, name: str) -> None:
    """DeepSpeed's own validators on the JSON's sections, run before any engine is built (in preflight and
    in every rank, where the message is rank 0's): a value DeepSpeed refuses (a ZeRO stage of 7, an offload
    device it does not know) is one line naming the file and the field, not its pydantic traceback from
    every rank. Its verdict, not a copy of its rules. Without DeepSpeed installed the ranks fail anyway."""
    try:
        with quiet_fds():   # importing DeepSpeed prints its accelerator line
            sections = _ds_sections()
            from pydantic import ValidationError
    except ImportError:
        return
    if (ds.get("zero_optimization") or {}).get("stage") == "auto":   # Accelerate fills batch sizes, not the stage
        raise ConfigError(f"DeepSpeed config {name}: zero_optimization.stage='auto' is not filled by Accelerate: give "
                          "0, 1, 2 or 3 (ds_configs/README.md lists what each file sets)")
    given = without_autos(ds)
    for section, read in sections.items():
        if section not in given:
            continue
        try:
            read(given)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in (section, *first["loc"]))
            shown = f"={first['input']!r}" if not isinstance(first["input"], dict) else ""
            raise ConfigError(f"DeepSpeed config {name}: {field}{shown} is refused by DeepSpeed ({first['msg']}); "
                              "fix it (ds_configs/README.md lists what each file sets)") from None
        except (TypeError, ValueError, AssertionError) as err:
            raise ConfigError(f"DeepSpeed config {name}: its {section} section is refused by DeepSpeed "
                              f"({first_line(err)}); fix it (ds_configs/README.md)") from None
