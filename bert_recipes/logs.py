"""Where a run's numbers go: metrics.json, curves.png (loss and evaluation against the step) and the trackers
logging.trackers names (TensorBoard, W&B, MLflow), opened on rank 0."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .config import ConfigError, first_line


def write_metrics(path: Path, final: dict, history: dict, extra: dict) -> None:
    path.write_text(json.dumps({"final": final, "history": history, **extra}, indent=2, default=str))


def plot_curves(path: Path, history: dict, title: str) -> None:
    """Training loss (left) and every eval metric (middle or right) against optimizer steps; with downstream scores
    (bert_recipes/downstream.py), a third panel: each checkpoint's fine-tuned score against its pretraining step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals, downstream = history.get("train", []), history.get("eval", []), history.get("downstream", [])
    fig, axes = plt.subplots(1, 3 if downstream else 2, figsize=(16 if downstream else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    if downstream:   # checkpoint.downstream: each checkpoint fine-tuned (tools/downstream.py)
        metric = downstream[-1]["metric"]
        axes[2].plot([r["step"] for r in downstream], [r["value"] for r in downstream], "s-", color="tab:green",
                     label=f"fine-tuned {metric}")
        axes[2].set_xlabel("pretraining step"), axes[2].set_title("downstream score of each checkpoint")
        axes[2].legend(), axes[2].grid(alpha=0.3)
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
    - wandb: project run.name, its files in WANDB_DIR when set (W&B's own convention), else <output_dir>/logs/wandb
      (WANDB_MODE=offline: nothing leaves the machine; `wandb sync` uploads them later).
    A resumed run continues the MLflow run and the W&B run id its checkpoint names (`ids`).
    What breaks from outside: check() runs before anything is written (an MLflow URI MLflow refuses, a server that
    does not answer: one line each); a tracker that fails during the run (its server lost) is dropped with one
    line, and the run goes on: its points stay in metrics.json and the other trackers."""

    def __init__(self, names: list[str], is_main: bool, logging_dir: Path):
        self.names, self.is_main, self.logging_dir, self.open = list(names), is_main, logging_dir, []

    def check(self) -> None:
        """Each tracker's store reachable now, before the run writes anything (rank 0; train.py tells every rank):
        raises ConfigError with the one line."""
        if "mlflow" in self.names:
            check_mlflow(os.environ.get("MLFLOW_TRACKING_URI") or None)

    def start(self, run_name: str, config: dict, ids: dict | None = None) -> dict:
        """Open each tracker (rank 0); ids: {tracker: run id} from the checkpoint resumed, continued.
        -> {tracker: run id} now, for the next checkpoints (empty on other ranks and for TensorBoard)."""
        if not self.is_main:
            return {}
        if "mlflow" in self.names:   # a server lost mid-run costs seconds, not MLflow's 254 s of retries
            for var, value in MLFLOW_DURING_RUN.items():
                os.environ.setdefault(var, value)
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
            self.open.append((name, tracker))
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
        where = Path(os.environ.get("WANDB_DIR") or self.logging_dir / "wandb")
        where.mkdir(parents=True, exist_ok=True)
        resume = {"id": run_id, "resume": "allow"} if run_id else {}   # a new run: W&B draws its id
        return WandBTracker(run_name, name=run_name, dir=str(where), **resume)

    def log(self, values: dict, step: int) -> None:
        for name, tracker in list(self.open):
            try:
                tracker.log(values, step=step)
            except Exception as err:   # noqa: BLE001 (a tracker's failure must not end or stall the run)
                self._drop(name, f"at step {step}", err)

    def _drop(self, name: str, when: str, err: BaseException) -> None:
        self.open = [(n, t) for n, t in self.open if n != name]
        print(f"[trackers] WARNING: {name} failed {when} ({type(err).__name__}: {first_line(err)}); it is left out "
              "from here on and the run goes on: every point stays in metrics.json"
              + (" and the other trackers" if self.open else ""), flush=True)

    def finish(self) -> None:
        for name, tracker in self.open:
            try:
                tracker.finish()
            except Exception as err:   # noqa: BLE001
                self._drop(name, "closing its run", err)
        self.open = []


# A run's MLflow calls against a server that stops answering: one retry, 10 s each, instead of MLflow's default of 7
# retries with backoff (254 s a call, measured 2026-12-04 against a closed port); a user's own values are kept.
MLFLOW_DURING_RUN = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# The check before the run: no retry, 5 s (a closed port answers in milliseconds, a black hole in 5 s).
MLFLOW_CHECK = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def check_mlflow(uri: str | None) -> None:
    """MLFLOW_TRACKING_URI as MLflow takes it, before anything is written: a store MLflow refuses (its file store,
    which MLflow 3 keeps in maintenance mode unless MLFLOW_ALLOW_FILE_STORE=true) or a server that does not answer
    within MLFLOW_CHECK's limits is one ConfigError line naming the URI and the fix. Unset, or a SQLite store: the
    run creates it, nothing to ask."""
    if uri is None or uri.startswith("sqlite:"):
        return
    from mlflow import MlflowClient
    saved = {var: os.environ.get(var) for var in MLFLOW_CHECK}
    os.environ.update(MLFLOW_CHECK)
    try:
        MlflowClient(uri).search_experiments(max_results=1)
    except Exception as err:   # noqa: BLE001 (whatever MLflow raises: the line names it)
        text = first_line(err)
        if "file" in text.lower() and ("maintenance" in text.lower() or "MLFLOW_ALLOW_FILE_STORE" in text):
            fix = ("use a SQLite store (MLFLOW_TRACKING_URI=sqlite:///<dir>/mlflow.db), a tracking server, or set "
                   "MLFLOW_ALLOW_FILE_STORE=true to keep the file store")
            raise ConfigError(f"logging.trackers: mlflow: MLflow refuses MLFLOW_TRACKING_URI={uri} ({text}); {fix}") from None
        raise ConfigError(f"logging.trackers: mlflow: the tracking server MLFLOW_TRACKING_URI={uri} does not answer "
                          f"({type(err).__name__}: {text}); start it, correct MLFLOW_TRACKING_URI, or leave mlflow out "
                          "of logging.trackers") from None
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


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
