"""Will it fit? Per-device memory of a recipe under every backend, before launching it.

    python tools/memory.py --recipe recipes/bert-base-mlm-phase1.yaml --world 8 --gpu-memory 24
    python tools/memory.py --recipe recipes/bert-large-mlm.yaml --config accelerate_configs/zero2.yaml
    make memory RECIPE=recipes/bert-base-glue-sst2.yaml CONFIG=accelerate_configs/zero2.yaml ARGS="--gpu-memory 16"

Prints parameters, gradients, optimizer states, activations (with and without gradient
checkpointing) and temporary buffers per device for DDP, ZeRO-1/2/3, offload, FSDP and pipeline,
then a verdict for the device memory, with the cheapest change when the run does not fit.

--measure runs one real step instead, under the launcher, and prints estimate against measurement
(tensors after the step, saved tensors of the forward, and on GPUs torch.cuda.max_memory_allocated):

    DS_ACCELERATOR=cpu accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \\
        tools/memory.py --measure --recipe recipes/tiny-mlm.yaml
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bert_recipes.config import ConfigError, load_config   # noqa: E402
from bert_recipes.memory import (BACKENDS, GiB, Launch, Shape, activation_bytes, backend_name, fmt,  # noqa: E402
                                 measure_activations, measure_states, plan_backend, predict_run, step_precision,
                                 workload_of)

CONTEXT_RESERVE = 1 * GiB   # CUDA context, cuBLAS workspace, allocator slack: not usable by tensors
BACKEND_OF_CONFIG = {"8gpu": "ddp", "4gpu": "ddp", "2gpu": "ddp", "1gpu": "ddp", "cpu": "ddp", "multinode": "ddp",
                     "fsdp": "fsdp", "zero1": "zero1", "zero2": "zero2", "zero2_offload": "zero2-offload",
                     "zero3": "zero3", "zero3_offload": "zero3-offload", "zero3_nvme": "zero3-offload",
                     "pipeline": "pipeline"}


def recipe_shape(cfg) -> tuple[Shape, str | None]:
    """The model's shape: the checkpoint's config if it can be read (local directory or the Hub
    cache), else the recipe's model fields (BERT-base unless changed) with a note."""
    from bert_recipes.modeling import model_config
    try:
        config = model_config(cfg.model, cfg.task, cfg.tokenizer.vocab_size, 0)
        return Shape.from_config(config, cfg.task.kind), None
    except (OSError, ValueError) as err:
        fresh = replace(cfg.model, name_or_path=None)
        config = model_config(fresh, cfg.task, cfg.tokenizer.vocab_size, 0)
        note = (f"could not read {cfg.model.name_or_path}'s config ({type(err).__name__}); "
                f"assuming the recipe's model fields: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
                f"vocab {config.vocab_size}")
        return Shape.from_config(config, cfg.task.kind), note


# ----------------------------------------------------------------------------- plan
def config_world(path: str) -> int:
    """num_processes of an accelerate YAML (all machines together)."""
    import yaml
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror}")
    return int(config.get("num_processes", 1))


def fits(plan, memory: float) -> bool:
    return plan.peak + CONTEXT_RESERVE <= memory


def largest_micro_batch(backend, shape, cfg, launch, memory, checkpointing) -> int | None:
    """The largest micro batch (a divisor of the per-rank global batch, so accumulation makes up
    the rest) whose step fits."""
    per_rank = max(1, cfg.train.global_batch_size // launch.world)
    for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        if fits(plan_backend(backend, shape, workload_of(cfg, micro_batch=micro), launch, checkpointing), memory):
            return micro
    return None


def verdict(backend: str, shape: Shape, cfg, launch: Launch, memory: float) -> list[str]:
    micro = cfg.train.micro_batch_size
    gb = f"{memory / GiB:.0f} GiB"
    work = workload_of(cfg)
    mine = plan_backend(backend, shape, work, launch)
    lines = []
    if fits(mine, memory):
        best = largest_micro_batch(backend, shape, cfg, launch, memory, False)
        lines.append(f"fits on {gb} with {backend} at micro batch {micro}: peak {fmt(mine.peak)} "
                     f"(+{fmt(CONTEXT_RESERVE)} CUDA context)" + (f"; up to micro batch {best} fits" if best and best > micro else ""))
        for other in ("ddp", "zero2", "zero3"):
            p = plan_backend(other, shape, work, launch)
            if other != backend:
                lines.append(f"  {other} needs {fmt(p.peak + CONTEXT_RESERVE)}")
        return lines
    lines.append(f"does NOT fit on {gb} with {backend} at micro batch {micro}: needs {fmt(mine.peak + CONTEXT_RESERVE)}")
    # Cheapest first: sharding optimizer/gradients costs ~nothing in speed, a smaller micro batch
    # (accumulation keeps the global batch) a little, checkpointing ~30% more compute, ZeRO-3 extra
    # all-gathers, offload PCIe traffic.
    options = []
    order = ["zero1", "zero2"] if backend in ("ddp", "zero1") and launch.world > 1 else []
    for other in order:
        if other != backend:
            options.append((f"switch to {other} (same speed, shards the optimizer states"
                            + (" and gradients" if other == "zero2" else "") + ")", other, micro, False))
    smaller = largest_micro_batch(backend, shape, cfg, launch, memory, False)
    if smaller:
        accum = cfg.train.global_batch_size // (smaller * launch.world)
        options.append((f"--train.micro_batch_size={smaller} (accumulation {accum} keeps global batch "
                        f"{cfg.train.global_batch_size})", backend, smaller, False))
    options.append(("--model.gradient_checkpointing=true (~30% more compute)", backend, micro, True))
    for other in ("zero3", "zero3-offload"):
        if other != backend:
            options.append((f"switch to {other}", other, micro, False))
    for text, other, mb, ckpt in options:
        p = plan_backend(other, shape, workload_of(cfg, micro_batch=mb), launch, ckpt)
        if fits(p, memory):
            lines.append(f"cheapest fix: {text}: peak {fmt(p.peak)}")
            return lines
    lines.append("no single change fits: combine gradient checkpointing with ZeRO-3 offload, or use more devices")
    return lines


def print_plan(args, cfg) -> dict:
    shape, note = recipe_shape(cfg)
    stages = json.loads((REPO / "ds_configs/pipeline.json").read_text())["pipeline"]["stages"]
    launch = Launch(world=args.world, mixed_precision=args.precision or cfg.train.mixed_precision,
                    device=args.device, stages=stages, micro_batches=max(1, cfg.train.global_batch_size
                                                          // (cfg.train.micro_batch_size * args.world)))
    memory = args.gpu_memory * GiB
    work = workload_of(cfg)
    print(f"{Path(args.recipe).name}: {shape.params / 1e6:.1f}M parameters, micro batch {work.batch} x seq "
          f"{work.seq}, {launch.world} devices, precision {launch.mixed_precision}, device memory {args.gpu_memory:g} GiB")
    if note:
        print(f"note: {note}")
    head = ["backend", "params", "grads", "optimizer", "activations", "act (ckpt)", "temp", "peak", "peak (ckpt)", ""]
    rows, out = [], {}
    for backend in BACKENDS:
        p = plan_backend(backend, shape, work, launch)
        c = plan_backend(backend, shape, work, launch, checkpointing=True)
        mark = "fits" if fits(p, memory) else ("fits w/ ckpt" if fits(c, memory) else "OOM")
        rows.append([backend, fmt(p.parameters), fmt(p.gradients), fmt(p.optimizer), fmt(p.activations),
                     fmt(c.activations), fmt(p.temporary), fmt(p.peak), fmt(c.peak), mark])
        out[backend] = {"parameters": p.parameters, "gradients": p.gradients, "optimizer": p.optimizer,
                        "activations": p.activations, "activations_checkpointed": c.activations,
                        "temporary": p.temporary, "peak": p.peak, "peak_checkpointed": c.peak, "notes": p.notes}
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    for backend in BACKENDS:
        for n in out[backend]["notes"]:
            print(f"  {backend}: {n}")
    chosen = BACKEND_OF_CONFIG.get(Path(args.config).stem, "ddp") if args.config else "ddp"
    lines = verdict(chosen, shape, cfg, launch, memory)
    print("verdict: " + "\n".join(lines))
    return {"backends": out, "verdict": lines, "chosen": chosen}


# ----------------------------------------------------------------------------- measure
def measure(args, cfg) -> dict:
    """One real step of the recipe's model under the launcher's backend; estimate vs measured."""
    import torch
    from torch.utils.data import DataLoader

    from train import build_accelerator
    from bert_recipes.backend import describe
    from bert_recipes.modeling import build_model, model_config
    from bert_recipes.optim import build_optimizer

    from bert_recipes.backend import read_launch_plan
    if read_launch_plan().pipeline:
        raise ConfigError("--measure runs the Accelerate backends (DDP, ZeRO, FSDP); the pipeline engine is not "
                          "measured (its row in the plan is a first-order estimate)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.train.global_batch_size = cfg.train.micro_batch_size * world
    out_dir = Path(cfg.run.output_dir)
    accelerator, _ = build_accelerator(cfg, out_dir)
    config = model_config(cfg.model, cfg.task, cfg.tokenizer.vocab_size, 0)
    model = build_model(cfg.model, cfg.task, config=config)
    shape = Shape.from_config(config, cfg.task.kind)
    optimizer = build_optimizer(model, cfg.optim)

    # A synthetic batch of the recipe's shape: real model and optimizer, random tokens.
    b, s = cfg.train.micro_batch_size, cfg.data.max_seq_length
    gen = torch.Generator().manual_seed(cfg.run.seed + accelerator.process_index)
    masked = math.ceil(cfg.data.mlm_probability * b * s)

    def make_batch(_):
        ids = torch.randint(5, config.vocab_size, (b, s), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long),
                 "token_type_ids": torch.zeros(b, s, dtype=torch.long)}
        if cfg.task.kind == "mlm":
            labels = torch.full((b, s), -100)
            labels.view(-1)[torch.randperm(b * s, generator=gen)[:masked]] = ids.view(-1)[:masked]
            batch["labels"] = labels
        else:
            batch["labels"] = (torch.rand(b, generator=gen) if config.num_labels == 1
                               else torch.randint(0, config.num_labels, (b,), generator=gen))
        return batch

    loader = DataLoader([make_batch(i)["input_ids"] for i in range(4 * world)], batch_size=b)   # for DS batch autos
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = model if hasattr(model, "zero_optimization_stage") else None
    device = accelerator.device
    model.train()

    def step(batch, probe: bool) -> dict:
        batch = {k: v.to(device) for k, v in batch.items()}
        found = {}
        if probe:
            found = measure_activations(model, batch)
            loss = found.pop("loss")
        else:
            loss = model(**batch).loss
        if engine is not None:   # DeepSpeed: backward, look at the gradients, then step
            engine.backward(loss)
            if probe:
                found["gradients"] = measure_states(model, optimizer)["gradients"]
            engine.step()
        else:
            accelerator.backward(loss)
            if probe:
                found["gradients"] = measure_states(model, optimizer)["gradients"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return found

    step(make_batch(0), probe=False)   # allocates optimizer states and the backends' buffers
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    found = step(make_batch(1), probe=True)
    states = measure_states(model, optimizer)
    measured = {"parameters": states["parameters"], "gradients": found["gradients"], "optimizer": states["optimizer"],
                "activations": found["activations"], "weight_casts": found["weight_casts"]}
    if torch.cuda.is_available():
        measured["peak_allocated"] = torch.cuda.max_memory_allocated()

    info = describe(accelerator, model, shape.params)
    backend = backend_name(info)
    ds_plugin = accelerator.state.deepspeed_plugin
    plan = predict_run(cfg, config, info, device.type, ds_plugin.deepspeed_config if ds_plugin else None, masked)
    # The saved-tensor count sees what autograd stores; a checkpointed layer rebuilt in backward is transient.
    stored = activation_bytes(shape, workload_of(cfg, config, masked_tokens=masked),
                              step_precision(backend, accelerator.mixed_precision), device.type,
                              cfg.model.gradient_checkpointing)["total"]
    estimate = {"parameters": plan.parameters, "gradients": plan.gradients, "optimizer": plan.optimizer,
                "activations": stored, "peak": plan.peak}
    ranks = accelerator.gather_for_metrics([measured], use_gather_object=True)
    result = {"backend": backend, "world": world, "precision": accelerator.mixed_precision, "device": device.type,
              "estimate": estimate, "measured_per_rank": ranks}
    if accelerator.is_main_process:
        print(f"[memory] {backend} x{world} on {device.type}, precision {accelerator.mixed_precision}, "
              f"micro batch {b} x seq {s}, {shape.params / 1e6:.2f}M parameters")
        print(f"  {'component':<12} {'estimate':>12} {'measured':>12} {'ratio':>7}")
        for key in ("parameters", "gradients", "optimizer", "activations"):
            got = ranks[0][key]
            print(f"  {key:<12} {estimate[key]:>12,} {got:>12,} {got / estimate[key] if estimate[key] else float('nan'):>7.3f}")
        if "peak_allocated" in ranks[0]:
            print(f"  {'peak':<12} {estimate['peak']:>12,} {ranks[0]['peak_allocated']:>12,} "
                  f"{ranks[0]['peak_allocated'] / estimate['peak']:>7.3f}  (torch.cuda.max_memory_allocated)")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    accelerator.wait_for_everyone()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--config", help="accelerate YAML: the backend of the verdict (default: ddp)")
    parser.add_argument("--world", type=int, help="devices, all machines together (default: the --config's "
                        "num_processes, else 1)")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB per device (default: this GPU's, else 24)")
    parser.add_argument("--precision", choices=["no", "bf16", "fp16"], help="default: the recipe's")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="kernel choices and mask dtypes differ (default cuda)")
    parser.add_argument("--measure", action="store_true", help="run one real step and compare (under the launcher)")
    parser.add_argument("--out", help="write the result as JSON")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.recipe, overrides)
        if args.measure:
            measure(args, cfg)
            return 0
        if args.world is None:
            args.world = config_world(args.config) if args.config else 1
        if args.world < 1:
            raise ConfigError(f"--world must be at least 1, got {args.world}")
        if args.gpu_memory is None:
            import torch
            args.gpu_memory = (torch.cuda.get_device_properties(0).total_memory / GiB
                               if torch.cuda.is_available() else 24.0)
        result = print_plan(args, cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
