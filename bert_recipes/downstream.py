"""The downstream score of a pretraining's checkpoints (checkpoint.downstream names a fine-tuning recipe): each save
exports that step's model apart from the checkpoint rotation (<output_dir>/downstream/step_XXXXXXXX/model), and
tools/downstream.py (make downstream) fine-tunes each as a run of its own, in its own process, writing into
<output_dir>/downstream/step_XXXXXXXX/finetune, then brings the scores into the run's metrics.json, curves.png and
trackers: the downstream score against the pretraining step, beside the MLM loss."""
from __future__ import annotations

import json
from pathlib import Path

from .config import Config, ConfigError, path_kind
from .tasks import TASKS, reported_metrics

DIR = "downstream"
SCORE_FILE = "score.json"


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / DIR / f"step_{step:08d}"


def check_downstream(recipe: str | None, task_kind: str, model) -> None:
    """checkpoint.downstream: a fine-tuning recipe file that loads and classifies, under a pretraining run, and that can
    fine-tune the model this run trains (`model`: its ModelConfig, the architecture resolved): no other
    model.architecture, no field this architecture lacks, no sequence longer than its positions. One line for
    anything else, at the run's start rather than at make downstream's."""
    if recipe is None:
        return
    if not TASKS[task_kind].masked_lm:
        raise ConfigError(f"checkpoint.downstream={recipe} scores a pretraining's checkpoints, and task.kind="
                          f"{task_kind}: remove it")
    kind = path_kind(recipe, "checkpoint.downstream")
    if kind != "file":
        raise ConfigError(f"checkpoint.downstream={recipe} {'not found' if kind == 'missing' else 'is a directory'}: "
                          "give a fine-tuning recipe file (e.g. recipes/tiny-classify.yaml)")
    from .architectures import ARCHITECTURES, foreign_field
    from .config import load_config
    fine_tune = load_config(recipe, [])
    if TASKS[fine_tune.task.kind].masked_lm:
        raise ConfigError(f"checkpoint.downstream={recipe} is a task.kind={fine_tune.task.kind} recipe: give a "
                          "fine-tuning (classification) recipe, e.g. recipes/tiny-classify.yaml")
    # its fine-tunes start from this run's exports (tools/downstream.py: --model.name_or_path=<export>)
    trained = model.architecture
    named = fine_tune.model.architecture
    if named is not None and named != trained:
        raise ConfigError(f"checkpoint.downstream={recipe} sets model.architecture={named}, and this run trains "
                          f"model.architecture={trained}: its fine-tunes start from this run's exports; remove "
                          "model.architecture from that recipe (an export's config says what it is)")
    found = foreign_field(trained, fine_tune.model)
    if found:
        key, value, other = found
        raise ConfigError(f"checkpoint.downstream={recipe} sets model.{key}={value}, {ARCHITECTURES[other].title}'s, and "
                          f"this run trains model.architecture={trained}, which has no such field: remove it from that "
                          "recipe")
    positions = export_positions(model)
    if positions is not None and fine_tune.data.max_seq_length > positions:
        raise ConfigError(f"checkpoint.downstream={recipe} has data.max_seq_length={fine_tune.data.max_seq_length}, "
                          f"and this run's exports hold model.max_position_embeddings={positions}: set "
                          f"data.max_seq_length at most {positions} in that recipe, or pretrain with "
                          f"--model.max_position_embeddings={fine_tune.data.max_seq_length}")


def export_positions(model) -> int | None:
    """The max_position_embeddings of this run's exports: the recipe's for a fresh model or a phase (init_from builds
    the recipe's config), a checkpoint's own (model.name_or_path; None where its config cannot be read here)."""
    if model.name_or_path is None:
        return model.max_position_embeddings
    try:
        config = json.loads((Path(model.name_or_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):   # a Hub model, or not there: models.check_sequence_length tells at the fine-tune
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) else None


def score_metric(fine_tune) -> str:
    """The fine-tune's number that scores a checkpoint: its checkpoint.metric_for_best, else its first metric."""
    return fine_tune.checkpoint.metric_for_best or reported_metrics(fine_tune.task)[0]


def export_for_downstream(engine, output_dir: Path, step: int, tokenizer, config_yaml: str, export_bytes: int,
                          run_name: str) -> Path:
    """At a save: this step's model, in Hugging Face format, where the rotation (checkpoint.keep_last) does not reach
    (collective: every engine's export, agreed by every rank)."""
    from .export import export_agreed
    card = (f"# {run_name} at step {step}\n\nExported at a save for its downstream score (checkpoint.downstream; "
            "tools/downstream.py fine-tunes it).\n")
    return export_agreed(engine, step_dir(output_dir, step) / "model", tokenizer, config_yaml, card, step, export_bytes)


def exported_steps(output_dir: Path) -> list[int]:
    """The steps whose downstream export is complete, in order."""
    root = Path(output_dir) / DIR
    if not root.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*")
                  if p.name.split("_")[1].isdigit() and (p / "model" / "config.json").is_file())


def record_score(output_dir: Path, step: int, metric: str, final: dict) -> dict:
    """One fine-tune's score, kept beside its export (score.json): the step, the metric's name and value, and the
    fine-tune's other evaluation numbers."""
    kept = {k: v for k, v in final.items() if isinstance(v, (int, float)) and (k.startswith("eval_") or k == metric
                                                                                 or k in ("accuracy", "f1"))}
    row = {"step": step, "metric": metric, "value": final[metric], **kept}
    (step_dir(output_dir, step) / SCORE_FILE).write_text(json.dumps(row, indent=2) + "\n")
    return row


def scores(output_dir: Path) -> list[dict]:
    """Every recorded score of the run, by step."""
    rows = []
    for step in exported_steps(output_dir):
        saved = step_dir(output_dir, step) / SCORE_FILE
        if saved.is_file():
            rows.append(json.loads(saved.read_text()))
    return rows


def into_run(output_dir: Path, rows: list[dict], new: list[dict], cfg: Config) -> None:
    """The scores into the run's own files and trackers: metrics.json (history.downstream: every row;
    final.downstream: the last), curves.png (its downstream panel), and each of the run's logging.trackers
    (downstream/<metric> at the pretraining step of each `new` row: TensorBoard in its logs/, the MLflow run and
    the W&B run its last checkpoint names, continued). `cfg`: the run's config. The caller holds the run's output
    directory (its run.lock): the run itself writes these files."""
    from .checkpoint import complete_checkpoints, read_train_state
    from .config import flat_dict
    from .logs import Trackers, plot_curves
    metrics_file = Path(output_dir) / "metrics.json"
    metrics = json.loads(metrics_file.read_text())
    metrics["history"]["downstream"] = rows
    if rows:
        metrics["final"]["downstream"] = {"step": rows[-1]["step"], rows[-1]["metric"]: rows[-1]["value"]}
    metrics_file.write_text(json.dumps(metrics, indent=2, default=str))
    plot_curves(Path(output_dir) / "curves.png", metrics["history"], f"{cfg.run.name} (mlm, with downstream scores)")
    if cfg.logging.trackers and new:
        last = (complete_checkpoints(output_dir)[-1:] or [None])[0]
        ids = read_train_state(last).get("trackers") if last is not None else None
        from accelerate import PartialState
        PartialState()   # Accelerate's trackers log through its logging, which needs its state (one process here)
        trackers = Trackers(cfg.logging.trackers, True, Path(output_dir) / "logs")
        trackers.start(cfg.run.name, flat_dict(cfg), ids)
        for row in new:
            trackers.log({f"downstream/{row['metric']}": row["value"]}, step=row["step"])
        trackers.finish()
