"""train.micro_batch_size=auto, confirmed on the GPU before training starts.

The memory planner (bert_recipes/memory.py) picks the largest micro batch it predicts to fit, but it was
checked against an H200's measured peaks at micro 32 only. Here each rank runs one whole step of a copy of
the model at that size (forward, backward, the optimizer's step, so its states are allocated too) before
the model is wrapped for DDP: an out-of-memory error inside a collective would hang the other ranks, one in
this trial is caught. On torch.OutOfMemoryError the error's frames are freed and the next smaller size that
divides the rank's share of the global batch is tried, with a line giving both sizes. Every rank then takes
the smallest size any rank reached (one all-reduce on the control group).

What is tried is an unsharded step: under ZeRO or FSDP the model, gradients or optimizer states a rank holds
are a share of it, so a trial would turn away sizes that fit; there the planner's choice stands, and the
ranks must agree on it (preflight.same_on_every_rank). On CPU processes (auto is for GPUs) nothing is tried.
"""
from __future__ import annotations

import contextlib
import gc

import torch

from .config import Config, predictions_per_seq
from .mask_rate import largest
from .ranks import print0
from .tasks import kind_of


def trial_batch(cfg: Config, size: int, vocab_size: int, padded: bool, device) -> dict:
    """A batch of `size` rows as the collators build them, at the longest length (data.max_seq_length):
    input ids, an attention mask where batches are padded, and the task's labels (MLM: K prediction slots,
    data.max_predictions_per_seq, or a label at every position the boolean head reads)."""
    length, g = cfg.data.max_seq_length, torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size, (size, length), generator=g)
    batch = {"input_ids": ids, **({"attention_mask": torch.ones_like(ids)} if padded else {})}
    rate, k = largest(cfg.data, predictions_per_seq(cfg))   # a masking rate that moves: its largest level
    batch.update(kind_of(cfg.task.kind).trial_labels(cfg.task, ids, rate, k, g))
    return {k: v.to(device) for k, v in batch.items()}


def step_fits(model, optimizer, batch: dict, autocast) -> bool:
    """One training step on `batch`: True, or False on torch.OutOfMemoryError, with what it held freed (the
    error's traceback keeps the frames, and with them the activations, alive until it is cleared)."""
    try:
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        fits = True
    except torch.OutOfMemoryError as err:
        import traceback
        traceback.clear_frames(err.__traceback__)
        fits = False
    loss = None
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    device = batch["input_ids"].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return fits


def largest_fitting(start: int, per_rank: int, fits, say) -> int:
    """The largest size from `start` down, among the divisors of `per_rank`, for which fits(size) holds;
    one line each time it steps down. 0 when none does."""
    sizes = [d for d in range(start, 0, -1) if per_rank % d == 0]
    for size, smaller in zip(sizes, sizes[1:] + [0]):
        if fits(size):
            return size
        say(f"[config] train.micro_batch_size=auto: a trial step at micro batch {size} ran out of GPU memory; "
            + (f"trying {smaller}" if smaller else "no smaller size divides the batch"))
    return 0


def confirm_micro_batch(cfg: Config, plan, engine) -> None:
    """train.micro_batch_size=auto, decided by the planner in preflight: on GPUs under an unsharded backend,
    confirmed by a trial step on every rank (largest_fitting) and set to the smallest any rank reached, with
    the accumulation that follows (engine.set_accumulation); elsewhere the planner's choice, the same on every
    rank. Before the model the run trains is built or wrapped."""
    from .backends.consistency import resolve_run
    from .config import ConfigError
    from .ranks import all_max
    from .preflight import same_on_every_rank
    t = cfg.train
    if not (plan.on_gpu and plan.kind == "ddp" and not plan.fsdp):   # sharded, or CPU: not tried (docstring)
        same_on_every_rank(t.micro_batch_size, engine.control, "train.micro_batch_size")
        return
    planned, per_rank = t.micro_batch_size, t.global_batch_size // plan.replicas
    model, optimizer = trial_model(cfg, plan, engine.device)
    vocab = model.config.vocab_size
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
    autocast = torch.autocast("cuda", dtype=dtype) if dtype else contextlib.nullcontext()
    found = largest_fitting(planned, per_rank, lambda size: step_fits(
        model, optimizer, trial_batch(cfg, size, vocab, plan.padded, engine.device), autocast), print0)
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    agreed = int(-all_max([-found], engine.control)[0])
    if agreed == 0:
        raise ConfigError(f"train.micro_batch_size=auto: a trial step ran out of GPU memory even at micro batch 1 on "
                          "a rank; see make memory for a backend or gradient checkpointing that fits")
    if agreed != planned:
        t.micro_batch_size = agreed
        resolve_run(cfg, plan, plan.world, capability=None)   # the accumulation that follows (bf16: preflight)
        engine.set_accumulation(plan.accum)
    print0(f"[config] train.micro_batch_size=auto -> {agreed}: a whole step (optimizer states included) ran "
                  f"at {agreed} on every rank" + (f" (the planner chose {planned}; accumulation now {plan.accum})"
                                                  if agreed != planned else ""))


def trial_model(cfg: Config, plan, device):
    """A model shaped as the run's (random weights: a checkpoint's values do not change the memory) and the
    recipe's optimizer over it, on `device`."""
    import dataclasses

    from .models import build_model, model_config
    from .optim import build_optimizer
    config = model_config(cfg.model, cfg.task, cfg.tokenizer.vocab_size, 0)
    model = build_model(dataclasses.replace(cfg.model, name_or_path=None), cfg.task, config=config,
                        packed_dropout=plan.packed_dropout).to(device)
    model.train()
    return model, build_optimizer(model, cfg.optim)
