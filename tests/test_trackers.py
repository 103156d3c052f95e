"""logging.trackers run for real, offline, on 2 processes: TensorBoard, MLflow (its local SQLite store, read
back with an MlflowClient) and W&B (WANDB_MODE=offline, its run files read back with wandb's own reader). Each
point arrives once, from rank 0, at its step; a halted run resumed with a longer train.max_steps continues the
same MLflow run and the same W&B run id. A tracker whose package is missing is one config error line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bert_recipes.checkpoint import STATE_FILE, complete_checkpoints
from conftest import launch, refused_in_process, tiny_args

TRACKED = ("loss", "lr", "tokens_per_sec")


def wandb_history(run_file) -> list[dict]:
    """The history rows of a W&B run file (run-<id>.wandb). wandb 0.31 has no Python reader of its own any more
    (its Go core writes the file), so the few lines of its container are read here: a 7-byte header (":W&B",
    0xBEE1, version 0), then LevelDB's log format (32 KiB blocks of records: CRC-32C, length, kind 1 whole /
    2 first / 3 middle / 4 last piece), each whole record one of wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2
    data, rows, pieces, at = Path(run_file).read_bytes(), [], b"", 7
    assert data[:4] == b":W&B", run_file
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:   # a block's tail too short for a record header: padding
            at += 32768 - at % 32768
            continue
        length, kind = int.from_bytes(data[at + 4:at + 6], "little"), data[at + 6]
        pieces, at = pieces + data[at + 7:at + 7 + length], at + 7 + length
        if kind in (1, 4):   # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_every_tracker_logs_once_from_rank_0_and_a_resume_continues_its_run(tmp_path, sample_dir, datasets_cache,
                                                                           shared_tokenizer):
    from mlflow import MlflowClient
    out, home = tmp_path / "run", tmp_path / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home),
           "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"), "MLFLOW_TRACKING_URI": ""}
    common = {"tokenizer.name_or_path": shared_tokenizer, "logging.trackers": "[tensorboard,wandb,mlflow]",
              "logging.log_every": 4, "train.eval_every": 4, "data.max_train_samples": 400, "optim.decay": "wsd",
              "train.eval_final": True, "checkpoint.export": False}
    halted = launch(2, tiny_args(out, sample_dir, datasets_cache, **common,
                                 **{"train.max_steps": 12, "train.halt_at_step": 8}), env=env)
    assert halted["final"] == {"steps": 8, "halted": True}
    metrics = launch(2, tiny_args(out, sample_dir, datasets_cache, **common,
                                  **{"train.max_steps": 16, "checkpoint.resume": "auto"}), env=env)
    final, train_rows, eval_rows = metrics["final"], metrics["history"]["train"], metrics["history"]["eval"]
    assert final["num_processes"] == 2 and final["steps"] == 16
    assert [r["step"] for r in train_rows] == [r["step"] for r in eval_rows] == [4, 8, 12, 16]
    ids = json.loads((complete_checkpoints(out)[-1] / STATE_FILE).read_text())["trackers"]

    # MLflow: one experiment, one run (the resume's), every point once at its step, the values of metrics.json
    client = MlflowClient(f"sqlite:///{out / 'logs/mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "bert"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == ids["mlflow"]
    for key, rows in [*((f"train/{k}", train_rows) for k in TRACKED), ("eval/eval_loss", eval_rows)]:
        points = sorted(client.get_metric_history(run.info.run_id, key), key=lambda p: p.step)
        assert [p.step for p in points] == [r["step"] for r in rows], key
        assert [p.value for p in points] == pytest.approx([r[key.split("/")[1]] for r in rows], rel=1e-12), key
    assert run.data.params["optim/decay"] == "wsd" and run.data.params["train/max_steps"] == "12"
    assert run.data.tags["resumed/train/max_steps"] == "16"

    # W&B offline: one run directory per launch, both with the run id the checkpoint names, the steps in order
    runs = sorted((out / "logs/wandb/wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{ids['wandb']}") for r in runs), runs
    history = [row for r in runs for row in wandb_history(r / f"run-{ids['wandb']}.wandb")]
    logged = {key: [(row["_step"], row[key]) for row in history if key in row]
              for key in [*(f"train/{k}" for k in TRACKED), "eval/eval_loss"]}
    for key, points in logged.items():
        rows = eval_rows if key.startswith("eval/") else train_rows
        assert [step for step, _ in points] == [r["step"] for r in rows], (key, points)
        assert [v for _, v in points] == pytest.approx([r[key.split("/")[1]] for r in rows], rel=1e-12), key

    # TensorBoard: one event file per launch, both from rank 0
    assert len(list((out / "logs/bert").glob("events.out.tfevents.*"))) == 2


@pytest.mark.parametrize("name,package", [("wandb", "wandb==0.31.0"), ("mlflow", "mlflow-skinny==3.18.0")])
def test_a_tracker_that_is_not_installed_is_one_line_naming_its_package(name, package, tmp_path, sample_dir,
                                                                       datasets_cache, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, name, None)   # `import <name>` raises ImportError, as where it is not installed
    out = tmp_path / "run"
    argv = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{"logging.trackers": f"[{name}]"})]
    line = refused_in_process(argv, tmp_path, capsys)
    assert f"logging.trackers includes '{name}' but it is not installed: pip install {package} " \
           "(requirements-trackers.txt, which make setup installs)" in line, line
