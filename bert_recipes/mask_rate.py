"""The masking rate over a run (data.mlm_probability -> data.mlm_probability_end): a staircase of at most 8 levels,
each with its K (data.max_predictions_per_seq scaled by the rate), and the rate evaluation masks at
(data.eval_mlm_probability). Which level a step is in is a function of (step, total steps) only, so a resume, on
any process count, masks every batch as the uninterrupted run did; the loop starts a new iterator at each level's
first step (train.py), and the collator reads the level from shared memory (tasks/mlm.MLMCollator.level)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import DataConfig
from .tasks import TASKS

MAX_LEVELS = 8   # dynamo's recompile limit: train.compile compiles each K (a shape) once


@dataclass(frozen=True)
class MaskSchedule:
    """levels: (rate, K or None) per level; starts: each level's first step (starts[0] = 0); evaluation: the
    (rate, K) evaluation masks at. One level: the rate does not move."""
    levels: tuple
    starts: tuple
    evaluation: tuple

    def at(self, step: int) -> tuple[int, int | None]:
        """-> (the level `step` is in, the step the next level starts at, or None for the last)."""
        level = max(i for i, start in enumerate(self.starts) if start <= step)
        return level, self.starts[level + 1] if level + 1 < len(self.starts) else None

    def rate(self, step: int) -> float:
        return self.levels[self.at(step)[0]][0]

    def line(self) -> str | None:
        """The [schedule] line of a rate that moves, or of an evaluation rate of its own; None otherwise."""
        if len(self.levels) == 1 and self.evaluation == self.levels[0]:
            return None
        k = lambda level: f" (K {level[1]})" if level[1] is not None else ""   # noqa: E731
        steps = [f"{rate:.4g}{k((rate, kk))} from step {start}" for (rate, kk), start in zip(self.levels, self.starts)]
        moving = (f"the masking rate moves in {len(self.levels)} levels: " + ", ".join(steps)
                  if len(self.levels) > 1 else f"the masking rate is {steps[0].split(' from')[0]}")
        return (f"[schedule] {moving}; evaluation masks at {self.evaluation[0]:.4g}{k(self.evaluation)} "
                "(data.mlm_probability_end, data.eval_mlm_probability)")


def mask_schedule(data: DataConfig, kind: str, compile: bool, total_steps: int) -> MaskSchedule:
    """The run's masking levels over `total_steps` optimizer steps. A rate that moves takes
    min(8 // shapes, total_steps) levels (shapes: the length bins a padded batch takes under train.compile, each
    K one more compiled graph per bin), the first at data.mlm_probability and the last at data.mlm_probability_end,
    evenly spaced in rate and in steps; K follows the rate (round(K x rate / data.mlm_probability), at least 1)."""
    d = data
    start, end = d.mlm_probability, d.mlm_probability_end
    count = 1 if end is None or end == start or not TASKS[kind].masked_lm else min(levels_allowed(d, compile), total_steps)
    rates = [start] if count == 1 else [round(start + (end - start) * i / (count - 1), 6) for i in range(count)]
    starts = tuple(round(i * total_steps / count) for i in range(count))
    levels = tuple((rate, k_at(d.max_predictions_per_seq, start, rate)) for rate in rates)
    evaluation = d.eval_mlm_probability if d.eval_mlm_probability is not None else start
    return MaskSchedule(levels, starts, (evaluation, k_at(d.max_predictions_per_seq, start, evaluation)))


def k_at(k: int | str | None, start: float, rate: float) -> int | None:
    """K at `rate` for a run whose K is `k` at its starting rate `start` (None: per-token masking, no K)."""
    if not isinstance(k, int):
        return None
    return max(1, round(k * rate / start))


def levels_allowed(data: DataConfig, compile: bool) -> int:
    """How many levels the rate may take: 8, or 8 // length bins when train.compile compiles each (bin, K) pair."""
    bins = data.length_bins if isinstance(data.length_bins, int) else 0
    shapes = bins if compile and bins > 1 and not data.packing else 1
    return MAX_LEVELS // shapes


def largest(data: DataConfig, k: int | None) -> tuple[float, int | None]:
    """The (rate, K) of the run's most predicted tokens, training's or evaluation's, for a run whose K at its starting
    rate is `k` (config.predictions_per_seq): what memory is sized for (the planner, train.micro_batch_size=auto's
    trial step). Needs no step count: the levels lie between the two ends."""
    rate = max(r for r in (data.mlm_probability, data.mlm_probability_end, data.eval_mlm_probability) if r is not None)
    return rate, k_at(k, data.mlm_probability, rate)
