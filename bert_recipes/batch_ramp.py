"""Where each optimizer step's micro batches come from, with or without a batch that grows
(train.global_batch_size_start -> train.global_batch_size over train.batch_rampup_tokens).

A run reads one stream of micro batches: epoch after epoch, each epoch the sampler's order of (seed, epoch),
cut to a whole number of full-size steps. A step takes the next global_batch / micro of them (each rank every
world-th). Without a ramp a step always takes the same number, and step k starts at k x that. With one, the
batch takes stages that are multiples of the start (train.batch_rampup_stages):
- divisors: those that divide the full batch (768 -> 4608: 768, 1536, 2304, 4608), each stage but the last for an
  equal share of the ramp's tokens (sequences x data.max_seq_length), rounded up to whole full-size steps;
- multiples (ModernBERT's): all of them (768, 1536, 2304, 3072, 3840, 4608), each but the last the same number
  of steps, rounded up to an even number, with an epoch cut to a multiple of lcm(1..K) x the start (K = full /
  start). Stage k starts after n x (1 + ... + (k-1)) x start sequences, a multiple of its own batch k x start
  when n is even, and every epoch's end is a multiple of every stage's batch.
Either way no step ever crosses an epoch's end. Which micro batches a step takes is a function of the step and the recipe only, never of the
world size: a resume seeks to it (train.py skips to it in the epoch's sampler, never replaying the loader), on
any process count. The lr schedule counts optimizer steps, ramp or not."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .config import ConfigError, TrainConfig


@dataclass(frozen=True)
class Stage:
    first_step: int
    batch: int          # global batch, sequences
    steps: int | None   # None: the last stage, to the end of the run


@dataclass(frozen=True)
class BatchPlan:
    """stages: the global batch over the run; micro: the micro batch (sequences); epoch_batches: the global micro
    batches an epoch holds (whole full-size steps)."""
    stages: tuple
    micro: int
    epoch_batches: int
    total_steps: int    # the run's length: train.max_steps, or train.epochs of the stream, the first reached

    def at(self, step: int) -> tuple[int, int | None]:
        """-> (the global batch of `step`, the step the next stage starts at, or None in the last)."""
        for stage in self.stages:
            if stage.steps is None or step < stage.first_step + stage.steps:
                return stage.batch, (stage.first_step + stage.steps if stage.steps is not None else None)
        raise AssertionError("the last stage has no end")

    def position(self, step: int) -> int:
        """Global micro batches the steps before `step` took."""
        taken = 0
        for stage in self.stages:
            steps = step - stage.first_step if stage.steps is None else min(stage.steps, step - stage.first_step)
            if steps <= 0:
                break
            taken += steps * (stage.batch // self.micro)
        return taken

    def where(self, step: int) -> tuple[int, int]:
        """-> (the epoch `step` reads from, the global micro batches of that epoch before it)."""
        return divmod(self.position(step), self.epoch_batches)

    def steps_for(self, batches: int) -> int:
        """The steps that take `batches` global micro batches (rounded up)."""
        step = 0
        for stage in self.stages:
            per = stage.batch // self.micro
            if stage.steps is None or batches <= stage.steps * per:
                return step + math.ceil(batches / per)
            batches -= stage.steps * per
            step += stage.steps
        raise AssertionError("the last stage has no end")

    def line(self, seq_len: int, replicas: int) -> str | None:
        """The [schedule] line of a ramp; None without one."""
        if len(self.stages) == 1:
            return None
        parts = [f"{s.batch} (accum {s.batch // self.micro // replicas}) for steps {s.first_step}-"
                 f"{s.first_step + s.steps - 1}" if s.steps is not None else
                 f"{s.batch} (accum {s.batch // self.micro // replicas}) from step {s.first_step}" for s in self.stages]
        ramp = sum(s.steps * s.batch * seq_len for s in self.stages if s.steps is not None)
        full = self.stages[-1].batch
        cut = (f"; an epoch is {self.epoch_batches * self.micro:,} sequences, whole steps of every stage"
               if any(full % s.batch for s in self.stages) else "")
        return (f"[schedule] the global batch (sequences) ramps over {ramp:,} tokens (train.global_batch_size_start, "
                f"train.batch_rampup_tokens): " + ", ".join(parts) + cut + "; the lr schedule counts steps")


def batch_plan(train: TrainConfig, seq: int, train_sequences: int, steps: int) -> BatchPlan:
    """The run's stages (one without a ramp) over `train_sequences` training sequences of `seq` tokens
    (data.max_seq_length); `steps`: the run's length at the full batch (config.optimizer_steps), which a ramp's
    smaller steps lengthen when train.epochs sets it."""
    t = train
    full, micro = t.global_batch_size, t.micro_batch_size
    epoch_batches = train_sequences // full * (full // micro)
    start = t.global_batch_size_start
    if not start or start == full:
        return BatchPlan((Stage(0, full, None),), micro, epoch_batches, steps)
    stages, first = [], 0
    if t.batch_rampup_stages == "multiples":
        k_max = full // start
        each = math.ceil(t.batch_rampup_tokens / (seq * start * k_max * (k_max - 1) // 2))
        each += each % 2   # even: stage k starts at a multiple of its batch (each x k(k-1)/2 starts)
        for k in range(1, k_max):
            stages.append(Stage(first, k * start, each))
            first += each
        whole = math.lcm(*range(1, k_max + 1)) * start   # an epoch: whole steps of every stage
        epoch_batches = train_sequences // whole * (whole // micro)
        if epoch_batches == 0:
            raise ConfigError(f"train.batch_rampup_stages=multiples cuts an epoch to a multiple of lcm(1..{k_max}) x "
                              f"train.global_batch_size_start = {whole:,} sequences and there are {train_sequences:,}: "
                              "use more data, a larger start, or train.batch_rampup_stages=divisors")
    else:
        sizes = [m * start for m in range(1, full // start + 1) if full % (m * start) == 0]
        share = t.batch_rampup_tokens / (len(sizes) - 1)
        for size in sizes[:-1]:
            count = math.ceil(share / (size * seq))
            count = -(-count // (full // size)) * (full // size)   # whole full-size steps: no step crosses an epoch
            stages.append(Stage(first, size, count))
            first += count
    plan = BatchPlan((*stages, Stage(first, full, None)), micro, epoch_batches, steps)
    if t.epochs is None:
        return plan
    by_epochs = plan.steps_for(math.ceil(t.epochs * epoch_batches))
    return replace(plan, total_steps=min(by_epochs, t.max_steps or by_epochs))


def check_ramp(train: TrainConfig, world: int | None = None) -> None:
    """train.global_batch_size_start and train.batch_rampup_tokens: both or neither, the start a divisor of the
    full batch, and (with the world known) every stage a whole number of micro batches on every rank."""
    t = train
    start, tokens = t.global_batch_size_start, t.batch_rampup_tokens
    if (start is None) != (tokens is None):
        given = "train.global_batch_size_start" if start is not None else "train.batch_rampup_tokens"
        other = "train.batch_rampup_tokens" if start is not None else "train.global_batch_size_start"
        raise ConfigError(f"{given} is set and {other} is not: a batch ramp needs both (the batch it starts at, the "
                          "tokens it rises over); set both, or neither")
    if start is None:
        return
    if start > t.global_batch_size or t.global_batch_size % start:
        raise ConfigError(f"train.global_batch_size_start={start} must divide train.global_batch_size="
                          f"{t.global_batch_size} (the ramp's stages are its multiples that divide the full batch): "
                          f"pick a divisor, such as {max(d for d in range(1, min(start, t.global_batch_size // 2) + 1) if t.global_batch_size % d == 0)}")
    if world is not None and isinstance(t.micro_batch_size, int) and start % (t.micro_batch_size * world):
        unit = t.micro_batch_size * world
        fits = [d for d in range(unit, t.global_batch_size + 1, unit) if t.global_batch_size % d == 0]
        nearest = sorted(fits, key=lambda d: (abs(d - start), d))[:2]
        offer = (f"the nearest that are: {' or '.join(map(str, sorted(nearest)))}" if nearest else
                 f"no start is, as train.global_batch_size={t.global_batch_size} is not a multiple of {unit}")
        raise ConfigError(f"train.global_batch_size_start={start} is not divisible by train.micro_batch_size="
                          f"{t.micro_batch_size} x world_size={world} = {unit}: every stage of the ramp (a multiple "
                          f"of the start) must be whole micro batches on every rank; {offer}")
