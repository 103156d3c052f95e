"""The contracts: everything train.py (and results.py, checkpoint.py, export.py) asks of an engine, and of a task
kind (`Task`, at the end), in one place. Two engines satisfy `Engine`: `engine.AccelerateEngine` (DDP, ZeRO-1/2/3 with offload, FSDP2) and
`backends.pipeline.PipelineEngine` (DeepSpeed's pipeline). train.py's loop names no backend.

Call order: build (starts the process group) -> wrap -> prepare -> describe -> [load] ->
batches / train.train_step ... -> evaluate / save / export -> final -> finish.

The step is train.py's (train_step), not an engine's. Its two branches read two engines, each through its own
contract: `AccelerateStep` (the Accelerate engine's accelerator, model, optimizer and scheduler) and
`PipelineStep` (the pipeline engine's DeepSpeed engine, which runs the step's micro batches, clips, steps and
schedules). Output and collectives are plain functions (bert_recipes/ranks.py), the trackers train.py's
(logs.Trackers).

Attributes marked "after prepare" exist only once `prepare` has run; tests/test_interface.py checks each engine
against its contracts, from its code and after prepare on a real run, and that train_step reads nothing else.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class Engine(Protocol):
    # ------------------------------------------------------------ facts, fixed at build time
    name: str                   # the backend row's name: ddp, zero2-offload, fsdp, pipeline ...
    plan: Any                   # the resolved launch plan (backends/plan.LaunchPlan): train_step's branches
    on_gpu: bool                # the plan's device decision (backend.launch_plan_here), never re-decided
    device: torch.device        # where this rank's batches go
    num_processes: int          # every rank of the job
    replicas: int               # data-parallel replicas (the pipeline: world / stages)
    accum: int                  # micro batches per optimizer step on this rank
    is_main: bool               # global rank 0
    is_local_main: bool         # local rank 0 (one per node)
    fixed_length: int | None    # every batch padded to this length (the pipeline's buffers), or None
    setup_line: str             # one line: what runs, the batch arithmetic
    control: Any                # a gloo group for host-side agreement (ranks.control_group)
    prep_barrier: Any           # callable: waits for rank 0's data preparation, with its own timeout
    # ------------------------------------------------------------ after prepare
    counts_data: bool           # this rank reads batches (the pipeline's middle stages do not)

    # ------------------------------------------------------------ the end
    def finish(self) -> None:
        """Clear swap files and end the backend; the engine is not used after this."""

    # ------------------------------------------------------------ setup
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the optimizer is built over: the model, or this rank's pipeline stage."""

    def prepare(self, module: torch.nn.Module, optimizer, scheduler, data: dict, collate, mixture=None) -> None:
        """Hand module, optimizer, schedule and loaders to the backend; the training loader reads `mixture`'s order
        (data.mixture: bert_recipes/data/mixture.Mixture) when given, else the training split's own
        (`training_order(seed)`: a token store's, bert_recipes/data/store.py) where it has one, else a seeded shuffle
        of (seed, epoch)."""

    def describe(self) -> dict:
        """What really engaged (backend, sharding, stages, dtypes): the [backend] line and metrics.json."""

    # ------------------------------------------------------------ training
    def batches(self, epoch: int, skip: int) -> Iterator[dict]:
        """This rank's micro batches of `epoch`, the first `skip` left out before collation."""

    def lr(self) -> float:
        """The learning rate of the last step."""

    def set_batch(self, global_batch: int) -> None:
        """The global batch of the steps from here on (a batch ramp), after prepare: the micro batch stays, the
        accumulation follows; `accum` says the new one."""

    def evaluate(self, dataset=None) -> dict:
        """Per-sample rows over the eval split (or `dataset`), every sample once, on every rank:
        the task kind's metrics' input (tasks/<kind>.py)."""

    def predict(self, dataset) -> Any:
        """The prediction of every row of `dataset`, in order (numpy): class ids or values."""

    # ------------------------------------------------------------ state
    def save(self, path: str) -> None:
        """Weights, optimizer, schedule and every rank's RNG into `path` (collective)."""

    def load(self, path: str) -> None:
        """The inverse of save: the run continues with the same data and RNG streams (bit-equal to the
        uninterrupted run on CPU, where the tests show it; on GPUs not bitwise: kernels sum in varying order)."""

    def start_from(self, path: str) -> None:
        """A phase's start from another run's checkpoint with its optimizer state (checkpoint.init_from and
        init_optimizer): load's weights and optimizer state, this run's optimizer settings, schedule and RNG kept
        (phases.carry_over). The weights alone are read before the engine is built (backends/saved_weights.py)."""

    def export(self, out_dir: Path, tokenizer, config_yaml: str, card: str) -> Path:
        """A Hugging Face model with full fp32 weights, tokenizer, recipe and card, written by rank 0 through
        <out_dir>.partial (collective, without a barrier after rank 0's write: the caller agrees on it,
        so a write that fails there leaves no rank waiting)."""

    def final(self) -> dict:
        """End-of-run facts: peak memory per rank (collective)."""


@runtime_checkable
class AccelerateStep(Protocol):
    """What train_step's Accelerate branch reads (DDP, ZeRO-1/2/3 with offload, FSDP2): the engine's Accelerate
    objects, after prepare. Under ZeRO, DeepSpeed clips and steps inside accelerator.backward; the branch then only
    reads what its step decided (backends/deepspeed.py: deepspeed_norm_and_skip) and advances the schedule."""
    plan: Any                   # plan.deepspeed: whose step it is (DeepSpeed's, or the optimizer's here)
    accum: int                  # micro batches per optimizer step on this rank
    accelerator: Any            # accumulate, backward, clip_grad_norm_, scaler, sync_gradients
    model: torch.nn.Module      # the prepared model (DeepSpeed's engine under ZeRO)
    optimizer: Any              # the prepared optimizer: step, zero_grad (and its found_inf: optim.skip_update_if)
    scheduler: Any              # stepped once per optimizer step


@runtime_checkable
class PipelineStep(Protocol):
    """What train_step's pipeline branch reads: DeepSpeed's pipeline engine, after prepare, which runs the step's
    micro batches through its stages, clips, steps and schedules (backends/pipeline.py: train_batch)."""
    plan: Any                   # plan.pipeline: this branch
    engine: Any                 # deepspeed's PipelineEngine: train_batch, get_global_grad_norm, was_step_applied


@runtime_checkable
class Task(Protocol):
    """A task kind: the module bert_recipes/tasks/<kind>.py (tasks.kind_of(task.kind)), its functions taking the
    task section (`task`) and what they read. train.py, the data, the model builder and the engines call these and
    never test task.kind; what config validation needs of a kind is its row's data (tasks.TASKS). A kind whose row
    has test_predictions also gives `TestPredictions`, one with answer_files `AnswerFiles`. tests/test_interface.py checks every row's module against
    both, parameter by parameter."""

    # ------------------------------------------------------------ data
    def tokenize(self, raw, tokenizer, task, data):
        """Raw splits (sources.load_raw's DatasetDict) -> the model inputs of each split (a DatasetDict), cached by
        fingerprint (tokenizing.map_splits); it may write what it learnt into `task` (classification's label
        names)."""

    def notes(self, tokenized, task) -> list[str]:
        """Lines about the tokenized data worth a user's eye (rank 0 prints them)."""

    def collator(self, data, task, seed: int, tokenizer, fixed_length):
        """The run's collator: __call__(rows) -> a batch of tensors; `epoch`, `bins`, `unpad`, `attention_path`
        (the engine sets them); `evaluation_copy()`; `follow(schedule)` (a masking rate's levels)."""

    # ------------------------------------------------------------ the model
    def config_fields(self, task) -> dict:
        """What the task sets in the model's config (labels)."""

    def head(self, arch):
        """The model class trained for this kind on an architecture's file (bert_recipes/architectures/<name>.py),
        or for arch None (a checkpoint of a model type no architecture here builds) transformers' own, or None:
        called as cls(config) for a fresh model and cls.from_pretrained(...) for a checkpoint (an Auto class needs a
        small wrapper for the first)."""

    def loss(self, task):
        """loss(logits, labels) over a batch, as the pipeline's last stage computes it."""

    def trial_labels(self, task, ids, rate: float, k, g) -> dict:
        """A trial batch's labels for `ids` (trial.trial_batch), drawn from the generator `g`."""

    # ------------------------------------------------------------ evaluation
    def eval_rows(self, task, logits, labels, masked_positions=None) -> dict:
        """One evaluation batch's per-sample rows (device tensors), the same for every engine: the first dimension
        counts the batch's samples, and every other dimension has the same width on every rank (the engines gather
        them across ranks; a per-token kind pads its evaluation batches to data.max_seq_length)."""

    def metrics(self, task, rows: dict, split=None) -> dict:
        """The evaluation's metrics from every rank's rows (metrics.joined_rows), each sample once; `split`: the
        evaluated split's model inputs, in the rows' order (question answering reads its windows' offsets and its
        examples' contexts and answers there), or None for rows of several splits joined."""

    def baseline(self, task, data):
        """A score any model beats (final metrics), or None."""

    def card_task(self, task) -> str:
        """The model card's task line."""


@runtime_checkable
class TestPredictions(Protocol):
    """What a kind with test predictions (its row's test_predictions: data.test_splits) also gives."""

    def predictions(self, task, logits):
        """A batch's predictions from its logits (engine.predict)."""

    def prediction_text(self, task, preds) -> list[str]:
        """A split's predictions as its submission file writes them (results.write_predictions)."""


@runtime_checkable
class AnswerFiles(Protocol):
    """What a kind whose row has answer_files also gives: its final evaluation's answers as files."""

    def answer_files(self, task, rows: dict, split) -> dict:
        """{file name: JSON object} from an evaluation's rows and the evaluated split (results.write_answer_files)."""
