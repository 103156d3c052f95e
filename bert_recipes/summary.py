"""Print the demo's summary from the runs' metrics.json files.

    python -m bert_recipes.summary runs/tiny-mlm runs/tiny-classify
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .tasks import TASKS


def summarize(run_dirs: list[str]) -> str:
    lines = ["", "=" * 72, "bert-recipes demo summary", "=" * 72]
    total = 0.0
    for run in map(Path, run_dirs):
        m = json.loads((run / "metrics.json").read_text())
        final, kind = m["final"], m["config"]["task/kind"]
        total += final["wall_time_s"]
        lines.append(f"{run}  ({kind}, {final['steps']} steps, {final['num_processes']} processes, "
                     f"{final['wall_time_s']:.0f}s)")
        if TASKS[kind].masked_lm:
            lines.append(f"  MLM train loss   {final['first_train_loss']:.3f} -> {final['last_train_loss']:.3f}")
            lines.append(f"  MLM eval loss    {final['eval_loss']:.3f} (perplexity {final['perplexity']:.1f})")
            exports = sorted(p.name for p in (run / "downstream").glob("step_*"))   # checkpoint.downstream
            if "downstream" in m["history"]:
                lines.append("  downstream       " + ", ".join(f"step {r['step']}: {r['metric']} {r['value']:.3f}"
                                                               for r in m["history"]["downstream"]))
            elif exports:
                lines.append(f"  downstream       {len(exports)} checkpoint exports to score: make downstream "
                             f"RUN={run} CPU=1")
        else:
            lines.append(f"  train loss       {final['first_train_loss']:.3f} -> {final['last_train_loss']:.3f}")
            if "accuracy" in final:
                base = final.get("majority_baseline_accuracy")
                gain = f"  ({final['accuracy'] / base:.2f}x the majority baseline {base:.3f})" if base else ""
                lines.append(f"  eval accuracy    {final['accuracy']:.3f}{gain}")
            for k in ("f1", "matthews_correlation", "pearsonr", "spearmanr"):
                if k in final:
                    lines.append(f"  eval {k:<12}{final[k]:.3f}")
        lines.append(f"  plot {run / 'curves.png'}   metrics {run / 'metrics.json'}")
        lines.append(f"  TensorBoard: tensorboard --logdir {run / 'logs'}   model: {run / 'model'}")
    lines += [f"total training wall time {total:.0f}s", "=" * 72]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1:]))
