"""Pretrain (masked LM) or fine-tune (sequence classification) BERT with Hugging Face Accelerate.

    python train.py --recipe recipes/tiny-mlm.yaml [--section.key=value ...]
    accelerate launch --config_file accelerate_configs/<backend>.yaml train.py --recipe recipes/<name>.yaml

The recipe holds the maths (model, data, optimizer, schedule, batch sizes); the launch config
holds how it runs. The loop below names no backend.

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> prepare -> resume
-> loop -> save.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # tokenizers threads + DataLoader forks deadlock

import torch
import torch.nn.functional as F

from bert_recipes.backend import (check_consistency, check_engaged, describe, fill_deepspeed_autos, rank_checksums,
                                  read_launch_plan)
from bert_recipes.checkpoint import export_model, load_checkpoint, resolve_resume, save_checkpoint
from bert_recipes.config import Config, ConfigError, grad_accum_steps, flat_dict, load_config, to_yaml, validate
from bert_recipes.data import ClassificationCollator, Indexed, MLMCollator, get_tokenizer, load_raw, tokenize
from bert_recipes.logs import Throughput, plot_curves, write_metrics
from bert_recipes.memory import backend_name, describe_plan, predict_run
from bert_recipes.metrics import compute_metrics, default_metrics, majority_baseline
from bert_recipes.modeling import build_model, count_parameters
from bert_recipes.optim import build_optimizer, build_scheduler
from bert_recipes.perf import (DataLoaderWatch, flops_per_token, peak_flops, peak_memory_gb, profile_table,
                               start_profiler)


# ----------------------------------------------------------------------------- accelerator
def build_accelerator(cfg: Config, output_dir: Path):
    """The Accelerator, with the settings the recipe owns (precision, accumulation, trackers).
    The backend itself (DDP, DeepSpeed, FSDP) comes from the launch config."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration

    # The launcher sets WORLD_SIZE before Python starts, so the accumulation is known up front,
    # and recipe / accelerate YAML / DeepSpeed JSON are compared before any heavy work.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    accum = grad_accum_steps(cfg.train, world_size)
    plan = read_launch_plan()
    check_consistency(cfg, plan, world_size, accum, torch.cuda.is_available())
    handlers = []
    if world_size > 1 and not torch.cuda.is_available():
        # Without this, Accelerate leaves the backend unset for DeepSpeed on CPU and sees 1 process.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    trackers = list(cfg.logging.trackers)
    for name in trackers:
        module = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}.get(name)
        if module is None:
            raise ConfigError(f"logging.trackers: unknown tracker '{name}' (use tensorboard, wandb or mlflow)")
        try:
            __import__(module)
        except ImportError:
            raise ConfigError(f"logging.trackers includes '{name}' but it is not installed: pip install {name}")
    accelerator = Accelerator(
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_steps=accum,
        step_scheduler_with_optimizer=False,   # the loop steps the schedule once per optimizer step
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=handlers,
    )
    check_engaged(accelerator, plan)
    fill_deepspeed_autos(accelerator, cfg)
    if accelerator.num_processes != world_size:
        raise ConfigError(f"the launcher started {world_size} processes but Accelerate sees "
                           f"{accelerator.num_processes} (distributed_type={accelerator.distributed_type}); "
                           "see README 'Launching on CPU' for launch commands that really distribute")
    return accelerator, accum


# ----------------------------------------------------------------------------- data
@contextlib.contextmanager
def main_first(is_main: bool, barrier):
    """Rank 0 runs the block first (build, download, tokenize); the others then read its cache."""
    if not is_main:
        barrier()
    yield
    if is_main:
        barrier()


def prepare_data(cfg: Config, output_dir: Path, is_main: bool, barrier, fixed_length: int | None = None):
    """raw text -> tokenizer (loaded, or trained once on rank 0) -> tokenized splits -> collator."""
    with main_first(is_main, barrier):
        raw = load_raw(cfg.data, cfg.task, cfg.run.seed)
    tokenizer = get_tokenizer(cfg.tokenizer, cfg.model.name_or_path, raw["train"], cfg.data,
                              output_dir / "tokenizer", is_main, barrier)
    with main_first(is_main, barrier):
        data = tokenize(raw, tokenizer, cfg.task, cfg.data, cfg.task.label_names)
    if cfg.task.kind == "mlm":
        collate = MLMCollator(tokenizer, cfg.data.mlm_probability, cfg.run.seed, fixed_length=fixed_length)
    else:
        collate = ClassificationCollator(tokenizer, fixed_length=fixed_length)
    return tokenizer, data, collate


# ----------------------------------------------------------------------------- pipeline (fenced)
def run_pipeline(cfg: Config, plan) -> dict:
    """Pipeline parallelism goes around Accelerate (which has none for training): the DeepSpeed
    pipeline engine runs the same recipe, data and outputs. See bert_recipes/pipeline.py."""
    from bert_recipes.pipeline import train_pipeline
    output_dir = Path(cfg.run.output_dir)
    if cfg.model.gradient_checkpointing:
        raise ConfigError("model.gradient_checkpointing under the pipeline: use the DeepSpeed JSON's "
                          "pipeline.activation_checkpoint_interval instead")
    return train_pipeline(
        cfg, plan,
        build_data=lambda is_main, barrier: prepare_data(cfg, output_dir, is_main, barrier,
                                                         fixed_length=cfg.data.max_seq_length),
        build_model_fn=lambda tokenizer: build_model(cfg.model, cfg.task, tokenizer),
        build_optimizer_fn=lambda net: build_optimizer(net, cfg.optim),
        build_scheduler_fn=lambda optimizer, total: build_scheduler(optimizer, cfg.optim, total))


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(accelerator, model, loader, cfg: Config) -> dict[str, float]:
    """Each eval sample counted once: gather_for_metrics drops the duplicates that even
    batching adds on the last batch."""
    model.eval()
    sums, counts, preds, refs = [], [], [], []
    for batch in loader:
        logits = model(**batch).logits
        labels = batch["labels"]
        if cfg.task.kind == "mlm":   # per-sample loss sums, so the mean is over tokens of all ranks
            selected = labels != -100
            if logits.dim() == 2:    # sparse head: one row per selected token
                token_loss = F.cross_entropy(logits.float(), labels[selected], reduction="none")
                per_sample = torch.zeros(len(labels), device=logits.device).index_add_(
                    0, selected.nonzero()[:, 0], token_loss)
            else:
                per_sample = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none").sum(1)
            s, c = accelerator.gather_for_metrics((per_sample, selected.sum(1)))
            sums.append(s.double().cpu()), counts.append(c.cpu())
        else:
            p = logits.squeeze(-1).float() if cfg.task.num_labels == 1 else logits.argmax(-1)
            p, r = accelerator.gather_for_metrics((p, labels))
            preds.append(p.cpu()), refs.append(r.cpu())
    model.train()
    if cfg.task.kind == "mlm":
        total, n = torch.cat(sums).sum().item(), torch.cat(counts).sum().item()
        loss = total / max(n, 1)
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50)), "eval_samples": len(torch.cat(counts))}
    preds, refs = torch.cat(preds).numpy(), torch.cat(refs).numpy()
    names = cfg.task.metrics or default_metrics(cfg.task.num_labels)
    out = compute_metrics(names, preds, refs, cfg.task.num_labels)
    if cfg.task.num_labels == 1:
        out["eval_loss"] = float(((preds - refs) ** 2).mean())
    return {**out, "eval_samples": len(refs)}


# ----------------------------------------------------------------------------- main
def main(cfg: Config) -> dict:
    """Train as the recipe says; return the final metrics (also written to metrics.json)."""
    from accelerate.utils import broadcast_object_list, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    validate(cfg)
    output_dir = Path(cfg.run.output_dir)
    config_yaml = to_yaml(cfg)

    plan = read_launch_plan()
    if plan.pipeline:
        return run_pipeline(cfg, plan)

    # -------------------------------------------------------------------- accelerator
    accelerator, accum = build_accelerator(cfg, output_dir)
    print0 = accelerator.print
    set_seed(cfg.run.seed)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(config_yaml)
    print0(f"[setup] {accelerator.distributed_type} x{accelerator.num_processes} on {accelerator.device}, "
           f"precision={accelerator.mixed_precision}; global batch {cfg.train.global_batch_size} = "
           f"micro {cfg.train.micro_batch_size} x accum {accum} x world {accelerator.num_processes}")

    # -------------------------------------------------------------------- data
    tokenizer, data, collate = prepare_data(cfg, output_dir, accelerator.is_main_process, accelerator.wait_for_everyone)
    # Own generators: otherwise each new iterator draws its worker seed from the global torch RNG,
    # which shifts the dropout stream of a resumed run away from the uninterrupted one.
    loader_kwargs = dict(collate_fn=collate, num_workers=cfg.data.num_workers,
                         persistent_workers=cfg.data.persistent_workers and cfg.data.num_workers > 0,
                         pin_memory=cfg.data.pin_memory and torch.cuda.is_available(),
                         generator=torch.Generator().manual_seed(cfg.run.seed))
    train_loader = DataLoader(Indexed(data["train"]), batch_size=cfg.train.micro_batch_size, shuffle=True,
                              drop_last=True, **loader_kwargs)
    eval_loader = DataLoader(Indexed(data["eval"]), batch_size=cfg.train.eval_batch_size or cfg.train.micro_batch_size,
                             **loader_kwargs)
    print0(f"[data] {len(data['train'])} train / {len(data['eval'])} eval sequences, max {cfg.data.max_seq_length} "
           f"tokens, vocab {len(tokenizer)}")

    # -------------------------------------------------------------------- model, optimizer, schedule
    model = build_model(cfg.model, cfg.task, tokenizer)
    full_param_numel = count_parameters(model)
    optimizer = build_optimizer(model, cfg.optim)
    print0(f"[model] {type(model).__name__}: {full_param_numel / 1e6:.2f}M parameters")
    # drop_last shards: each rank gets len // world batches. The schedule wraps the torch optimizer
    # itself, before prepare: ZeRO keeps that optimizer (and its param_groups) inside its own.
    batches_per_epoch = len(train_loader) // accelerator.num_processes
    if batches_per_epoch == 0:
        raise ConfigError(f"{len(data['train'])} training sequences cannot fill one micro batch of "
                          f"{cfg.train.micro_batch_size} on each of {accelerator.num_processes} ranks")
    steps_per_epoch = math.ceil(batches_per_epoch / accum)   # a short last window still steps
    limits = [cfg.train.max_steps] if cfg.train.max_steps else []
    if cfg.train.epochs is not None:
        limits.append(math.ceil(cfg.train.epochs * steps_per_epoch))
    total_steps = min(limits)
    stop_at = min(total_steps, cfg.train.halt_at_step or total_steps)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    print0(f"[schedule] {total_steps} optimizer steps ({steps_per_epoch} per epoch), peak lr {cfg.optim.lr}, "
           f"{cfg.optim.decay} decay")

    # -------------------------------------------------------------------- prepare
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    accelerator.register_for_checkpointing(scheduler)
    assert len(train_loader) == batches_per_epoch, (len(train_loader), batches_per_epoch)
    backend = describe(accelerator, model, full_param_numel)
    print0("[backend] " + ", ".join(f"{k}={v}" for k, v in backend.items()))
    ds_plugin = accelerator.state.deepspeed_plugin
    config_hf = accelerator.unwrap_model(model).config
    memory_plan = predict_run(cfg, config_hf, backend, accelerator.device.type,
                              ds_plugin.deepspeed_config if ds_plugin else None)
    if memory_plan is not None:
        print0(f"[memory] predicted per device ({backend_name(backend)}; all backends: make memory): "
               + describe_plan(memory_plan))
    predicted_peak_gb = memory_plan.peak / 1e9 if memory_plan is not None else float("nan")

    # -------------------------------------------------------------------- resume
    state = {"step": 0, "history": {"train": [], "eval": []}}
    checkpoint = [resolve_resume(cfg.checkpoint.resume, output_dir) if accelerator.is_main_process else None]
    checkpoint = broadcast_object_list(checkpoint)[0]   # rank 0 decides: ranks may see the disk at different times
    if checkpoint is not None:
        state = load_checkpoint(accelerator, checkpoint)
        print0(f"[resume] from {checkpoint} at step {state['step']}")
    accelerator.init_trackers(cfg.run.name, config=flat_dict(cfg))
    baseline = None
    if cfg.task.kind == "classification" and cfg.task.num_labels > 1:
        baseline = majority_baseline(data["train"]["labels"], data["eval"]["labels"])

    def run_eval() -> dict:
        metrics = {"step": state["step"], **evaluate(accelerator, model, eval_loader, cfg)}
        state["history"]["eval"].append(metrics)
        accelerator.log({f"eval/{k}": v for k, v in metrics.items() if k != "step"}, step=state["step"])
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        print0(f"[eval] {shown}" + (f" (majority baseline accuracy {baseline:.4f})" if baseline is not None else ""))
        return metrics

    def checkpoint_now():
        save_checkpoint(output_dir, state["step"], state, config_yaml, cfg.checkpoint.keep_last,
                        accelerator.save_state, accelerator.is_main_process, accelerator.wait_for_everyone)

    # -------------------------------------------------------------------- loop
    model.train()
    mlm_fraction = (cfg.data.mlm_probability if cfg.model.sparse_mlm_head else 1.0) if cfg.task.kind == "mlm" else None
    flops_token = flops_per_token(config_hf, cfg.data.max_seq_length, mlm_fraction)
    peak, peak_source = peak_flops(accelerator.device, accelerator.mixed_precision)
    print0(f"[mfu] {flops_token / 1e6:.1f} MFLOP per token (train), peak {peak / 1e12:.2f} TFLOP/s per device "
           f"({peak_source})")
    watch = DataLoaderWatch(cfg.logging.dataloader_warn_share)
    profiler = start_profiler(output_dir) if cfg.logging.profile else None
    meter = Throughput()
    bar = tqdm(total=total_steps, initial=state["step"], desc="train", dynamic_ncols=True,
               disable=not (accelerator.is_local_main_process and cfg.logging.progress_bar))
    max_grad_norm = cfg.optim.max_grad_norm or float("inf")   # inf: measure the norm, never clip
    grad_norm = torch.tensor(0.0)
    while state["step"] < stop_at:
        epoch = state["step"] // steps_per_epoch
        train_loader.set_epoch(epoch)
        collate.epoch = epoch
        done_in_epoch = (state["step"] - epoch * steps_per_epoch) * accum
        loader = accelerator.skip_first_batches(train_loader, done_in_epoch) if done_in_epoch else train_loader
        loader.set_epoch(epoch)   # the skipping loader is new: give it the epoch, or it reshuffles as epoch 0
        for batch in loader:
            meter.batch_arrived()
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            meter.add_micro_batch(batch, loss)
            if not accelerator.sync_gradients:
                continue
            if not accelerator.optimizer_step_was_skipped:   # fp16 overflow: the step is redone
                scheduler.step()
            state["step"] += 1
            meter.steps += 1
            bar.update(1)
            if profiler is not None:
                profiler.step()
            step = state["step"]
            if step % cfg.logging.log_every == 0 or step == total_steps:
                row = {"step": step, "epoch": round(step / steps_per_epoch, 3), **meter.read(accelerator),
                       "lr": scheduler.get_last_lr()[0],
                       "grad_norm": float("nan") if grad_norm is None else float(grad_norm)}
                row["mfu"] = flops_token * row["padded_tokens_per_sec"] / (peak * accelerator.num_processes)
                _, warning = watch.verdict(row["data_wait_share"], row["window_steps"], row["window_s"])
                if warning:
                    print0(warning)
                state["history"]["train"].append(row)
                accelerator.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
                print0(f"[train] step {step}/{total_steps} loss {row['loss']:.4f} lr {row['lr']:.3e} "
                       f"grad_norm {row['grad_norm']:.3f} | {row['tokens_per_sec']:.0f} tok/s "
                       f"({row['padded_tokens_per_sec']:.0f} padded) {row['samples_per_sec']:.1f} samples/s "
                       f"{row['step_time_s'] * 1000:.0f} ms/step MFU {row['mfu']:.1%} "
                       f"data-wait {row['data_wait_share']:.0%}" + (
                           f" peak mem {torch.cuda.max_memory_allocated() / 1e9:.2f} GB (predicted "
                           f"{predicted_peak_gb:.2f})" if torch.cuda.is_available() else ""))
            t_aside = time.perf_counter()
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total_steps:
                run_eval()
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < total_steps:
                checkpoint_now()
            meter.exclude(time.perf_counter() - t_aside)
            if step >= stop_at:
                break
    bar.close()
    if profiler is not None:
        profiler.stop()
        print0(profile_table(profiler, output_dir))
    if state["step"] < total_steps:   # halted early on purpose: save and leave the rest to --resume auto
        checkpoint_now()
        print0(f"[halt] stopped at step {state['step']}/{total_steps} as train.halt_at_step asks; "
               f"checkpoint saved, continue with --resume auto")
        halted = {"steps": state["step"], "halted": True}
        if accelerator.is_main_process:
            write_metrics(output_dir / "metrics.json", halted, state["history"], {"config": flat_dict(cfg)})
        accelerator.end_training()
        return halted

    # -------------------------------------------------------------------- save
    final = run_eval() if not (state["history"]["eval"] and state["history"]["eval"][-1]["step"] == state["step"]) \
        else state["history"]["eval"][-1]
    checkpoint_now()
    if cfg.checkpoint.export:
        export_dir = export_model(accelerator, model, tokenizer, output_dir / "model", config_yaml)
        print0(f"[export] Hugging Face model + tokenizer -> {export_dir}")
    train_rows = state["history"]["train"]
    final = {**final, "steps": state["step"],
             "first_train_loss": train_rows[0]["loss"] if train_rows else None,
             "last_train_loss": train_rows[-1]["loss"] if train_rows else None,
             "wall_time_s": time.perf_counter() - t_start,
             "num_processes": accelerator.num_processes,
             "eval_dataset_size": len(data["eval"]),
             "peak_memory_gb_per_rank": peak_memory_gb(accelerator),
             "predicted_peak_memory_gb": memory_plan.peak / 1e9 if memory_plan is not None else None,
             "rank_checksums": rank_checksums(accelerator, model),
             "distributed_type": str(accelerator.distributed_type), "backend": backend}
    if baseline is not None:
        final["majority_baseline_accuracy"] = baseline
    if accelerator.is_main_process:
        write_metrics(output_dir / "metrics.json", final, state["history"], {"config": flat_dict(cfg)})
        if cfg.logging.plot:
            plot_curves(output_dir / "curves.png", state["history"], f"{cfg.run.name} ({cfg.task.kind})")
    if final["peak_memory_gb_per_rank"]:
        print0("[memory] peak allocated per GPU (torch.cuda.max_memory_allocated): "
               + ", ".join(f"{gb:.2f} GB" for gb in final["peak_memory_gb_per_rank"])
               + f"; predicted {predicted_peak_gb:.2f} GB")
    print0(f"[done] {state['step']} steps in {final['wall_time_s']:.0f}s; metrics.json, curves.png and "
           f"TensorBoard logs in {output_dir}")
    accelerator.end_training()
    return final


def parse_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Any setting can be overridden as --section.key=value, "
                                            "e.g. --train.max_steps=100 --optim.lr=3e-4")
    parser.add_argument("--recipe", help="recipe YAML (see recipes/)")
    parser.add_argument("--resume", help="shorthand for --checkpoint.resume: 'auto' or a checkpoint directory")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--profile", action="store_true", help="shorthand for --logging.profile=true")
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--") or "=" not in item:
            parser.error(f"unrecognized argument {item!r}: overrides look like --section.key=value")
        overrides.append(item[2:])
    if args.resume:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.profile:
        overrides.append("logging.profile=true")
    return load_config(args.recipe, overrides), args.print_config


if __name__ == "__main__":
    try:
        cfg, print_only = parse_args()
        if print_only:
            validate(cfg)
            print(to_yaml(cfg), end="")
            sys.exit(0)
        main(cfg)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Everything is written. Wait for every rank, then leave without tearing gloo down: its
        # worker threads, in destroy_process_group as in the interpreter's finalization, can abort
        # a finished run ("terminate called without an active exception", SIGABRT; seen in CI).
        torch.distributed.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
