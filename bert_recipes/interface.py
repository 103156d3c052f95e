"""The engine interface: everything train.py (and results.py, checkpoint.py) asks of an engine, in
one place. Two engines satisfy it: `engine.AccelerateEngine` (DDP, ZeRO-1/2/3 with offload, FSDP2)
and `pipeline.PipelineEngine` (DeepSpeed's pipeline). train.py's loop names no backend.

Call order: build (starts the process group) -> wrap -> prepare -> describe -> [load] ->
batches / train_step ... -> evaluate / save / export -> final -> finish.

Attributes marked "after prepare" exist only once `prepare` has run; `check_engine` verifies the
whole list then (train.main calls it on every run, so every backend test checks it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class Engine(Protocol):
    # ------------------------------------------------------------ facts, fixed at build time
    name: str                   # the backend row's name: ddp, zero2-offload, fsdp, pipeline ...
    on_gpu: bool                # the plan's device decision (backend.launch_plan_here), never re-decided
    device: torch.device        # where this rank's batches go
    num_processes: int          # every rank of the job
    replicas: int               # data-parallel replicas (the pipeline: world / stages)
    accum: int                  # micro batches per optimizer step on this rank
    is_main: bool               # global rank 0
    is_local_main: bool         # local rank 0 (one per node)
    fixed_length: int | None    # every batch padded to this length (the pipeline's buffers), or None
    setup_line: str             # one line: what runs, the batch arithmetic
    control: Any                # a gloo group for host-side agreement (guard.control_group)
    prep_barrier: Any           # callable: waits for rank 0's data preparation, with its own timeout
    # ------------------------------------------------------------ after prepare
    counts_data: bool           # this rank reads batches (the pipeline's middle stages do not)

    # ------------------------------------------------------------ communication and output
    def print0(self, *args) -> None:
        """Print on global rank 0 only."""

    def barrier(self) -> None:
        """Every rank waits for every other."""

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (picklable)."""

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, on every rank."""

    def start_trackers(self, run_name: str, config: dict, ids: dict | None = None) -> dict:
        """Open logging.trackers (rank 0) with the flat config, continuing the runs `ids` names (a resume);
        -> {tracker: run id} to save with the checkpoints (logs.Trackers)."""

    def log(self, values: dict, step: int) -> None:
        """One point per key on every tracker."""

    def finish(self) -> None:
        """Close trackers and clear swap files; the engine is not used after this."""

    # ------------------------------------------------------------ setup
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the optimizer is built over: the model, or this rank's pipeline stage."""

    def prepare(self, module: torch.nn.Module, optimizer, scheduler, data: dict, collate) -> None:
        """Hand module, optimizer, schedule and loaders to the backend."""

    def describe(self) -> dict:
        """What really engaged (backend, sharding, stages, dtypes): the [backend] line and metrics.json."""

    # ------------------------------------------------------------ training
    def batches(self, epoch: int, skip: int) -> Iterator[dict]:
        """This rank's micro batches of `epoch`, the first `skip` left out before collation."""

    def train_step(self, batches: Iterator[dict]) -> tuple:
        """One optimizer step over `accum` micro batches -> (mean loss, grad norm, skipped, fp16
        overflow): device tensors (or host values where the backend decided on the host) that the
        loop reads only at log steps."""

    def lr(self) -> float:
        """The learning rate of the last step."""

    def evaluate(self, dataset=None) -> dict:
        """Per-sample rows over the eval split (or `dataset`), every sample once, on every rank:
        metrics.eval_metrics' input."""

    def predict(self, dataset) -> Any:
        """The prediction of every row of `dataset`, in order (numpy): class ids or values."""

    # ------------------------------------------------------------ state
    def save(self, path: str) -> None:
        """Weights, optimizer, schedule and every rank's RNG into `path` (collective)."""

    def load(self, path: str) -> None:
        """The inverse of save: the run continues with the same data and RNG streams (bit-equal to the
        uninterrupted run on CPU, where the tests show it; on GPUs not bitwise: kernels sum in varying order)."""

    def export(self, out_dir: Path, tokenizer, config_yaml: str, card: str) -> Path:
        """A Hugging Face model with full fp32 weights, tokenizer, recipe and card, written by rank 0 through
        <out_dir>.partial (collective, without a barrier after rank 0's write: the caller agrees on it,
        so a write that fails there leaves no rank waiting)."""

    def final(self) -> dict:
        """End-of-run facts: peak memory per rank, checksums (collective)."""


MEMBERS = tuple(Engine.__annotations__) + tuple(n for n, v in vars(Engine).items()
                                                if callable(v) and not n.startswith("_"))


def missing_members(engine) -> list[str]:
    """The Engine members `engine` lacks (attributes included: call it after prepare)."""
    return sorted(n for n in MEMBERS if not hasattr(engine, n))


def check_engine(engine) -> None:
    """Raise TypeError naming what an engine lacks of the interface (a programming error, not a user's)."""
    missing = missing_members(engine)
    if missing:
        raise TypeError(f"{type(engine).__name__} does not implement the Engine interface "
                        f"(bert_recipes/interface.py): missing {', '.join(missing)}")
