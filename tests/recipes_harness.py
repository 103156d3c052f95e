"""Test harness: every shipped recipe's first steps in one launch (tests/test_recipes.py, once per ZeRO stage).

Each recipe runs as shipped but cut to a CPU's size: two optimizer steps of a tiny model (2 layers, hidden 32) on
the suite's own data in the recipe's shape (the sample for a corpus, the recipe's own mixture files in the sample,
a GLUE-shaped directory read as GLUE is read from the Hub, tests/glue_shaped.py), fp32, the micro batch at most 4
with the recipe's accumulation at 2. What the rows differ in stays the recipe's: its task, optimizer, masking,
packing, document masks, length-grouped batches, batch ramp, mixture, phases (checkpoint.init_from points at the
same harness's run of the recipe it names) and a fine-tune's checkpoint (tiny-mlm's export from this launch).
Rank 0 writes <out>/results.json: per recipe, its steps or its refusal line (a ConfigError, as train.py prints it).

    accelerate launch --config_file accelerate_configs/zero2.yaml tests/recipes_harness.py OUT SAMPLE CACHE TOK GLUE
"""
import json
import sys
from pathlib import Path

repo = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(repo))

import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import train  # noqa: E402
from bert_recipes.config import load_config  # noqa: E402
from bert_recipes.config.readers import ConfigError  # noqa: E402

# One process group for every recipe: a run's end would tear it down (Accelerator.end_training), and the next run
# would start on none. This launch keeps it; train.py itself runs once a process and is unchanged.
Accelerator.end_training = lambda self: None

FIRST = "tiny-mlm"   # its export is every fine-tune's checkpoint


def order(recipes: list[Path]) -> list[Path]:
    """tiny-mlm first, then each recipe after the run its checkpoint.init_from names."""
    by_name = {p.stem: p for p in recipes}
    done: list[Path] = []

    def add(path: Path) -> None:
        if path in done:
            return
        init_from = (yaml.safe_load(path.read_text()).get("checkpoint") or {}).get("init_from")
        if init_from and Path(init_from).name in by_name:
            add(by_name[Path(init_from).name])
        done.append(path)
    for path in [by_name[FIRST], *sorted(recipes)]:
        add(path)
    return done


def shrink(recipe: Path, out: Path, sample: Path, cache: Path, tokenizer: Path, glue: Path) -> list[str]:
    c = load_config(recipe)
    raw = yaml.safe_load(recipe.read_text())
    micro = min(c.train.micro_batch_size, 4)
    args = {"run.output_dir": out / recipe.stem, "run.overwrite": True, "run.seed": 7, "data.cache_dir": cache,
            "data.max_train_samples": 96, "data.max_eval_samples": 16, "data.max_seq_length": min(c.data.max_seq_length, 64),
            "train.micro_batch_size": micro, "train.global_batch_size": micro * 2 * 2, "train.max_steps": 2,
            "train.epochs": None, "train.eval_every": None, "train.mixed_precision": "no", "checkpoint.save_every": 2,
            "checkpoint.downstream": None, "logging.trackers": "[]", "logging.progress_bar": False,
            "logging.plot": False, "logging.log_every": 1}
    if c.train.global_batch_size_start:
        args.update({"train.global_batch_size_start": micro * 2, "train.batch_rampup_tokens": 4096})
    fresh = not c.model.name_or_path and not c.checkpoint.init_from
    if fresh or "hidden_size" in (raw.get("model") or {}):   # a fresh model, or a phase that repeats its shape
        args.update({"model.hidden_size": 32, "model.num_hidden_layers": 2, "model.num_attention_heads": 2,
                     "model.intermediate_size": 64, "model.max_position_embeddings": 64})
        if c.model.architecture == "modernbert":
            args["model.local_attention"] = 32
    if c.model.name_or_path:
        args["model.name_or_path"] = out / FIRST / "model"
    elif fresh:
        args["tokenizer.name_or_path"] = tokenizer
    if c.checkpoint.init_from:
        args["checkpoint.init_from"] = out / Path(c.checkpoint.init_from).name
    if c.data.mixture:
        kinds = ("reference", "docstrings")   # a Hub dataset source: one of the sample's two kinds of text
        sources = [{"name": s["name"], "weight": s.get("weight", 1),
                    "files": [str(sample / Path(f).relative_to("data/sample")) for f in s["files"]] if "files" in s
                    else [str(sample / f"pretrain/{kinds[i % 2]}.txt")]} for i, s in enumerate(raw["data"]["mixture"])]
        args["data.mixture"] = json.dumps(sources)
    elif c.data.source == "hub" and c.task.kind == "classification":
        args["data.dataset_name"] = glue
    elif c.task.kind == "question_answering":   # SQuAD -> the sample's cloze questions, in windows that fit
        args.update({"data.source": "sample", "data.sample_dir": sample, "data.doc_stride": 8})
    elif c.task.kind == "token_classification":   # CoNLL-2003's tags -> the sample's (bert_recipes/data/sample.py)
        from bert_recipes.data.sample import NER_TAGS
        args.update({"data.source": "sample", "data.sample_dir": sample, "task.num_labels": len(NER_TAGS),
                     "task.label_names": f"[{', '.join(NER_TAGS)}]"})
    elif c.task.kind == "retrieval":   # MS MARCO's triplets -> the sample's pairs, evaluated on their own split
        args.update({"data.source": "sample", "data.sample_dir": sample, "data.negative_columns": None,
                     "data.beir_dir": None})
    else:
        args.update({"data.source": "sample", "data.sample_dir": sample})
    return [f"{k}={'null' if v is None else v}" for k, v in args.items()]


def run(recipe: Path, overrides: list[str]) -> dict:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    try:
        final = train.main(load_config(recipe, overrides))
        return {"steps": final["steps"], "num_processes": final["num_processes"],
                "backend": final["backend"]}
    except ConfigError as err:   # train.py prints it as one line (exits.run_train); every rank raises it
        return {"refused": str(err)}


def main(out: Path, sample: Path, cache: Path, tokenizer: Path, glue: Path) -> None:
    results = {}
    for recipe in order(sorted((repo / "recipes").glob("*.yaml"))):
        results[recipe.stem] = run(recipe, shrink(recipe, out, sample, cache, tokenizer, glue))
        if dist.get_rank() == 0:
            print(f"[harness] {recipe.stem}: {results[recipe.stem]}", flush=True)
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:6]))
