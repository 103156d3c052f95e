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
import copy
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # tools/measure.py, under a harness's runpy too

from bert_recipes.activations import Shape, activation_bytes  # noqa: E402
from bert_recipes.backends.consistency import resolve_run  # noqa: E402
from bert_recipes.backends.plan import LaunchPlan, backend_rows, first_row, plan_from_config_file  # noqa: E402
from bert_recipes.config import ConfigError, load_config, validate   # noqa: E402
from bert_recipes.memory import (GiB, Launch, States, fmt, launch_of, plan_backend, predict_run,  # noqa: E402
                                 replicas, states_of, step_precision, workload_of)

CONTEXT_RESERVE = 1 * GiB   # CUDA context, cuBLAS workspace, allocator slack: not usable by tensors


def run_vocabulary(cfg) -> tuple[int, str | None]:
    """The vocabulary a fresh model of this recipe gets: its named tokenizer's size (tokenizer.name_or_path: a local
    directory, the Hub cache, or the Hub), or tokenizer.vocab_size (a tokenizer the run trains); where the named one
    cannot be read here, tokenizer.vocab_size with a note saying so."""
    named = cfg.tokenizer.name_or_path
    if not named or cfg.model.name_or_path:   # a checkpoint's config says its own
        return cfg.tokenizer.vocab_size, None
    try:
        from transformers import AutoTokenizer
        return len(AutoTokenizer.from_pretrained(named)), None
    except (OSError, ValueError) as err:
        return cfg.tokenizer.vocab_size, (
            f"assumed vocabulary: tokenizer.name_or_path={named} cannot be read here ({type(err).__name__}), so the "
            f"plan counts tokenizer.vocab_size={cfg.tokenizer.vocab_size} ids; give --tokenizer.vocab_size=<its size>")


def recipe_shape(cfg, vocab: int | None = None) -> tuple[Shape, str | None]:
    """The model's shape: the checkpoint's config if it can be read (local directory or the Hub
    cache), else, for a Hub name, the recipe's model fields (BERT-base unless changed) with a note; a fresh model's
    vocabulary is `vocab` (run_vocabulary's), else tokenizer.vocab_size."""
    from bert_recipes.models import model_config
    name = cfg.model.name_or_path
    vocab = vocab or cfg.tokenizer.vocab_size
    try:
        config = model_config(cfg.model, cfg.task, vocab, 0)
        return Shape.from_config(config, cfg.task.kind), None
    except (OSError, ValueError) as err:
        if name.startswith(("/", ".", "~")) or name.count("/") >= 2:   # a local path, not a Hub id
            raise ConfigError(f"model.name_or_path={name} does not exist yet: a run writes it when it exports "
                              "its model (runs/<name>/model comes from recipes/<name>.yaml). Run that recipe first, "
                              "or plan the shape with --model.name_or_path=null and the --model.* fields")
        config = model_config(replace(cfg.model, name_or_path=None), cfg.task, vocab, 0)
        note = (f"assumed shape: could not read {name}'s config offline ({type(err).__name__}), so the recipe's "
                f"model fields are used: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
                f"vocab {config.vocab_size}")
        return Shape.from_config(config, cfg.task.kind), note


# ----------------------------------------------------------------------------- the launch config
class Backend(NamedTuple):
    """A backend as the planner plans it: its label (a row of accelerate_configs/backends.tsv, or the kind of a
    --config that is no row), how it holds the model states (memory.States, from its launch files) and its launch
    (world, precision, device, and its own DeepSpeed JSON's buckets and pipeline stages)."""
    label: str
    states: States
    launch: Launch


def backend_of(label: str, plan: LaunchPlan, world: int, precision: str, device: str) -> Backend | None:
    """The Backend of a launch plan; None for one the planner does not model (ZeRO-0, ZeRO-1 with offload)."""
    states = states_of(plan)
    return Backend(label, states, launch_of(plan, world, precision, device)) if states is not None else None


def table_backends(world: int, precision: str, device: str) -> tuple[list[Backend], list[str]]:
    """Every one-node row of the table the planner models, in its order, each planned from its own launch files
    (a multi-node row's device holds what its one-node twin's does). -> (backends, the rows it does not model)."""
    planned, skipped = [], []
    for name, row in backend_rows().items():
        if row.nodes > 1:
            continue
        found = backend_of(name, row.plan, world, precision, device)
        (planned.append(found) if found else skipped.append(name))
    return planned, skipped


def read_launch_config(path: str | None, world: int | None, device: str | None,
                       precision: str) -> tuple[Backend, LaunchPlan]:
    """The backend, world size, device and DeepSpeed settings an accelerate YAML (and the JSON it
    names) would run, labelled by its row in the table (its kind's name for a file that is no row); without a
    YAML, DDP on one CUDA device."""
    plan = plan_from_config_file(path) if path else LaunchPlan()
    device = device or ("cpu" if plan.cpu else "cuda")
    plan.on_gpu = device == "cuda"
    same = lambda row: path and (REPO / row.config).resolve() == Path(path).resolve()   # noqa: E731
    label = next((name for name, row in backend_rows().items() if same(row)), plan.name)
    backend = backend_of(label, plan, world or plan.num_processes or 1, precision, device)
    if backend is None:
        modelled = ", ".join(b.label for b in table_backends(1, precision, device)[0])
        raise ConfigError(f"--config {path} runs {plan.name}, which the planner does not model (it models {modelled})")
    return backend, plan


def refusal(cfg, label: str, world: int) -> str | None:
    """Why a launch of this recipe under another row of the table would be refused, or None (a --config that is no
    row: the launch's own checks ran on it)."""
    if label not in backend_rows():
        return None
    plan = backend_rows()[label].plan
    plan.on_gpu = True
    try:
        resolve_run(copy.deepcopy(cfg), plan, world, capability=None)
    except ConfigError as err:
        return str(err)
    return None


def check_as_a_launch(cfg, plan: LaunchPlan, world: int) -> None:
    """The checks a launch makes of this recipe and launch config (backends.consistency.resolve_run: the batch
    arithmetic, recipe against accelerate YAML and DeepSpeed JSON, what a backend refuses), so that
    make memory never plans a run that training refuses. The GPU is not at hand: its bf16 support is
    not checked."""
    validate(cfg)
    resolve_run(cfg, plan, world, capability=None)


# ----------------------------------------------------------------------------- plan
def plan_for(backend: Backend, shape: Shape, cfg, micro: int, checkpointing: bool):
    launch = backend.launch
    accum = max(1, cfg.train.global_batch_size // (micro * replicas(backend.states, launch)))
    return plan_backend(backend.states, shape, workload_of(cfg, micro_batch=micro), replace(launch, micro_batches=accum),
                        checkpointing)


def need(plan) -> int:
    return plan.peak + CONTEXT_RESERVE


def largest_micro_batch(backend: Backend, shape, cfg, memory, checkpointing) -> int | None:
    """The largest micro batch (a divisor of the per-replica global batch, so accumulation makes
    up the rest) whose step fits."""
    per_replica = max(1, cfg.train.global_batch_size // replicas(backend.states, backend.launch))
    for micro in sorted((d for d in range(1, per_replica + 1) if per_replica % d == 0), reverse=True):
        if need(plan_for(backend, shape, cfg, micro, checkpointing)) <= memory:
            return micro
    return None


def suggested(world: int, precision: str, device: str, kind: str, zero_stage: int | None = None,
              offload: str = "none") -> Backend | None:
    """The table's first one-node row of this kind, ZeRO stage and offload (plan.first_row), as the verdict
    suggests it: by its label, planned from its own launch files."""
    name = first_row(kind, zero_stage, offload)
    return backend_of(name, backend_rows()[name].plan, world, precision, device) if name else None


def verdict(chosen: Backend, shape: Shape, cfg, memory: float) -> list[str]:
    """One line on the launch config's backend, then either the other backends' needs or the
    cheapest change that fits."""
    micro, ckpt, launch = cfg.train.micro_batch_size, cfg.model.gradient_checkpointing, chosen.launch
    like = lambda *facts: suggested(launch.world, launch.mixed_precision, launch.device, *facts)   # noqa: E731
    where = f"on {memory / GiB:g} GiB with {chosen.label} at micro batch {micro}" + (" with checkpointing" if ckpt else "")
    mine = plan_for(chosen, shape, cfg, micro, ckpt)
    if need(mine) <= memory:
        best = largest_micro_batch(chosen, shape, cfg, memory, ckpt)
        lines = [f"fits {where}: needs {fmt(need(mine))}" + (f"; up to micro batch {best} fits" if best and best > micro else "")]
        lines += [f"  {other.label} needs {fmt(need(plan_for(other, shape, cfg, micro, ckpt)))}"
                  for other in (like("ddp"), like("deepspeed", 2), like("deepspeed", 3))
                  if other and other.label != chosen.label and not refusal(cfg, other.label, launch.world)]
        return lines
    lines = [f"does NOT fit {where}: needs {fmt(need(mine))}"]
    # Cheapest first: sharding optimizer states and gradients costs ~nothing in speed, a smaller
    # micro batch (accumulation keeps the global batch) a little, checkpointing ~30% more compute,
    # ZeRO-3 extra all-gathers, offload PCIe traffic.
    options = []
    unsharded = chosen.states.kind == "ddp" or (chosen.states.kind == "deepspeed" and chosen.states.zero_stage == 1)
    if unsharded and launch.world > 1:
        options += [(f"switch to {o.label} (same speed: shards the optimizer states"
                     + (" and gradients)" if o.states.zero_stage == 2 else ")"), o, micro, ckpt)
                    for o in (like("deepspeed", 1), like("deepspeed", 2)) if o and o.label != chosen.label]
    smaller = largest_micro_batch(chosen, shape, cfg, memory, ckpt)
    if smaller:
        accum = cfg.train.global_batch_size // (smaller * replicas(chosen.states, launch))
        options.append((f"--train.micro_batch_size={smaller} (accumulation {accum} keeps global batch "
                        f"{cfg.train.global_batch_size})", chosen, smaller, ckpt))
    if not ckpt:
        text = ("pipeline.activation_checkpoint_interval: 1 in the DeepSpeed JSON" if chosen.states.kind == "pipeline"
                else "--model.gradient_checkpointing=true (~30% more compute)")
        options.append((text, chosen, micro, True))
    options += [(f"switch to {o.label}", o, micro, ckpt) for o in (like("deepspeed", 3), like("deepspeed", 3, "cpu"))
                if o and o.label != chosen.label and (o.states.offloaded or launch.world > 1)]
    for text, other, mb, with_ckpt in options:
        if other.label != chosen.label and refusal(cfg, other.label, launch.world):
            continue   # a switch that training would refuse (LAMB under ZeRO) is no fix
        plan = plan_for(other, shape, cfg, mb, with_ckpt)
        if need(plan) <= memory:
            return lines + [f"cheapest fix: {text}: needs {fmt(need(plan))}"]
    return lines + ["no single change fits: combine gradient checkpointing with ZeRO-3 offload, or use more devices"]


def print_plan(args, cfg) -> dict:
    vocab, assumed = run_vocabulary(cfg)
    shape, note = recipe_shape(cfg, vocab)
    if args.precision:
        cfg.train.mixed_precision = args.precision
    chosen, plan = read_launch_config(args.config, args.world, args.device, cfg.train.mixed_precision)
    launch, memory = chosen.launch, args.gpu_memory * GiB
    if cfg.train.micro_batch_size == "auto":   # as a GPU run would pick it on this much memory
        cfg.train.micro_batch_size = largest_micro_batch(chosen, shape, cfg, memory,
                                                         cfg.model.gradient_checkpointing) or 1
        print(f"train.micro_batch_size=auto: {cfg.train.micro_batch_size} on {args.gpu_memory:g} GiB (a run decides "
              "from its GPU's free memory, with a margin: bert_recipes.memory.auto_micro_batch)")
    check_as_a_launch(cfg, plan, launch.world)   # the same refusals as a launch, the same one line
    micro, ckpt = cfg.train.micro_batch_size, cfg.model.gradient_checkpointing
    print(f"{Path(args.recipe).name}: {shape.params / 1e6:.1f}M parameters, micro batch {micro} x seq "
          f"{cfg.data.max_seq_length}, {launch.world} x {launch.device} devices, precision {launch.mixed_precision}, "
          f"gradient checkpointing {'on' if ckpt else 'off'}; device memory {args.gpu_memory:g} GiB of which "
          f"{fmt(CONTEXT_RESERVE)} is kept for the CUDA context")
    for line in (note, assumed):
        if line:
            print(f"note: {line}")
    backends, unmodelled = table_backends(launch.world, launch.mixed_precision, launch.device)
    if chosen.label not in [b.label for b in backends]:   # a --config that is no row of the table: its own line first
        backends.insert(0, chosen)
    head = ["backend", "params", "grads", "optimizer", "activations", "act (ckpt)", "temp", "peak", "peak (ckpt)", ""]
    rows, out = [], {}
    for backend in backends:
        name = backend.label
        p = plan_for(backend, shape, cfg, micro, ckpt)
        c = plan_for(backend, shape, cfg, micro, True)
        mark = "fits" if need(p) <= memory else ("fits w/ ckpt" if need(c) <= memory else "OOM")
        if backend.states.kind == "pipeline" and launch.world < 2:
            mark = "needs 2+ devices"
        refused = refusal(cfg, name, launch.world) if name != chosen.label else None
        if refused:   # a launch under it stops at its one line: the plan is no option (the line below the table)
            mark = "refused"
        rows.append([name, fmt(p.parameters), fmt(p.gradients), fmt(p.optimizer), fmt(p.activations),
                     fmt(c.activations), fmt(p.temporary), fmt(p.peak), fmt(c.peak), mark])
        out[name] = {"parameters": p.parameters, "gradients": p.gradients, "optimizer": p.optimizer,
                     "activations": p.activations, "activations_checkpointed": c.activations,
                     "temporary": p.temporary, "peak": p.peak, "peak_checkpointed": c.peak,
                     "notes": p.notes + ([f"refused: {refused}"] if refused else []),
                     "planned_as": backend.states.name, "refused": refused}
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    for name in out:
        for line in out[name]["notes"]:
            print(f"  {name}: {line}")
    if unmodelled:
        print(f"  not modelled: {', '.join(unmodelled)}")
    lines = verdict(chosen, shape, cfg, memory)
    if note:
        lines[0] += " (assumed shape)"
    print("verdict: " + "\n".join(lines))
    return {"backends": out, "verdict": lines, "chosen": chosen.label, "world": launch.world}


# ----------------------------------------------------------------------------- measure
def synthetic_batch(cfg, config, b: int, s: int, k: int | None, masked: int, gen) -> dict:
    """A batch of the recipe's shape for measure: random tokens; MLM labels on K slots a row (as
    tasks/mlm.MLMCollator) or on `masked` positions; another kind's labels as its trial batch has them."""
    import torch
    ids = torch.randint(5, config.vocab_size, (b, s), generator=gen)
    batch = {"input_ids": ids, "token_type_ids": torch.zeros(b, s, dtype=torch.long)}
    from bert_recipes.tasks import TASKS, kind_of
    masked_lm = TASKS[cfg.task.kind].masked_lm
    if not masked_lm:   # padded batches carry a mask (packed MLM blocks come without)
        batch["attention_mask"] = torch.ones(b, s, dtype=torch.long)
    if masked_lm and k is not None:   # as tasks/mlm.MLMCollator: K positions a row, in order
        positions = torch.stack([torch.randperm(s, generator=gen)[:k].sort().values for _ in range(b)])
        batch["labels"] = torch.full((b, s), -100).scatter(1, positions, ids.gather(1, positions))
        batch["masked_positions"] = positions
    elif masked_lm:   # exactly `masked` labelled positions, the planner's count
        labels = torch.full((b, s), -100)
        labels.view(-1)[torch.randperm(b * s, generator=gen)[:masked]] = ids.view(-1)[:masked]
        batch["labels"] = labels
    else:   # the task kind's own labels, as a trial batch has them
        batch.update(kind_of(cfg.task.kind).trial_labels(cfg.task, ids, 0.0, None, gen))
    return batch


def print_measured(result: dict, b: int, s: int, out: str | None) -> None:
    """measure's table: each component estimated and measured on rank 0, and their ratio."""
    backend, world, device, precision = result["backend"], result["world"], result["device"], result["precision"]
    estimate, ranks, params = result["estimate"], result["measured_per_rank"], result["full_param_numel"]
    print(f"[memory] {backend} x{world} on {device}, precision {precision}, "
          f"micro batch {b} x seq {s}, {params / 1e6:.2f}M parameters")
    print(f"  {'component':<12} {'estimate':>12} {'measured':>12} {'ratio':>7}")
    for key in ("parameters", "gradients", "optimizer", "activations"):
        got = ranks[0][key]
        print(f"  {key:<12} {estimate[key]:>12,} {got:>12,} {got / estimate[key] if estimate[key] else float('nan'):>7.3f}")
    if "peak_allocated" in ranks[0]:
        print(f"  {'peak':<12} {estimate['peak']:>12,} {ranks[0]['peak_allocated']:>12,} "
              f"{ranks[0]['peak_allocated'] / estimate['peak']:>7.3f}  (torch.cuda.max_memory_allocated)")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


def train_step(model, optimizer, accelerator, engine, batch: dict, probe: bool) -> dict:
    """measure's optimizer step on one batch; probe: also count the saved activations and the
    gradients held before the update. engine: DeepSpeed's (it backpropagates and steps itself)."""
    from measure import measure_activations, measure_states
    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
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


def measure(args, cfg) -> dict:
    """One real step of the recipe's model under the launcher's backend; estimate vs measured."""
    import torch
    from torch.utils.data import DataLoader

    from bert_recipes.backends.accelerator import build_accelerator
    from bert_recipes.backends.consistency import resolve_run
    from bert_recipes.backends.plan import launch_plan_here
    from measure import measure_states
    from bert_recipes.models import build_model, model_config
    from bert_recipes.config import predictions_per_seq
    from bert_recipes.mask_rate import largest
    from bert_recipes.optim import build_optimizer

    launch_plan = launch_plan_here()
    if launch_plan.pipeline:
        raise ConfigError("--measure runs the Accelerate backends (DDP, ZeRO, FSDP); the pipeline engine is not "
                          "measured (its row in the plan is a first-order estimate)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.train.global_batch_size = cfg.train.micro_batch_size * world
    out_dir = Path(cfg.run.output_dir)
    accelerator = build_accelerator(resolve_run(cfg, launch_plan, world), out_dir, train=cfg.train, optim=cfg.optim,
                                    pin_memory=cfg.data.pin_memory)
    config = model_config(cfg.model, cfg.task, cfg.tokenizer.vocab_size, 0)
    model = build_model(cfg.model, cfg.task, config=config, packed_dropout=launch_plan.packed_dropout)
    shape = Shape.from_config(config, cfg.task.kind)
    optimizer = build_optimizer(model, cfg.optim)

    # A synthetic batch of the recipe's shape: real model and optimizer, random tokens.
    b, s = cfg.train.micro_batch_size, cfg.data.max_seq_length
    gen = torch.Generator().manual_seed(cfg.run.seed + accelerator.process_index)
    rate, k = largest(cfg.data, predictions_per_seq(cfg))   # the static head's K slots a sequence (the default), else a Bernoulli share; the
    masked = b * k if k is not None else math.ceil(rate * b * s)   # largest level of a masking rate that moves

    def make_batch(_):
        return synthetic_batch(cfg, config, b, s, k, masked, gen)

    loader = DataLoader([make_batch(i)["input_ids"] for i in range(4 * world)], batch_size=b)   # for DS batch autos
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = model if hasattr(model, "zero_optimization_stage") else None
    device = accelerator.device
    model.train()

    def step(batch, probe: bool) -> dict:
        return train_step(model, optimizer, accelerator, engine, batch, probe)

    step(make_batch(0), probe=False)   # allocates optimizer states and the backends' buffers
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    found = step(make_batch(1), probe=True)
    states = measure_states(model, optimizer)
    measured = {"parameters": states["parameters"], "gradients": found["gradients"], "optimizer": states["optimizer"],
                "activations": found["activations"], "weight_casts": found["weight_casts"]}
    if device.type == "cuda":
        measured["peak_allocated"] = torch.cuda.max_memory_allocated()

    states = states_of(launch_plan)
    if states is None:
        raise ConfigError(f"--measure: the planner does not model {launch_plan.name}")
    backend = states.name
    plan = predict_run(cfg, config, launch_plan, world, device.type, masked_tokens=masked)
    # The saved-tensor count sees what autograd stores; a checkpointed layer rebuilt in backward is transient.
    stored = activation_bytes(shape, workload_of(cfg, config, masked_tokens=masked),
                              step_precision(states, accelerator.mixed_precision), device.type,
                              cfg.model.gradient_checkpointing)["total"]
    estimate = {"parameters": plan.parameters, "gradients": plan.gradients, "optimizer": plan.optimizer,
                "activations": stored, "peak": plan.peak}
    ranks = accelerator.gather_for_metrics([measured], use_gather_object=True)
    result = {"backend": backend, "world": world, "precision": accelerator.mixed_precision, "device": device.type,
              "full_param_numel": shape.params,
              "estimate": estimate, "measured_per_rank": ranks}
    if accelerator.is_main_process:
        print_measured(result, b, s, args.out)
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
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        help="kernel choices and mask dtypes differ (default: cpu for a use_cpu config, else cuda)")
    parser.add_argument("--measure", action="store_true", help="run one real step and compare (under the launcher)")
    parser.add_argument("--out", help="write the result as JSON")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.recipe, overrides)
        if args.measure:
            measure(args, cfg)
            return 0
        if args.world is not None and args.world < 1:
            raise ConfigError(f"--world must be at least 1, got {args.world}")
        if args.gpu_memory is None:
            import torch
            args.gpu_memory = (torch.cuda.get_device_properties(0).total_memory / GiB
                               if torch.cuda.is_available() else 24.0)
        if args.gpu_memory <= 0:
            raise ConfigError(f"--gpu-memory must be positive (GiB per device), got {args.gpu_memory:g}")
        result = print_plan(args, cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from bert_recipes.exits import leave
    leave(main())   # --measure under a launcher: without tearing gloo down
