"""Pretrain (masked LM) or fine-tune (sequence classification) BERT with Hugging Face Accelerate.

    python train.py --recipe recipes/tiny-mlm.yaml [--section.key=value ...]
    accelerate launch --config_file accelerate_configs/<backend>.yaml train.py --recipe recipes/<name>.yaml

The recipe holds the maths (model, data, optimizer, schedule, batch sizes); the launch config
holds how it runs. One loop serves every backend: what differs between Accelerate (DDP, ZeRO,
FSDP) and the DeepSpeed pipeline sits behind the engine (bert_recipes/engine.py).

Reads top to bottom: config -> engine -> data -> model -> optimizer -> prepare -> resume (or a phase's start)
-> loop -> save.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # tokenizers threads + DataLoader forks deadlock

from bert_recipes.cli import check_command_line

if __name__ == "__main__":   # a mistake in the recipe or its overrides: one line now, not after torch loads (~5 s)
    check_command_line(sys.argv[1:])

import torch  # noqa: E402 (after the command line's check)

from bert_recipes.activations import Shape
from bert_recipes.backends.deepspeed import deepspeed_norm_and_skip, host_adam
from bert_recipes.backends.deepspeed_ops import settle_before_ranks_load
from bert_recipes.backends.pipeline import train_batch
from bert_recipes.backends.plan import launch_plan_here
from bert_recipes.backends.saved_weights import convert_once, load_saved_weights
from bert_recipes.batch_ramp import BatchPlan, batch_plan
from bert_recipes.checkpoint import (check_data_fits, check_tokenizer_fits, data_record, pick_checkpoint,
                                     read_train_state, save_checkpoint, tokenizer_record)
from bert_recipes.config import Config, flat_dict, optimizer_steps, schedule_warnings, to_dict, to_yaml
from bert_recipes.contrastive import accelerate_step
from bert_recipes.data.files import same_files_on_every_rank
from bert_recipes.data import data_progress_bars, prepare_data
from bert_recipes.divergence import StepGuard
from bert_recipes.downstream import export_for_downstream
from bert_recipes.doctor.nvml import start_sampler
from bert_recipes.engine import build_engine
from bert_recipes.exits import halted_line, leave, run_train
from bert_recipes.export import export_agreed, model_card, push_to_hub
from bert_recipes.interface import AccelerateStep, Engine
from bert_recipes.layout import resume_layout, run_layout, saved_layout
from bert_recipes.phases import init_line
from bert_recipes.logs import Trackers, plot_curves, write_metrics
from bert_recipes.mask_rate import MaskSchedule, mask_schedule
from bert_recipes.memory import describe_plan, predict_run
from bert_recipes.data.mixture import Mixture, source_mixture
from bert_recipes.models import build_model, check_sequence_length, count_parameters
from bert_recipes.optim import (build_optimizer, build_scheduler, describe_decay, schedule_change, skip_update_if,
                                total_norm)
from bert_recipes.preflight import preflight
from bert_recipes.ranks import all_sum, broadcast, on_any_rank, on_nodes, on_rank0, print0
from bert_recipes.results import (evaluate_sources, extra_evaluations, keep_best, restore_best, write_answer_files,
                                  write_predictions)
from bert_recipes.run_dir import check_shared_output_dir, holding_output_dir, start_writing
from bert_recipes.signals import INTERRUPTION, Preemption, StopAgreement
from bert_recipes.sync_audit import SyncAudit
from bert_recipes.tasks import TASKS, kind_of
from bert_recipes.throughput import (DataLoaderWatch, Throughput, mfu_terms, profile_table, rank_extremes,
                                     start_profiler, train_line)
from bert_recipes.trial import confirm_micro_batch


# ----------------------------------------------------------------------------- main
@dataclass
class Run:
    """What main builds and the loop and the final save share."""
    cfg: Config
    engine: Engine            # bert_recipes/interface.py: AccelerateEngine or PipelineEngine
    output_dir: Path
    config_yaml: str
    tokenizer: Any
    collate: Any
    eval_dataset_size: int
    steps_per_epoch: int
    total_steps: int
    stop_at: int              # total_steps, or train.halt_at_step
    stream: BatchPlan         # which micro batches each step takes: the batch's stages (bert_recipes/batch_ramp.py)
    masking: MaskSchedule     # the masking rate's levels over total_steps (one for fine-tuning)
    mixture: Mixture | None   # data.mixture: the sources' order and what each gave (bert_recipes/data/mixture.py)
    flops_per_token: float    # MFU's numerator per token
    peak_flops: float         # one device
    predicted_peak_gb: float  # the memory planner's (nan when not modelled)
    export_bytes: int         # the export's fp32 weights, for a full disk's line
    backend: dict             # engine.describe()
    baseline: float | None    # majority-class accuracy on the eval set
    data: Any                 # the tokenized splits: train, eval, eval:<split>, test:<split>
    test_index: dict          # each test split's example ids, for the predictions file
    trackers: Trackers        # logging.trackers, opened on rank 0 (bert_recipes/logs.py)
    state: dict = field(default_factory=lambda: {"step": 0, "history": {"train": [], "eval": []}})
    preemption: Preemption = field(default_factory=Preemption)
    stop_signal: int = 0           # the signal every rank agreed to stop on (0: none)
    guard: StepGuard | None = None
    audit: SyncAudit | None = None   # logging.sync_audit
    sampler: Any = None              # logging.gpu_sampler on GPUs (bert_recipes/doctor/nvml.Sampler)
    batch_shapes: set = field(default_factory=set)   # every (batch, length) this rank fed the model
    eval_rows: tuple | None = None   # (step, rows) of the last evaluation: a kind's answer files at the end


def main(cfg: Config) -> dict:
    """Train as the recipe says; return the final metrics (also written to metrics.json)."""
    from accelerate.utils import set_seed

    t_start = time.perf_counter()
    # The launch plan (accelerate YAML + DeepSpeed JSON) is read once. Everything a plain process can
    # check is checked first (the Make targets ran the same checks before launching): nothing is
    # written to output_dir until every check has passed, just before the loop.
    plan = launch_plan_here()   # with the device decided, once: plan.on_gpu
    auto_micro_batch = cfg.train.micro_batch_size == "auto"
    notes = preflight(cfg, plan, int(os.environ.get("WORLD_SIZE", "1")))
    output_dir = Path(cfg.run.output_dir)
    config_yaml = to_yaml(cfg)

    # -------------------------------------------------------------------- engine
    settle_before_ranks_load(plan)   # a DeepSpeed op build cut off earlier: one line, never a silent wait
    # Building the engine starts the process group and compares the recipe with the plan.
    engine = build_engine(plan, output_dir, train=cfg.train, data=cfg.data, optim=cfg.optim, task=cfg.task,
                          seed=cfg.run.seed)
    # one run at a time in output_dir: rank 0 holds it (run_dir.OutputDirLock) until the run ends, however it ends
    with holding_output_dir(output_dir, cfg.run.lock_wait_s, cfg.run.lock_stale_s, engine):
        if auto_micro_batch:   # each rank sized it from its own GPU: a trial step confirms it there, all ranks agree
            confirm_micro_batch(cfg, plan, engine)
        same_files_on_every_rank(cfg.data, engine.control)   # each node resolved data.train_files on its own disk
        set_seed(cfg.run.seed)
        print0(f"[setup] {plan.name}: {engine.setup_line}; collectives time out after "
               f"{cfg.train.collective_timeout_s:g}s (train.collective_timeout_s)")
        checkpoint, source, layout, data_used = starting_point(cfg, plan, engine, output_dir, notes)
        trackers = Trackers(cfg.logging.trackers, engine.is_main, output_dir / "logs")
        on_rank0(engine.is_main, broadcast, trackers.check)   # a store MLflow refuses, a server down: one line, now

        # -------------------------------------------------------------------- data
        INTERRUPTION.at("data preparation")
        check_sequence_length(cfg.model, cfg.task, cfg.data.max_seq_length)
        label_names = cfg.task.label_names
        data_progress_bars(cfg.logging.progress_bar)   # false: datasets' bars too, so a log file holds no bar
        tokenizer, data, collate, test_index = prepare_data(
            cfg.data, cfg.task, cfg.tokenizer, cfg.model.name_or_path, cfg.run.seed, output_dir, engine.is_main,
            engine.prep_barrier, engine.fixed_length, broadcast, on_nodes(engine.is_local_main, engine.num_processes))
        if cfg.task.label_names != label_names:   # text labels, sorted: now part of the run's config
            config_yaml = to_yaml(cfg)
            print0(f"[data] text labels, in sorted order: {dict(enumerate(cfg.task.label_names))} (set task.label_names "
                   "to choose the order)")
        print0(f"[data] {len(data['train'])} train / {len(data['eval'])} eval sequences, max "
               f"{cfg.data.max_seq_length} tokens, vocab {len(tokenizer)}")
        tokenizer_used = tokenizer_record(tokenizer, cfg.tokenizer.name_or_path or cfg.model.name_or_path)
        note = on_rank0(engine.is_main, broadcast,   # another tokenizer: one line on every rank, nothing written
                        lambda: check_tokenizer_fits(checkpoint or source, tokenizer_used, output_dir,
                                                     resumed=checkpoint is not None))
        if note:
            print0(note)

        # -------------------------------------------------------------------- model, optimizer, schedule
        INTERRUPTION.at("building the model")
        steps_per_epoch, total_steps, stream, masking = schedule(cfg, plan, engine, collate, len(data["train"]))
        mixture = source_mixture(cfg.data, data, cfg.run.seed, stream.epoch_batches * cfg.train.micro_batch_size)
        if mixture is not None:
            print0(mixture.line())
        module, optimizer, scheduler, model_config = build_training(cfg, plan, engine, tokenizer, total_steps, source)

        # -------------------------------------------------------------------- prepare
        engine.prepare(module, optimizer, scheduler, data, collate, mixture)
        backend, memory_plan, flops_token, peak = describe_run(cfg, plan, engine, model_config)
        baseline = kind_of(cfg.task.kind).baseline(cfg.task, data)
        run = Run(cfg=cfg, engine=engine, output_dir=output_dir, config_yaml=config_yaml, tokenizer=tokenizer,
                  collate=collate, eval_dataset_size=len(data["eval"]), steps_per_epoch=steps_per_epoch,
                  total_steps=total_steps, stop_at=min(total_steps, cfg.train.halt_at_step or total_steps),
                  stream=stream, masking=masking, mixture=mixture,
                  flops_per_token=flops_token, peak_flops=peak,
                  predicted_peak_gb=memory_plan.peak / 1e9 if memory_plan is not None else float("nan"),
                  export_bytes=4 * Shape.from_config(model_config, cfg.task.kind).params, backend=backend,
                  baseline=baseline, data=data, test_index=test_index,
                  trackers=trackers)

        # -------------------------------------------------------------------- resume
        INTERRUPTION.at("loading the checkpoint" if checkpoint is not None else "starting the output directory")
        if checkpoint is not None:
            resume(run, checkpoint)
        elif source is not None:   # checkpoint.init_from: a phase's first start (the weights alone: build_training)
            if cfg.checkpoint.init_optimizer:
                run.engine.start_from(source)
            print0(init_line(source, cfg.checkpoint.init_optimizer))
        run.state.update(layout=layout, total_steps=total_steps, tokenizer=tokenizer_used, data_files=data_used)
        start_writing(output_dir, config_yaml, tokenizer, cfg.run.overwrite, cfg.checkpoint.resume, engine, run.state,
                      resumed=checkpoint is not None)
        # a resume continues the tracker runs its checkpoint names (MLflow run, W&B run id); rank 0 saves them
        run.state["trackers"] = {**run.state.get("trackers", {}),
                                 **run.trackers.start(cfg.run.name, flat_dict(cfg), run.state.get("trackers"))}

        # -------------------------------------------------------------------- loop, save
        run.preemption.install()   # from here a SIGTERM / SIGUSR1 means: finish the step, save, exit
        try:
            train(run)
            return finish(run, time.perf_counter() - t_start)
        finally:   # after a stop signal the process is about to exit: later signals stay ignored
            run.preemption.uninstall(ignore_from_now=bool(run.stop_signal))


def starting_point(cfg: Config, plan, engine: Engine, output_dir: Path, notes: list[str]) -> tuple:
    """Where the run starts: the checkpoint checkpoint.resume names (None: step 0), which rank 0 picks and tells the
    others, or else the other run's checkpoint a phase starts from (checkpoint.init_from, resolved by preflight);
    and this run's layout over processes, saved with each checkpoint. Every rank must see output_dir
    (checkpoints are written into directories rank 0 creates); preflight's notes come first, then the resume's.
    Another process count re-cuts the saved state (a line) or is refused in one (layout.resume_layout); a data file
    changed since the checkpoint is one line too, unless checkpoint.accept_data_change (checkpoint.check_data_fits).
    -> (checkpoint or None, source or None, layout, the data files' record to save with each checkpoint)."""
    check_shared_output_dir(output_dir, engine)
    for note in notes:
        print0(note)
    checkpoint = pick_checkpoint(cfg.checkpoint.resume, output_dir, engine)
    source = Path(cfg.checkpoint.init_from) if checkpoint is None and cfg.checkpoint.init_from else None
    per_micro = TASKS[cfg.task.kind].sentence_embeddings and cfg.task.negatives == "micro"   # the loss's batch
    layout = run_layout(plan, cfg.train.micro_batch_size,
                        cfg.train.micro_batch_size * plan.replicas if per_micro else None)
    loaded, key = (checkpoint, "checkpoint.resume") if checkpoint is not None else (source, "checkpoint.init_from")
    changed = (resume_layout(saved_layout(loaded), layout, loaded, key, cfg.checkpoint.init_optimizer)
               if loaded is not None else None)
    if changed:
        print0(changed)
    data_used = on_rank0(engine.is_main, broadcast, lambda: data_record(cfg.data))   # sampled blocks, read by rank 0
    for note in on_rank0(engine.is_main, broadcast,   # a file rewritten since the checkpoint: one line, nothing written
                         lambda: check_data_fits(checkpoint, data_used, cfg.checkpoint.accept_data_change)):
        print0(note)
    return checkpoint, source, layout, data_used


def resume(run: Run, checkpoint) -> None:
    """The checkpoint's weights, optimizer, schedule and RNG (engine.load) and the loop's state; a run of another
    length follows its own schedule from the checkpoint's step on (a line)."""
    run.engine.load(checkpoint)
    run.state = read_train_state(checkpoint)
    print0(f"[resume] from {checkpoint} at step {run.state['step']}")
    lengthened = schedule_change(run.cfg.optim, run.state["step"], run.state.get("total_steps", run.total_steps),
                                 run.total_steps)
    if lengthened:
        print0(lengthened)


def build_training(cfg: Config, plan, engine: Engine, tokenizer, total_steps: int, source: Path | None):
    """The model (this rank's stage under the pipeline), its optimizer and the schedule over
    `total_steps`; a phase that takes the weights alone (checkpoint.init_from without init_optimizer) reads them
    whole from its `source` checkpoint, whichever backend saved it, before this run's backend lays them out.
    -> (module, optimizer, scheduler, the model's config)."""
    model = build_model(cfg.model, cfg.task, tokenizer, packed_dropout=plan.packed_dropout,
                        attention_path=plan.attention_path)
    if source is not None and not cfg.checkpoint.init_optimizer:
        on_rank0(engine.is_main, broadcast, lambda: convert_once(source))
        load_saved_weights(model, source, cfg.task.kind)
    model_config = model.config
    print0(f"[model] {type(model).__name__}: {count_parameters(model) / 1e6:.2f}M parameters")
    if getattr(model, "loading_report", None):
        print0(model.loading_report)
    module = engine.wrap(model)   # the pipeline cuts it into stages; Accelerate keeps it whole
    optimizer = build_optimizer(module, cfg.optim, host_adam=host_adam(plan, cfg.optim))   # ZeRO offload: DeepSpeed's
    return module, optimizer, build_scheduler(optimizer, cfg.optim, total_steps), model_config


def schedule(cfg: Config, plan, engine: Engine, collate, train_sequences: int) -> tuple:
    """The run's length and the [schedule] lines: the optimizer steps and the lr, a batch that grows
    (train.global_batch_size_start: its stages), the masking rate's levels (data.mlm_probability_end,
    data.eval_mlm_probability), and what looks unintended. The MLM collator follows the levels from here, before
    prepare, so evaluation's copy masks at evaluation's rate. -> (full-size steps an epoch, total steps, the batch
    stages, the masking levels)."""
    steps_per_epoch, total_steps = optimizer_steps(cfg.train, train_sequences, engine.replicas, engine.accum)
    stream = batch_plan(cfg.train, cfg.data.max_seq_length, train_sequences, total_steps)   # a ramp: more steps
    total_steps = stream.total_steps
    print0(f"[schedule] {total_steps} optimizer steps ({steps_per_epoch} per epoch of "
           f"{cfg.train.global_batch_size}-sequence steps), peak lr {cfg.optim.lr}, "
           f"{describe_decay(cfg.optim, total_steps)}")
    masking = mask_schedule(cfg.data, cfg.task.kind, cfg.train.compile, total_steps)
    collate.follow(masking)
    lines = [stream.line(cfg.data.max_seq_length, engine.replicas), masking.line()]
    for line in [*lines, *schedule_warnings(cfg, total_steps, slots=not plan.pipeline)]:
        if line:
            print0(line)
    return steps_per_epoch, total_steps, stream, masking


def describe_run(cfg: Config, plan, engine: Engine, model_config):
    """The [backend], [memory] and [mfu] lines: what engaged, the planner's prediction, MFU's terms.
    -> (engine.describe(), the memory plan or None, FLOPs per token, one device's peak FLOP/s)."""
    backend = engine.describe()
    print0("[backend] " + ", ".join(f"{k}={v}" for k, v in backend.items()))
    memory_plan = predict_run(cfg, model_config, plan, engine.num_processes, engine.device.type, engine.accum)
    if memory_plan is not None:
        print0(f"[memory] predicted per device ({plan.name}; all backends: make memory): " + describe_plan(memory_plan))
    flops_token, peak, line = mfu_terms(model_config, cfg.data, cfg.model, cfg.task.kind, cfg.train, engine.device,
                                        plan.pipeline)
    print0(line)
    return backend, memory_plan, flops_token, peak


# ----------------------------------------------------------------------------- the step
def train_step(run: Run, batches) -> tuple:
    """One optimizer step: `accum` micro batches, clip, step, schedule, in Accelerate's idiom. A step whose loss
    (on any rank) or gradient norm is not finite updates nothing, decided on the device (optim.skip_update_if).
    Each branch reads its engine's contract (bert_recipes/interface.py): PipelineStep, AccelerateStep.
    -> (mean loss, grad norm, skipped, fp16 overflow): device tensors the host has not waited for (DeepSpeed and
    the pipeline decide their skips on the host, inside their own steps)."""
    engine = run.engine
    if engine.plan.pipeline:   # DeepSpeed's pipeline engine runs the micro batches, clips, steps and schedules
        return train_batch(engine.engine, batches)
    step: AccelerateStep = engine
    a, model, optimizer = step.accelerator, step.model, step.optimizer
    task = run.cfg.task
    if TASKS[task.kind].sentence_embeddings:   # the loss over the whole global batch's texts (GradCache)
        loss = accelerate_step(step, batches, 1.0 / task.temperature, task.negatives).float()
    else:
        losses = []
        for _ in range(step.accum):
            with a.accumulate(model):   # syncs gradients on the last micro batch only
                loss = model(**next(batches)).loss
                a.backward(loss)        # DeepSpeed clips and steps inside, on the last micro batch
            losses.append(loss.detach())
        loss = torch.stack(losses).float().mean()
    assert a.sync_gradients, "the loop and Accelerate disagree on the accumulation boundary"
    if step.plan.deepspeed:   # DeepSpeed clipped and stepped, or skipped a non-finite step (its overflow check)
        grad_norm, skipped = deepspeed_norm_and_skip(a, model)
        if not skipped:         # as DeepSpeed's own schedules (and the Trainer) do
            step.scheduler.step()
        return loss, grad_norm, skipped, False
    max_norm = run.cfg.optim.max_grad_norm or float("inf")   # inf: measure the norm, never clip
    grad_norm = total_norm(a.clip_grad_norm_(model.parameters(), max_norm))   # fp16: unscales first
    loss_bad = on_any_rank(~torch.isfinite(loss))
    skipped = loss_bad | ~torch.isfinite(grad_norm)   # the norm is global: the same on every rank
    if skip_update_if(optimizer, a.scaler, skipped):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # The schedule advances every step, applied or skipped: the host does not know which (the lr of
    # step n is the schedule's, whatever earlier steps did; a skipped step's lr goes unused).
    step.scheduler.step()
    return loss, grad_norm, skipped, (skipped & ~loss_bad) if a.scaler is not None else False


# ----------------------------------------------------------------------------- the loop
def train(run: Run) -> None:
    """Optimizer steps until run.stop_at, the same for every engine: each step takes exactly
    `accum` micro batches of this rank; an epoch is steps_per_epoch steps, and a resumed epoch
    skips the micro batches its finished steps took (run.stream: which micro batches a step takes is a function of
    the step, batch ramp or not). A batch stage or a masking level starts a new iterator at its first step,
    skipping as a resume does. Between log steps nothing here reads the
    device: losses, counts and the skip decisions stay tensors, and the stop agreement runs in the
    background (logging.sync_audit counts what still waits; tests/test_speed.py asserts none)."""
    from tqdm.auto import tqdm
    cfg, engine, state = run.cfg, run.engine, run.state
    meter = Throughput(engine.counts_data, cfg.logging.step_times, engine.on_gpu, run.batch_shapes)
    watch = DataLoaderWatch(cfg.logging.dataloader_warn_share)
    profiler = start_profiler(run.output_dir, engine.on_gpu, print0) if cfg.logging.profile else None
    bar = tqdm(total=run.total_steps, initial=state["step"], desc="train", dynamic_ncols=True,
               disable=not (engine.is_local_main and cfg.logging.progress_bar))
    run.guard = StepGuard(cfg.train.max_bad_steps, state.get("skipped_steps", 0))
    agreement = StopAgreement(engine.control)
    audit = run.audit = SyncAudit(engine.on_gpu) if cfg.logging.sync_audit else None
    if engine.on_gpu and cfg.logging.gpu_sampler:   # NVML in a thread: no host wait in the step
        run.sampler, note = start_sampler(engine.device)
        if note:
            print0(note)
    if engine.on_gpu:   # peak memory of training, not of loading and preparing
        torch.cuda.reset_peak_memory_stats()
    while state["step"] < run.stop_at and not run.stop_signal:
        epoch, taken = run.stream.where(state["step"])   # global micro batches of this epoch before this step
        batch, next_stage = run.stream.at(state["step"])   # a batch ramp's stage: the accumulation follows
        if batch // (cfg.train.micro_batch_size * engine.replicas) != engine.accum:
            engine.set_batch(batch)
        run.collate.epoch = epoch   # MLM masks are a function of (seed, epoch, example)
        run.collate.level, next_level = run.masking.at(state["step"])   # and of the masking rate's level
        batches = meter.feed(engine.batches(epoch, skip=taken // engine.replicas))
        steps = (run.stream.epoch_batches - taken) // (batch // cfg.train.micro_batch_size)
        for end in (next_stage, next_level):   # a stage or level ends before the epoch: the next starts its iterator
            if end is not None:
                steps = min(steps, end - state["step"])
        for _ in range(steps):
            with audit or contextlib.nullcontext():
                loss, grad_norm, skipped, overflow = train_step(run, batches)
                run.guard.add(state["step"] + 1, loss, grad_norm, skipped, overflow)
                meter.add_step(loss)
                # a stop signal any rank got, agreed one or two steps later without waiting (signals.StopAgreement)
                run.stop_signal = agreement.after_step(run.preemption.received)
            state["step"] += 1
            bar.update(1)
            if profiler is not None:
                profiler.step()
            step = state["step"]
            if step % cfg.logging.log_every == 0 or step == run.total_steps:
                check_guard(run)
                row = log_step(run, meter.read(all_sum, engine.device), grad_norm, watch)
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            t_aside = time.perf_counter()
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < run.total_steps \
                    and not run.stop_signal:   # a stop signal: the save comes first, within the grace period
                run_eval(run)
            if (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < run.stop_at
                    and not run.stop_signal):   # (the halt and the end save in finish)
                checkpoint_now(run)
            meter.exclude(time.perf_counter() - t_aside)   # eval and checkpoints are not training time
            if step >= run.stop_at or run.stop_signal:
                break
    agreement.close()
    if run.sampler is not None:
        run.sampler.stop()
    bar.close()
    if profiler is not None:
        profiler.stop()
        print0(profile_table(profiler, run.output_dir, engine.on_gpu))


def check_guard(run: Run) -> None:
    """Read the non-finite-step counters (a log, eval or checkpoint step: divergence.StepGuard); raises
    Diverged after train.max_bad_steps in a row."""
    note = run.guard.check(run.state["step"], run.engine.lr())
    run.state["skipped_steps"] = run.guard.skipped_total
    if note:
        print0(note)


def log_step(run: Run, row: dict, grad_norm, watch: DataLoaderWatch) -> dict:
    """One log line, tracker point and history row: loss, lr, grad norm, throughput, MFU, data wait."""
    engine, step = run.engine, run.state["step"]
    row = {"step": step, "epoch": round(run.stream.position(step) / run.stream.epoch_batches, 3), **row, "lr": engine.lr(),
           "grad_norm": float("nan") if grad_norm is None else float(grad_norm)}
    # MFU over every device (a pipeline's bubbles count against it)
    row["mfu"] = run.flops_per_token * row["padded_tokens_per_sec"] / (run.peak_flops * engine.num_processes)
    if len(run.stream.stages) > 1:   # train.global_batch_size_start: the global batch of the window's last step
        row["global_batch_size"] = run.stream.at(step - 1)[0]
    if len(run.masking.levels) > 1:   # data.mlm_probability_end: the rate the window's last step masked at
        row["mlm_probability"] = run.masking.rate(step - 1)
    if run.audit is not None:   # logging.sync_audit: host waits in this window's steps
        row["host_syncs"] = run.audit.read_window()
        if engine.on_gpu:       # torch's sync debug mode, on in the steps
            row["sync_warnings"] = run.audit.read_warnings()
    # the worst rank's data wait and, on GPUs, the allocator's peak since the loop began and the sampler's window:
    # the largest over the ranks, in one small all-reduce, at log steps only
    row.update(rank_extremes(row.pop("local_data_wait_share"), run.sampler.window() if run.sampler else None,
                             torch.cuda.max_memory_allocated() / 1e9 if engine.on_gpu else None, engine.control))
    _, warning = watch.verdict(row["data_wait_worst"], row["window_steps"], row["window_s"], row.get("gpu_busy_least_rank"))
    if warning:
        print0(warning)
    run.state["tokens_seen"] = run.state.get("tokens_seen", 0) + int(row["window_tokens"])
    run.state["history"]["train"].append(row)
    run.trackers.log({f"train/{k}": v for k, v in row.items() if k != "step"} | sources_seen(run, step), step)
    print0(train_line(row, run.total_steps, run.predicted_peak_gb if engine.on_gpu else None,
                      run.cfg.logging.dataloader_warn_share))
    return row


def sources_seen(run: Run, step: int) -> dict:
    """data.mixture at a log step: a line for each source that started a pass in the log_every steps up to `step` (a
    function of the step: a resumed run prints the same), and the tokens each source gave so far, for the trackers."""
    if run.mixture is None:
        return {}
    micro, every = run.cfg.train.micro_batch_size, run.cfg.logging.log_every
    begin, end = (run.stream.position((step - 1) // every * every) * micro, run.stream.position(step) * micro)
    for name, number, position in run.mixture.pass_starts(begin, end):
        print0(f"[data] source {name} ran out: its pass {number + 1} starts at step "
               f"{run.stream.steps_for(position // micro + 1)} (data.mixture)")
    return {f"train/tokens/{name}": seen["tokens"] for name, seen in run.mixture.seen(end).items()}


def run_eval(run: Run) -> dict:
    """Evaluate now (data.mixture: each source, and all together); keep the state apart when
    checkpoint.metric_for_best improved."""
    engine, task = run.engine, run.cfg.task
    if run.mixture:
        found = evaluate_sources(task, engine, run.data, run.mixture)
    else:
        rows = engine.evaluate()
        found = kind_of(task.kind).metrics(task, rows, run.data["eval"])
        run.eval_rows = (run.state["step"], rows)   # the last evaluation's, for the answer files at the end
    metrics = {"step": run.state["step"], **found}
    run.state["history"]["eval"].append(metrics)
    run.trackers.log({f"eval/{k}": v for k, v in metrics.items() if k != "step"}, metrics["step"])
    shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    baseline = f" (majority baseline accuracy {run.baseline:.4f})" if run.baseline is not None else ""
    print0(f"[eval] {shown}{baseline}")
    if run.guard is not None:
        check_guard(run)
    if not (run.guard is not None and run.guard.streak):   # a diverging state is never the best
        keep_best(run.cfg.checkpoint, run.engine, run.state, metrics, run.output_dir, run.config_yaml)
    return metrics


def checkpoint_now(run: Run) -> bool:
    """A checkpoint at this step, unless the last step was not finite: a diverging state never
    replaces the last good checkpoint."""
    engine = run.engine
    if run.guard is not None:
        check_guard(run)
    if run.guard is not None and run.guard.streak:
        print0(f"[checkpoint] not saved at step {run.state['step']}: the last {run.guard.streak} steps were "
                      "not finite; the previous checkpoint stays the latest")
        return False
    save_checkpoint(run.output_dir, run.state["step"], run.state, run.config_yaml, run.cfg.checkpoint.keep_last, engine)
    if run.cfg.checkpoint.downstream:   # this step's model, kept from the rotation for its downstream score
        export_for_downstream(engine, run.output_dir, run.state["step"], run.tokenizer, run.config_yaml,
                              run.export_bytes, run.cfg.run.name)
    return True


# ----------------------------------------------------------------------------- save
def finish(run: Run, wall_time_s: float) -> dict:
    """Halted: a checkpoint to resume from. Done: the last evaluation, a checkpoint, the export,
    metrics.json, curves.png and the summary lines."""
    cfg, engine, state = run.cfg, run.engine, run.state
    if state["step"] < run.total_steps:   # halted or preempted: save and leave the rest to --resume auto
        halted, line = halted_line(run.stop_signal, state["step"], run.total_steps, checkpoint_now(run), run.output_dir)
        print0(line)
        if engine.is_main:
            write_metrics(run.output_dir / "metrics.json", halted, state["history"], {"config": flat_dict(cfg)})
        run.trackers.finish()
        engine.finish()
        return halted
    evals = state["history"]["eval"]
    if evals and evals[-1]["step"] == state["step"]:
        final = evals[-1]
    else:   # train.eval_final=false (benchmarks): no evaluation at the end
        final = run_eval(run) if cfg.train.eval_final else {"step": state["step"]}
    if cfg.checkpoint.save_final:
        checkpoint_now(run)
    final = restore_best(engine, state, run.output_dir) or final    # checkpoint.metric_for_best
    final = {**final, **extra_evaluations(cfg.task, engine, run.data)}   # data.extra_eval_splits
    write_predictions(cfg.task, engine, run.data, run.test_index, run.output_dir)   # data.test_splits
    if cfg.train.eval_final:   # SQuAD's predictions.json: from this run's last evaluation when it is the final one
        last = run.eval_rows if run.eval_rows and run.eval_rows[0] == final.get("step") == state["step"] else None
        write_answer_files(cfg.task, engine, run.data["eval"], last and last[1], run.output_dir)
    train_rows = state["history"]["train"]
    predicted = run.predicted_peak_gb
    final = {**final, "steps": state["step"],
             "first_train_loss": train_rows[0]["loss"] if train_rows else None,
             "last_train_loss": train_rows[-1]["loss"] if train_rows else None,
             "wall_time_s": wall_time_s, "num_processes": engine.num_processes,
             "eval_dataset_size": run.eval_dataset_size,
             "predicted_peak_memory_gb": None if predicted != predicted else predicted,
             "skipped_steps": state.get("skipped_steps", 0), "batch_shapes": len(run.batch_shapes),
             **engine.final(), "backend": run.backend}
    if run.audit is not None:
        final["sync_audit"] = dict(run.audit.sites)
    if run.mixture is not None:   # what each source gave: sequences, tokens, share beside its target
        final["mixture"] = run.mixture.seen(run.stream.position(state["step"]) * cfg.train.micro_batch_size)
    if run.baseline is not None:
        final["majority_baseline_accuracy"] = run.baseline
    if cfg.checkpoint.export:
        card = model_card(to_dict(cfg), final, run.backend, state.get("tokens_seen", 0))
        export_dir = export_agreed(engine, run.output_dir / "model", run.tokenizer, run.config_yaml, card,
                                   state["step"], run.export_bytes)
        print0(f"[export] Hugging Face model (fp32) + tokenizer + model card -> {export_dir}")
        if cfg.checkpoint.push_to_hub and engine.is_main:
            push_to_hub(cfg.checkpoint, cfg.run.name, export_dir)
    if engine.is_main:
        write_metrics(run.output_dir / "metrics.json", final, state["history"], {"config": flat_dict(cfg)})
        if cfg.logging.plot:
            plot_curves(run.output_dir / "curves.png", state["history"], f"{cfg.run.name} ({cfg.task.kind}, {engine.name})")
    if final.get("peak_memory_gb_per_rank"):
        print0("[memory] peak allocated per GPU (torch.cuda.max_memory_allocated): "
               + ", ".join(f"{gb:.2f} GB" for gb in final["peak_memory_gb_per_rank"]) + f"; predicted {predicted:.2f} GB")
    print0(f"[done] {state['step']} steps in {wall_time_s:.0f}s; metrics.json, curves.png and "
           f"TensorBoard logs in {run.output_dir}")
    run.trackers.finish()
    engine.finish()
    return final


def run_cli(argv: list[str] | None = None) -> int:
    """train.py's command line: main, and its exit codes with their one-line messages (exits.run_train)."""
    return run_train(argv, main)


if __name__ == "__main__":
    leave(run_cli())   # without tearing gloo down (exits.leave)
