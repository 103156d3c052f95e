"""What a finished run delivers besides its last state: the best evaluation kept apart, evaluations of
further splits, test-set predictions in a submission format, the export (agreed on by every rank) and its
upload to the Hub.
Each takes the engine (bert_recipes/engine.py), so it works on every backend."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import checkpoint_root, save_checkpoint
from .config import CheckpointConfig, TaskConfig
from .metrics import eval_metrics
from .ranks import barrier, print0

BEST = "best"


def lower_is_better(metric: str) -> bool:
    return "loss" in metric or metric == "perplexity"


def is_better(metric: str, value: float, best: dict | None) -> bool:
    if best is None:
        return True
    return value < best["value"] if lower_is_better(metric) else value > best["value"]


def keep_best(ckpt: CheckpointConfig, engine, state: dict, metrics: dict, output_dir: Path, config_yaml: str) -> bool:
    """After an evaluation: when checkpoint.metric_for_best improved, save this state as
    checkpoints/best (a complete checkpoint the rotation never prunes). Collective. -> saved?"""
    name = ckpt.metric_for_best
    if not name or name not in metrics or not is_better(name, metrics[name], state.get("best")):
        return False
    state["best"] = {"step": metrics["step"], "metric": name, "value": metrics[name], "metrics": dict(metrics)}
    save_checkpoint(output_dir, metrics["step"], state, config_yaml, ckpt.keep_last, engine, name=BEST)
    print0(f"[best] step {metrics['step']}: {name} {metrics[name]:.4f}, kept in {checkpoint_root(output_dir) / BEST}")
    return True


def restore_best(engine, state: dict, output_dir: Path) -> dict | None:
    """At the end: load the best evaluation's state (if it is not the last one). -> its metrics."""
    best = state.get("best")
    if not best or best["step"] == state["step"]:
        return None
    engine.load(checkpoint_root(output_dir) / BEST)
    print0(f"[best] the export, the test predictions and the final metrics come from step {best['step']} "
                  f"({best['metric']} {best['value']:.4f}), not the last step {state['step']}")
    return dict(best["metrics"])


def extra_evaluations(task: TaskConfig, engine, data) -> dict:
    """data.extra_eval_splits, each as <split>/<metric> (MNLI's mismatched set beside the matched one)."""
    out = {}
    for key in (k for k in data if k.startswith("eval:")):
        split = key.removeprefix("eval:")
        metrics = eval_metrics(task, engine.evaluate(data[key]))
        out.update({f"{split}/{k}": v for k, v in metrics.items()})
        print0(f"[eval] {split}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in metrics.items()))
    return out


def write_predictions(task: TaskConfig, engine, data, test_index: dict, output_dir: Path) -> list[Path]:
    """data.test_splits -> output_dir/predictions/<split>.tsv: `index<TAB>prediction`, one row per
    example in the split's order, the index from the split's own idx column (GLUE's submission
    format), predictions as label names where task.label_names gives them (else class ids), or
    values for a regression. Collective."""
    written = []
    for key in (k for k in data if k.startswith("test:")):
        split = key.removeprefix("test:")
        preds = engine.predict(data[key])
        if not engine.is_main:
            continue
        names = task.label_names if task.num_labels > 1 else None
        shown = ([names[int(p)] for p in preds] if names else
                 [f"{float(p):.3f}" for p in preds] if task.num_labels == 1 else [str(int(p)) for p in preds])
        path = output_dir / "predictions" / f"{split}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("index\tprediction\n" + "".join(f"{i}\t{p}\n" for i, p in zip(test_index[split], shown)))
        print0(f"[predict] {split}: {len(shown)} predictions -> {path}")
        written.append(path)
    barrier()
    return written


def export_agreed(engine, out: Path, tokenizer, config_yaml: str, card: str, step: int, export_bytes: int) -> Path:
    """engine.export, agreed on by every rank (guard.written_by_all): a full disk on rank 0 is one line,
    <output_dir>/model.partial is removed and the checkpoints stay, every rank exits with code 5."""
    import shutil

    from .export import partial_export
    from .guard import disk_full, written_by_all
    needed = (export_bytes, "an estimate: 4 bytes per parameter, the fp32 weights")
    then = "the partial export was removed and the checkpoints stay: free space there, then rerun with --resume auto"
    written_by_all(lambda: engine.export(out, tokenizer, config_yaml, card), engine.control, engine.is_main,
                   lambda: shutil.rmtree(partial_export(out), ignore_errors=True),
                   lambda err: disk_full(err, partial_export(out), "the export", step, needed, then))
    return out


def push_to_hub(ckpt: CheckpointConfig, run_name: str, export_dir: Path) -> None:
    """Upload the export (weights, tokenizer, recipe, model card) to checkpoint.hub_model_id. A failed
    upload does not undo the run: it says so and how to retry."""
    repo = ckpt.hub_model_id
    try:
        from huggingface_hub import HfApi
        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        info = api.upload_folder(folder_path=str(export_dir), repo_id=repo, commit_message=f"bert-recipes: {run_name}")
        print0(f"[hub] uploaded {export_dir} -> {getattr(info, 'commit_url', repo)}")
    except Exception as err:   # offline, no token, no permission: the export stays on disk
        print0(f"[hub] upload to {repo} failed ({type(err).__name__}: "
               f"{str(err).splitlines()[0] if str(err) else ''}); the export is in {export_dir}; retry with "
               f"`huggingface-cli upload {repo} {export_dir}`")
