"""Engines: what differs between running the recipe through Accelerate (DDP, ZeRO-1/2/3 with
offload, FSDP2) and through DeepSpeed's pipeline engine, behind one small interface. train.py's
loop names no backend; it calls, in order:

    engine.wrap(model) -> module               what the optimizer sees (the pipeline: this rank's stage)
    engine.prepare(module, optimizer, scheduler, data, collate)
    engine.describe() -> dict                  what really runs (backend, stages, sharding)
    engine.load(checkpoint_dir)                on resume
    engine.batches(epoch, skip) -> iterator    this rank's micro batches of one epoch
    engine.train_step(batches) -> (loss, grad_norm)
                                               one optimizer step: `accum` micro batches, clipping,
                                               the update and the schedule
    engine.evaluate() -> rows                  per-sample rows of every rank (metrics.eval_metrics)
    engine.save(dir)                           inside bert_recipes.checkpoint.save_checkpoint
    engine.export(dir, tokenizer, config_yaml) a Hugging Face model with full weights
    engine.final() -> dict                     end-of-run facts (rank checksums, peak memory, ranks)

plus the communication helpers every loop needs (barrier, broadcast, all_sum) and the rank-0
output (print0, log). The pipeline engine lives in bert_recipes/pipeline.py.
"""
from __future__ import annotations

import contextlib
import copy
import json
import shutil
from pathlib import Path

import torch

from .backend import (LaunchPlan, build_accelerator, check_nvme_gradient_swap, deepspeed_owned, describe,
                      optimizer_in_effect, rank_checksums, set_tf32, zero3_keeps_model_dtype)
from .checkpoint import export_model
from .config import Config
from .data import Indexed, LengthGroupedBatches, loader_kwargs
from .guard import control_group, slow_barrier, update_is_finite
from .modeling import per_sample_mlm_loss
from .perf import peak_memory_gb


def build_engine(cfg: Config, plan: LaunchPlan, output_dir: Path):
    """The pipeline engine when the DeepSpeed JSON has a `pipeline` section (Accelerate has no
    pipeline parallelism for training); Accelerate for everything else."""
    if plan.pipeline:
        from .pipeline import PipelineEngine
        return PipelineEngine(cfg, plan, output_dir)
    return AccelerateEngine(cfg, plan, output_dir)


class AccelerateEngine:
    """DDP, ZeRO-1/2/3 (+ CPU/NVMe offload) and FSDP2: whichever the launch config names.
    Creating it starts the process group and checks the recipe against the launch config."""

    counts_data = True       # every rank reads its own batches
    fixed_length = None      # dynamic padding

    def __init__(self, cfg: Config, plan: LaunchPlan, output_dir: Path):
        self.cfg, self.plan, self.name = cfg, plan, plan.name
        self.accelerator, self.accum, self.on_gpu = build_accelerator(cfg, plan, output_dir)
        set_tf32(cfg.train.tf32, self.on_gpu)
        a = self.accelerator
        self.control = control_group(cfg.train.collective_timeout_s)
        self.prep_barrier = slow_barrier(self.control, cfg.data.prepare_timeout_s, "rank 0's data preparation")
        self.is_main, self.is_local_main = a.is_main_process, a.is_local_main_process
        self.num_processes = self.replicas = a.num_processes
        self.device = a.device
        self.setup_line = (f"{a.distributed_type} x{a.num_processes} on {a.device}, precision={a.mixed_precision}; "
                           f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x "
                           f"accum {self.accum} x world {a.num_processes}")

    # ------------------------------------------------------------ communication and output
    def print0(self, *args):
        if self.is_main:   # global rank 0 (Accelerate's own print is per node)
            print(*args, flush=True)

    def barrier(self):
        self.accelerator.wait_for_everyone()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        from accelerate.utils import broadcast_object_list
        return broadcast_object_list([obj])[0]

    def all_sum(self, tensor):
        return self.accelerator.reduce(tensor, reduction="sum")

    def start_trackers(self, run_name: str, config: dict):
        self.accelerator.init_trackers(run_name, config=config)

    def log(self, values: dict, step: int):
        self.accelerator.log(values, step=step)

    def finish(self):
        if self.accelerator.swap_dirs:   # ZeRO NVMe offload: once every rank is done with its swap files,
            self.barrier()                  # one rank a node (an NVMe is node-local) clears them
            if self.is_local_main:
                for path in self.accelerator.swap_dirs:
                    shutil.rmtree(path, ignore_errors=True)
        self.accelerator.end_training()

    # ------------------------------------------------------------ setup
    def wrap(self, model):
        self.full_param_numel = sum(p.numel() for p in model.parameters())
        return model

    def prepare(self, module, optimizer, scheduler, data, collate):
        from torch.utils.data import DataLoader
        t = self.cfg.train
        if not self.on_gpu:   # lengths rounded up to a multiple of 8 feed tensor cores; on a CPU it is only padding
            collate.pad_to_multiple_of = None
        kwargs = loader_kwargs(self.cfg.data, collate, self.cfg.run.seed, pin=self.on_gpu)
        if self.cfg.data.group_by_length:   # batches of similar length (data.LengthGroupedBatches)
            lengths = [len(ids) for ids in data["train"]["input_ids"]]
            batches = LengthGroupedBatches(lengths, t.micro_batch_size, self.cfg.run.seed,
                                           step_batches=t.global_batch_size // t.micro_batch_size)
            train_loader = DataLoader(Indexed(data["train"]), batch_sampler=batches, **kwargs)
        else:
            train_loader = DataLoader(Indexed(data["train"]), batch_size=t.micro_batch_size, shuffle=True,
                                      drop_last=True, **kwargs)
        eval_loader = DataLoader(Indexed(data["eval"]), batch_size=t.eval_batch_size or t.micro_batch_size,
                                 **{**kwargs, "collate_fn": copy.copy(collate)})   # masks of epoch 0, always
        # The schedule wraps the torch optimizer itself, before prepare: ZeRO keeps that optimizer
        # (and its param_groups) inside its own. A DeepSpeed JSON may own both instead.
        check_nvme_gradient_swap(self.plan, module, self.num_processes, self.on_gpu)
        optimizer, scheduler, owned = deepspeed_owned(self.accelerator, self.cfg, module, optimizer, scheduler)
        if owned:
            self.print0(owned)
        with zero3_keeps_model_dtype() if self.plan.zero_stage == 3 else contextlib.nullcontext():
            if owned:
                self.model, self.optimizer, scheduler, self.train_loader, self.eval_loader = self.accelerator.prepare(
                    module, optimizer, scheduler, train_loader, eval_loader)
            else:
                self.model, self.optimizer, self.train_loader, self.eval_loader = self.accelerator.prepare(
                    module, optimizer, train_loader, eval_loader)
        self.print0(optimizer_in_effect(self.optimizer))
        expected = len(data["train"]) // t.micro_batch_size // self.num_processes   # config.optimizer_steps' count
        assert len(self.train_loader) == expected, (len(self.train_loader), expected)
        self.scheduler, self.collate = scheduler, collate   # its state goes to scheduler.json (see save)
        self.max_grad_norm = self.cfg.optim.max_grad_norm or float("inf")   # inf: measure the norm, never clip
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

    def train_step(self, batches):
        """`accum` micro batches, then clip, step and schedule, unless the step is not finite.
        -> (mean loss tensor, grad norm, whether the update was applied: the same on every rank)."""
        a, losses = self.accelerator, []
        for _ in range(self.accum):
            batch = next(batches)
            with a.accumulate(self.model):   # syncs gradients on the last micro batch only
                loss = self.model(**batch).loss
                a.backward(loss)             # DeepSpeed steps inside, on the last micro batch
            losses.append(loss.detach())
        assert a.sync_gradients, "the loop and Accelerate disagree on the accumulation boundary"
        loss = torch.stack(losses).float().mean()
        grad_norm = a.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)   # fp16: unscales first
        if self.plan.deepspeed:   # DeepSpeed skipped a non-finite step itself (its overflow check)
            applied = not a.optimizer_step_was_skipped
        else:
            # One small all-reduce: every rank's loss and the (global) norm. A step that is not finite
            # is not taken; under fp16 the loss scaler still records it (update() after unscale_),
            # lowering its scale exactly when it found an overflow.
            applied = update_is_finite(loss, grad_norm, self.control)
            if applied:
                self.optimizer.step()
            elif a.scaler is not None:
                a.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        if applied:
            self.scheduler.step()
        return loss, grad_norm, applied

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def _loader(self, dataset):
        """A prepared loader over another split (extra evaluations, test predictions)."""
        from torch.utils.data import DataLoader
        t = self.cfg.train
        kwargs = loader_kwargs(self.cfg.data, copy.copy(self.collate), self.cfg.run.seed, pin=self.on_gpu)
        kwargs["collate_fn"].epoch = 0
        return self.accelerator.prepare(DataLoader(Indexed(dataset), batch_size=t.eval_batch_size or t.micro_batch_size,
                                                   **kwargs))

    @torch.no_grad()
    def predict(self, dataset):
        """The model's prediction for every row of `dataset`, in order (labels are not used): class
        ids, or values for a regression."""
        preds = []
        self.model.eval()
        for batch in self._loader(dataset):
            batch.pop("labels", None)
            logits = self.model(**batch).logits
            p = logits.squeeze(-1).float() if self.cfg.task.num_labels == 1 else logits.argmax(-1)
            preds.append(self.accelerator.gather_for_metrics(p).cpu())
        self.model.train()
        return torch.cat(preds).numpy()

    @torch.no_grad()
    def evaluate(self, dataset=None) -> dict:
        """Every eval sample once: gather_for_metrics drops the duplicates that even batching adds
        to the last batch. -> rows for metrics.eval_metrics. dataset: another labelled split."""
        a, task = self.accelerator, self.cfg.task
        self.model.eval()
        rows: dict[str, list] = {}
        for batch in (self.eval_loader if dataset is None else self._loader(dataset)):
            logits, labels = self.model(**batch).logits, batch["labels"]
            if "masked_positions" in batch:   # the static head's logits: one row per position slot
                labels = labels.gather(1, batch["masked_positions"])
            if task.kind == "mlm":
                sums, counts, correct = per_sample_mlm_loss(logits, labels)
                found = {"loss_sums": sums, "token_counts": counts, "correct": correct}
            else:
                preds = logits.squeeze(-1).float() if task.num_labels == 1 else logits.argmax(-1)
                found = {"preds": preds, "refs": labels}
            gathered = a.gather_for_metrics(tuple(found.values()))
            for key, value in zip(found, gathered):
                rows.setdefault(key, []).append(value.cpu())
        self.model.train()
        return {k: torch.cat(v).double().numpy() if k == "loss_sums" else torch.cat(v).numpy()
                for k, v in rows.items()}

    # ------------------------------------------------------------ state
    def save(self, path: str):
        """Model, optimizer and every rank's RNG (Accelerate), and the schedule as JSON: nothing in the
        checkpoint needs a pickle to load (Accelerate loads the rest with weights_only=True)."""
        self.accelerator.save_state(path)
        if self.is_main:
            (Path(path) / "scheduler.json").write_text(json.dumps(self.scheduler.state_dict()))

    def load(self, path: str):
        self.accelerator.load_state(str(path))
        schedule = Path(path) / "scheduler.json"
        if schedule.exists():
            self.scheduler.load_state_dict(json.loads(schedule.read_text()))
        else:   # a checkpoint from before scheduler.json: Accelerate's custom_checkpoint_0.pkl, plain data
            self.scheduler.load_state_dict(torch.load(Path(path) / "custom_checkpoint_0.pkl", weights_only=True))

    def export(self, out_dir: Path, tokenizer, config_yaml: str, card: str) -> Path:
        return export_model(self.accelerator, self.model, tokenizer, out_dir, config_yaml, card)

    def final(self) -> dict:
        """Collective: every rank's peak memory (GPUs) and full-weight checksum."""
        a = self.accelerator
        return {"peak_memory_gb_per_rank": peak_memory_gb(self.all_sum, a.process_index, a.num_processes, a.device,
                                                          self.on_gpu),
                "rank_checksums": rank_checksums(a, self.model),
                "distributed_type": str(a.distributed_type)}
