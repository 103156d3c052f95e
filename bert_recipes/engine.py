"""The Accelerate engine (DDP, ZeRO-1/2/3 with offload, FSDP2) and the choice between it and
DeepSpeed's pipeline engine (bert_recipes/pipeline.py). Both implement the interface in
bert_recipes/interface.py (`Engine`: every method and attribute train.py uses, with its contract).
An engine keeps what differs between backends: wrap, prepare, batches, evaluate, save, load, export,
describe. The step is train.py's (train_step), which reads this engine's accelerator, model,
optimizer and scheduler; train.py's loop names no backend.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch

from .backends.accelerator import build_accelerator, describe, optimizer_in_effect, set_kernels
from .backends.deepspeed import (check_nvme_gradient_swap, deepspeed_owned, fill_micro_batch, fp32_state_dict,
                                 saved_meeting_the_barrier, without_zero_init, zero3_keeps_model_dtype)
from .backends.deepspeed_universal import resharded
from .backends.fsdp import wrap_model_layers
from .backends.plan import LaunchPlan
from .data.batching import Indexed, LengthGroupedBatches, fit_length_bins, loader_kwargs, sequence_lengths
from .config import DataConfig, OptimConfig, TaskConfig, TrainConfig
from .export import write_export
from .metrics import joined_rows
from .data.mixture import MixedOrder
from .optim import build_scheduler, resume_schedule
from .phases import carry_over
from .throughput import peak_memory_gb
from .ranks import all_sum, barrier, broadcast, control_group, print0, slow_barrier
from .tasks import kind_of


def build_engine(plan: LaunchPlan, output_dir: Path, *, train: TrainConfig, data: DataConfig, optim: OptimConfig,
                 task: TaskConfig, seed: int):
    """The pipeline engine when the DeepSpeed JSON has a `pipeline` section (Accelerate has no
    pipeline parallelism for training); Accelerate for everything else. Each engine takes the sections it
    reads: train (batches, timeouts, compile), data (loaders, length bins), optim (clipping, a DeepSpeed
    JSON's autos), task (evaluation rows) and the seed (the sampler's order). train.py owns the step
    (train_step), the trackers and the output (bert_recipes/ranks.py): an engine keeps what differs."""
    sections = dict(train=train, data=data, optim=optim, task=task, seed=seed)
    if plan.pipeline:
        from .backends.pipeline import PipelineEngine
        return PipelineEngine(plan, output_dir, **sections)
    return AccelerateEngine(plan, output_dir, **sections)


def eager_under_compile(compiled: bool):
    """Evaluation and prediction under train.compile run the model eagerly: each eval shape (eval mode,
    the last partial batch, every length bin) would otherwise be one more graph, compiled for seconds
    to minutes and counted against dynamo's recompile limit (8), past which dynamo falls back to eager
    for training too, silently. torch.compiler.set_stance is public and restores the stance before."""
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


class AccelerateEngine:
    """DDP, ZeRO-1/2/3 (+ CPU/NVMe offload) and FSDP2: whichever the launch config names.
    Creating it starts the process group and checks the recipe against the launch config."""

    counts_data = True       # every rank reads its own batches
    fixed_length = None      # dynamic padding

    def __init__(self, plan: LaunchPlan, output_dir: Path, *, train: TrainConfig, data: DataConfig,
                 optim: OptimConfig, task: TaskConfig, seed: int):
        self.plan, self.name = plan, plan.name
        self.train_cfg, self.data_cfg, self.optim_cfg, self.task, self.seed = train, data, optim, task, seed
        self.kind = kind_of(task.kind)   # the task contract: evaluation's rows, predictions
        self.accum, self.on_gpu = plan.accum, plan.on_gpu   # resolved once (backends.consistency.resolve_run)
        self.accelerator = build_accelerator(plan, output_dir, train=train, optim=optim, pin_memory=data.pin_memory)
        kernels = set_kernels(plan)
        a = self.accelerator
        self.control = control_group(train.collective_timeout_s)
        self.prep_barrier = slow_barrier(self.control, data.prepare_timeout_s, "rank 0's data preparation")
        self.is_main, self.is_local_main = a.is_main_process, a.is_local_main_process
        self.num_processes = self.replicas = a.num_processes
        self.device = a.device
        self.set_accumulation(self.accum)
        self._loaders: dict = {}   # id(split) -> (the split, its prepared loader): _loader
        if kernels:
            print0(kernels)

    def set_accumulation(self, accum: int):
        """The accumulation, and the setup line that shows it; again when train.micro_batch_size=auto's trial
        step chose a smaller micro batch (bert_recipes/trial.py), before anything is prepared."""
        a, t = self.accelerator, self.train_cfg
        self.accum = a.gradient_accumulation_steps = accum
        self.setup_line = (f"{a.distributed_type} x{a.num_processes} on {a.device}, precision={a.mixed_precision}; "
                           f"global batch {t.global_batch_size} = micro {t.micro_batch_size} x "
                           f"accum {accum} x world {a.num_processes}")

    def set_batch(self, global_batch: int):
        """The global batch of the steps from here on (train.global_batch_size_start's ramp: bert_recipes/batch_ramp.py),
        after prepare: the micro batch stays; Accelerate's accumulation follows (where it syncs, how it scales the
        loss), and under ZeRO DeepSpeed's own (its step boundary and loss scale: set_train_batch_size)."""
        self.accum = self.accelerator.gradient_accumulation_steps = global_batch // (
            self.train_cfg.micro_batch_size * self.replicas)
        self.accelerator.step = 0   # its micro-batch count, whose remainder places the sync: a stage starts a step
        if self.plan.deepspeed:
            self.model.set_train_batch_size(global_batch)

    def finish(self):
        if self.accelerator.swap_dirs:   # ZeRO NVMe offload: once every rank is done with its swap files,
            barrier()                       # one rank a node (an NVMe is node-local) clears them
            if self.is_local_main:
                for path in self.accelerator.swap_dirs:
                    shutil.rmtree(path, ignore_errors=True)
        self.accelerator.end_training()

    # ------------------------------------------------------------ setup
    def wrap(self, model):
        # refused here, before the optimizer is built: a refused run builds no CPU Adam (whose load, were a rank
        # stopped in it, would leave torch's build lock behind for every later run to wait on)
        check_nvme_gradient_swap(self.plan, model, self.num_processes, self.on_gpu)
        if self.plan.fsdp:
            wrap_model_layers(self.accelerator.state.fsdp_plugin, model)
        self.full_param_numel = sum(p.numel() for p in model.parameters())
        return model

    def prepare(self, module, optimizer, scheduler, data, collate, mixture=None):
        from torch.utils.data import DataLoader
        t, d = self.train_cfg, self.data_cfg
        if not self.on_gpu:   # lengths rounded up to a multiple of 8 feed tensor cores; on a CPU it is only padding
            collate.pad_to_multiple_of = None
        # documents that attend apart (data.document_mask, data.unpad): the plan's path; evaluation runs padded
        collate.unpad, collate.attention_path = d.unpad, self.plan.attention_path
        kwargs = loader_kwargs(d, collate, self.seed, pin=self.plan.pin_memory)
        lengths = fit_length_bins(collate, data, d.length_bins if self.plan.padded else 0, print0)
        if d.group_by_length:   # batches of similar length (data.LengthGroupedBatches)
            lengths = lengths or sequence_lengths(data["train"])
            batches = LengthGroupedBatches(lengths, t.micro_batch_size, self.seed,
                                           step_batches=t.global_batch_size // t.micro_batch_size,
                                           order=mixture.order if mixture else None)
            train_loader = DataLoader(Indexed(data["train"]), batch_sampler=batches, **kwargs)
        elif mixture is not None or hasattr(data["train"], "training_order"):   # the sources' order (data.mixture:
            # bert_recipes/data/mixture.py), or the split's own (a token store's: data/store.py)
            order = MixedOrder(mixture) if mixture is not None else data["train"].training_order(self.seed)
            train_loader = DataLoader(Indexed(data["train"]), batch_size=t.micro_batch_size, sampler=order,
                                      drop_last=True, **kwargs)
        else:
            train_loader = DataLoader(Indexed(data["train"]), batch_size=t.micro_batch_size, shuffle=True,
                                      drop_last=True, **kwargs)
        eval_loader = DataLoader(Indexed(data["eval"]), batch_size=t.eval_batch_size or t.micro_batch_size,
                                 **{**kwargs, "collate_fn": collate.evaluation_copy()})   # masks of epoch 0, always
        # The schedule wraps the torch optimizer itself, before prepare: ZeRO keeps that optimizer
        # (and its param_groups) inside its own. A DeepSpeed JSON may own both instead.
        optimizer, scheduler, owned = deepspeed_owned(
            self.accelerator, self.optim_cfg, module, optimizer, scheduler,
            recipe_schedule=lambda opt, total=scheduler.total_steps: build_scheduler(opt, self.optim_cfg, total))
        if owned:
            print0(owned)
        fill_micro_batch(self.accelerator, t.micro_batch_size)   # not read off the loaders (a batch sampler has none)
        with zero3_keeps_model_dtype() if self.plan.zero_stage == 3 else contextlib.nullcontext():
            if owned:
                self.model, self.optimizer, scheduler, self.train_loader, self.eval_loader = self.accelerator.prepare(
                    module, optimizer, scheduler, train_loader, eval_loader)
            else:
                self.model, self.optimizer, self.train_loader, self.eval_loader = self.accelerator.prepare(
                    module, optimizer, train_loader, eval_loader)
        print0(optimizer_in_effect(self.optimizer))
        expected = len(data["train"]) // t.micro_batch_size // self.num_processes   # config.optimizer_steps' count
        assert len(self.train_loader) == expected, (len(self.train_loader), expected)
        self.scheduler, self.collate = scheduler, collate   # its state goes to scheduler.json (see save)
        self.model.train()

    def describe(self) -> dict:
        return {"name": self.name, **describe(self.accelerator, self.model, self.full_param_numel)}

    # ------------------------------------------------------------ training
    def batches(self, epoch: int, skip: int):
        """This rank's micro batches of `epoch` (Accelerate's seedable sampler shards batch i to
        rank i % world), the first `skip` left out at the sampler, so nothing is collated twice."""
        self.train_loader.set_epoch(epoch)
        loader = self.accelerator.skip_first_batches(self.train_loader, skip) if skip else self.train_loader
        loader.set_epoch(epoch)   # the skipping loader is new: give it the epoch, or it reshuffles as epoch 0
        return iter(loader)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def _loader(self, dataset):
        """A prepared loader over another split (extra evaluations, test predictions, a data.mixture's sources),
        prepared once a split."""
        from torch.utils.data import DataLoader
        loaders = self._loaders
        if id(dataset) not in loaders:
            t = self.train_cfg
            kwargs = loader_kwargs(self.data_cfg, self.collate.evaluation_copy(), self.seed, pin=self.plan.pin_memory)
            kwargs["collate_fn"].epoch = 0
            loaders[id(dataset)] = (dataset, self.accelerator.prepare(
                DataLoader(Indexed(dataset), batch_size=t.eval_batch_size or t.micro_batch_size, **kwargs)))
        return loaders[id(dataset)][1]

    @torch.no_grad()
    def predict(self, dataset):
        """The model's prediction for every row of `dataset`, in order (labels are not used): class
        ids, or values for a regression."""
        preds = []
        self.model.eval()
        with eager_under_compile(self.train_cfg.compile):
            for batch in self._loader(dataset):
                batch.pop("labels", None)
                p = self.kind.predictions(self.task, self.model(**batch).logits)
                preds.append(self.accelerator.gather_for_metrics(p).cpu())
        self.model.train()
        return torch.cat(preds).numpy()

    @torch.no_grad()
    def evaluate(self, dataset=None) -> dict:
        """Every eval sample once: gather_for_metrics drops the duplicates that even batching adds
        to the last batch. -> rows for the task's metrics. dataset: another labelled split."""
        self.model.eval()
        parts = []
        with eager_under_compile(self.train_cfg.compile):
            for batch in (self.eval_loader if dataset is None else self._loader(dataset)):
                found = self.kind.eval_rows(self.task, self.model(**batch).logits, batch["labels"],
                                   batch.get("masked_positions"))
                gathered = self.accelerator.gather_for_metrics(tuple(found.values()))
                parts.append({key: value.cpu() for key, value in zip(found, gathered)})
        self.model.train()
        return joined_rows(parts)

    # ------------------------------------------------------------ state
    def save(self, path: str):
        """Model, optimizer and every rank's RNG (Accelerate), and the schedule as JSON: nothing in the
        checkpoint needs a pickle to load (Accelerate loads the rest with weights_only=True)."""
        if self.plan.kind == "deepspeed":   # a rank whose write failed still meets DeepSpeed's last barrier
            saved_meeting_the_barrier(lambda: self.accelerator.save_state(path))
        else:
            self.accelerator.save_state(path)
        if self.is_main:
            (Path(path) / "scheduler.json").write_text(json.dumps(self.scheduler.state_dict()))

    def load(self, path: str):
        if self.plan.kind == "deepspeed":   # saved by another process count: ZeRO's partitions re-cut
            with resharded(Path(path), self.num_processes, self.model, self.is_main, broadcast) as source:
                self.accelerator.load_state(str(source))
        else:   # DDP's state is whole; FSDP's shards are re-cut by torch's distributed checkpoint
            self.accelerator.load_state(str(path))
        # load_state restores Accelerate's micro-batch count, whose remainder by the accumulation places the sync:
        # a checkpoint is always at an optimizer step's end, and on another process count (another accumulation)
        # the saved count's remainder would sync mid-step (2 processes, accum 1, halted at step 7 -> 1 process,
        # accum 2: the first micro batch would sync)
        self.accelerator.step = 0
        schedule = Path(path) / "scheduler.json"
        if schedule.exists():
            self.scheduler.load_state_dict(json.loads(schedule.read_text()))
        else:   # a checkpoint from before scheduler.json: Accelerate's custom_checkpoint_0.pkl, plain data
            self.scheduler.load_state_dict(torch.load(Path(path) / "custom_checkpoint_0.pkl", weights_only=True))
        resume_schedule(self.scheduler)   # this run's schedule from the checkpoint's step (another length: optim.py)

    def start_from(self, path: str):
        carry_over(lambda: self.load(path), self.optimizer, self.scheduler, self.on_gpu)

    def export(self, out_dir: Path, tokenizer, config_yaml: str, card: str) -> Path:
        """The Hugging Face export (export.write_export) of the full fp32 weights, gathered on the main process
        (full_state_dict). Collective; no barrier after it: the caller agrees on the write (export.export_agreed)."""
        out = Path(out_dir)
        state_dict = full_state_dict(self.accelerator, self.model)
        if self.accelerator.is_main_process:
            with without_zero_init(self.accelerator):
                write_export(self.accelerator.unwrap_model(self.model, keep_torch_compile=False), out, tokenizer,
                             config_yaml, card, state_dict, save_function=self.accelerator.save)
        return out

    def final(self) -> dict:
        """Collective: every rank's peak memory (GPUs)."""
        a = self.accelerator
        return {"peak_memory_gb_per_rank": peak_memory_gb(all_sum, a.process_index, a.num_processes, a.device,
                                                          self.on_gpu),
                "distributed_type": str(a.distributed_type)}


def full_state_dict(accelerator, model) -> dict:
    """The full, consolidated fp32 weights on the main process. Every rank must call this: under
    sharded backends (ZeRO-3, FSDP) it is a collective that gathers the shards."""
    if accelerator.state.deepspeed_plugin is not None:
        state_dict = fp32_state_dict(accelerator, accelerator.unwrap_model(model, keep_torch_compile=False))
    else:
        state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:   # train.compile: the compiled wrapper prefixes every key with _orig_mod.
        state_dict = {k.removeprefix("_orig_mod."): v.float() if v.is_floating_point() else v
                      for k, v in state_dict.items()}
    return state_dict
