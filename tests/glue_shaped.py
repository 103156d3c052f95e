"""A small dataset directory in GLUE's shape, for offline tests: the Hub's nyu-mll/glue layout (one
config per task, its columns and splits, test labels -1, an idx column), filled with the sample's
docstrings. `datasets.load_dataset(<dir>, "<task>")` reads it as it reads GLUE from the Hub."""
from __future__ import annotations

import json
import random
from pathlib import Path

COLUMNS = {"cola": ["sentence"], "sst2": ["sentence"], "mrpc": ["sentence1", "sentence2"],
           "stsb": ["sentence1", "sentence2"], "qqp": ["question1", "question2"], "mnli": ["premise", "hypothesis"],
           "qnli": ["question", "sentence"], "rte": ["sentence1", "sentence2"], "wnli": ["sentence1", "sentence2"]}
LABELS = {"stsb": None, "mnli": 3}   # None: a similarity in [0, 5]; the rest have 2 classes
SPLITS = {"mnli": ["train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched"]}
ROWS = {"train": 48, "test": 16}


def build_glue_like(root: Path, sample_dir: Path) -> Path:
    texts = [json.loads(line)["text"] for line in (sample_dir / "classify/train.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    configs = []
    for task, columns in COLUMNS.items():
        (root / task).mkdir(parents=True, exist_ok=True)
        files = []
        for split in SPLITS.get(task, ["train", "validation", "test"]):
            n = ROWS.get(split.split("_")[0], 24)
            rows = []
            for i in range(n):
                row = {c: rng.choice(texts) for c in columns}
                if split.startswith("test"):
                    row["label"] = -1.0 if task == "stsb" else -1
                else:
                    row["label"] = round(rng.uniform(0, 5), 2) if task == "stsb" else rng.randrange(LABELS.get(task, 2))
                rows.append({**row, "idx": 1000 + i})
            path = root / task / f"{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            files.append(f"  - split: {split}\n    path: {task}/{split}.jsonl")
        configs.append(f"- config_name: {task}\n  data_files:\n" + "\n".join(files))
    (root / "README.md").write_text("---\nconfigs:\n" + "\n".join(configs) + "\n---\n# GLUE-shaped test data\n")
    return root
