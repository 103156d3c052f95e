"""Where a run's numbers go: metrics.json, curves.png (loss and evaluation against the step) and the trackers
logging.trackers names (TensorBoard, W&B, MLflow), opened on rank 0."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def write_metrics(path: Path, final: dict, history: dict, extra: dict) -> None:
    path.write_text(json.dumps({"final": final, "history": history, **extra}, indent=2, default=str))


def plot_curves(path: Path, history: dict, title: str) -> None:
    """Training loss (left) and every eval metric (right) against optimizer steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = history.get("train", []), history.get("eval", [])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    loss_evals = [r for r in evals if "eval_loss" in r]
    if loss_evals:
        ax1.plot([r["step"] for r in loss_evals], [r["eval_loss"] for r in loss_evals], "o-", label="eval loss")
    ax1.set_xlabel("optimizer step"), ax1.set_ylabel("loss"), ax1.legend(), ax1.grid(alpha=0.3)
    keys = sorted({k for r in evals for k, v in r.items()
                   if k not in ("step", "eval_loss", "eval_samples", "perplexity") and isinstance(v, float)
                   and math.isfinite(v)})
    for k in keys:
        ax2.plot([r["step"] for r in evals if k in r], [r[k] for r in evals if k in r], "o-", label=k)
    if keys:
        ax2.legend()
    ax2.set_xlabel("optimizer step"), ax2.set_title("eval metrics"), ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Trackers:
    """logging.trackers (tensorboard, wandb, mlflow) for every engine: Accelerate's own tracker
    classes, opened on global rank 0 only, so they need no Accelerator (the pipeline has none), every
    backend writes the same files and each point is logged once. Where they write:
    - tensorboard: <output_dir>/logs/<run.name>/;
    - mlflow: the server (or store) of MLFLOW_TRACKING_URI, else a local SQLite store,
      <output_dir>/logs/mlflow.db (experiment run.name);
    - wandb: project run.name, its files in <output_dir>/logs/wandb (WANDB_MODE=offline: nothing leaves the
      machine; `wandb sync` uploads them later).
    A resumed run continues the MLflow run and the W&B run id its checkpoint names (`ids`)."""

    def __init__(self, names: list[str], is_main: bool, logging_dir: Path):
        self.names, self.is_main, self.logging_dir, self.open = list(names), is_main, logging_dir, []

    def start(self, run_name: str, config: dict, ids: dict | None = None) -> dict:
        """Open each tracker (rank 0); ids: {tracker: run id} from the checkpoint resumed, continued.
        -> {tracker: run id} now, for the next checkpoints (empty on other ranks and for TensorBoard)."""
        if not self.is_main:
            return {}
        ids, now = dict(ids or {}), {}
        for name in self.names:
            tracker = self._open(name, run_name, ids.get(name))
            tracker.main_process_only = False   # this is rank 0 already: no Accelerator state to ask
            tracker.start()
            if name == "mlflow":
                now[name] = tracker.active_run.info.run_id
                _mlflow_params(tracker, config, resumed=name in ids)
            else:
                tracker.store_init_configuration(config)   # W&B: a resume may change values (allow_val_change)
                if name == "wandb":
                    now[name] = tracker.run.id
            self.open.append(tracker)
        return now

    def _open(self, name: str, run_name: str, run_id: str | None):
        from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker
        if name == "tensorboard":
            return TensorBoardTracker(run_name, str(self.logging_dir))
        if name == "mlflow":
            import mlflow
            if not os.environ.get("MLFLOW_TRACKING_URI"):   # MLflow's local store: SQLite (its ./mlruns is retired)
                self.logging_dir.mkdir(parents=True, exist_ok=True)
                mlflow.set_tracking_uri(f"sqlite:///{(self.logging_dir / 'mlflow.db').resolve()}")
            return MLflowTracker(run_name, logging_dir=str((self.logging_dir / "mlflow-artifacts").resolve()),
                                 run_id=run_id, run_name=run_name)
        (self.logging_dir / "wandb").mkdir(parents=True, exist_ok=True)
        resume = {"id": run_id, "resume": "allow"} if run_id else {}   # a new run: W&B draws its id
        return WandBTracker(run_name, name=run_name, dir=str(self.logging_dir / "wandb"), **resume)

    def log(self, values: dict, step: int) -> None:
        for tracker in self.open:
            tracker.log(values, step=step)

    def finish(self) -> None:
        for tracker in self.open:
            tracker.finish()
        self.open = []


def _mlflow_params(tracker, config: dict, resumed: bool) -> None:
    """The config as MLflow params. A param, once logged, cannot change: a resumed run logs the ones its run
    lacks, and a value the resume changed (train.max_steps, say) as the tag resumed/<key> (the latest)."""
    if not resumed:
        tracker.store_init_configuration(config)
        return
    import mlflow
    logged = mlflow.get_run(tracker.active_run.info.run_id).data.params
    tracker.store_init_configuration({k: v for k, v in config.items() if k not in logged})
    changed = {f"resumed/{k}": str(v) for k, v in config.items() if k in logged and logged[k] != str(v)}
    if changed:
        mlflow.set_tags(changed)
