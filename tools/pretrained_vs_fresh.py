"""Does pretraining pay on the embedded sample's fine-tuning tasks? Each twin recipe (tiny-classify, tiny-ner,
tiny-squad, tiny-retrieval) fine-tuned as it ships, from a pretrained export (make demo's runs/tiny-mlm/model by default) and from a
fresh model of the same shape and tokenizer, on the same seeds: the recipe's score for each (its
checkpoint.metric_for_best, else its first metric: accuracy, entity F1, exact match, nDCG@10), and on how many seeds the
pretrained start is ahead.

    python tools/pretrained_vs_fresh.py --seeds 1-3 --out /tmp/pvf                 # after make demo: every twin
    python tools/pretrained_vs_fresh.py --recipes tiny-ner --seeds 1 --control permuted --out /tmp/pvf
    python tools/pretrained_vs_fresh.py --recipes tiny-squad --out /tmp/pvf -- --train.epochs=20   # overrides

Positive control (--control permuted): the pretrained export with each weight tensor's values shuffled (seeded): the
same numbers, none of what pretraining learnt. It is scored as a third start: pretraining pays where the pretrained
start is ahead of it too, not only of the fresh model (a start of larger weights may learn faster by its scale).
Each fine-tune is one plain process (python train.py), offline; its log and metrics stay under --out; arguments
after `--` are overrides for every fine-tune. -> pvf.json and a line a recipe. Exit code 2 with one line for a
mistake, 1 when a fine-tune failed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

TWINS = ("tiny-classify", "tiny-ner", "tiny-squad", "tiny-retrieval")
# the shape a fresh model copies from the export's config.json (ModelConfig's keys of the same name)
SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings",
         "local_attention", "global_attn_every_n_layers", "global_rope_theta", "local_rope_theta")


def fresh_overrides(export: Path) -> list[str]:
    """A fresh model of the export's shape, architecture and tokenizer."""
    from bert_recipes.architectures import ARCHITECTURES, of_model_type
    config = json.loads((export / "config.json").read_text())
    arch = of_model_type(config.get("model_type"))
    if arch is None:
        raise ValueError(f"--from {export}: model_type {config.get('model_type')!r} is none this repository builds "
                         f"fresh ({', '.join(ARCHITECTURES)}): give an export of one of those")
    shape = [f"--model.{key}={config[key]}" for key in SHAPE if config.get(key) is not None]
    return ["--model.name_or_path=null", f"--model.architecture={arch}",
            f"--tokenizer.name_or_path={export}", *shape]


def permuted_copy(export: Path, out: Path, seed: int) -> Path:
    """The export with every tensor's values shuffled (torch.randperm under `seed`); config and tokenizer as they
    are."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    if (out / "model.safetensors").exists():
        return out
    shutil.copytree(export, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    weights = load_file(export / "model.safetensors")
    save_file({name: t.flatten()[torch.randperm(t.numel(), generator=g)].reshape(t.shape).contiguous()
               for name, t in weights.items()}, out / "model.safetensors")
    return out


def fine_tune(recipe: str, start: list[str], out: Path, seed: int, common: list[str]) -> dict:
    """One fine-tune as the recipe ships, from `start` (overrides naming the model) -> its final metrics."""
    cmd = [sys.executable, str(REPO / "train.py"), "--recipe", str(REPO / "recipes" / f"{recipe}.yaml"),
           f"--run.output_dir={out}", f"--run.seed={seed}", *common, *start]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "w") as log:
        if subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"{recipe} (seed {seed}) failed: see {out}.log")
    return json.loads((out / "metrics.json").read_text())["final"]


def compare(recipes: list[str], seeds: list[int], export: Path, out: Path, control: bool, sample_dir: str,
            overrides: list[str]) -> dict:
    from bert_recipes.config import load_config
    from bert_recipes.downstream import score_metric
    common = [f"--data.sample_dir={sample_dir}", f"--data.cache_dir={out / 'cache'}", "--logging.trackers=[]",
              "--logging.plot=false", "--logging.progress_bar=false", "--run.overwrite=true",
              "--checkpoint.save_every=null", "--checkpoint.save_final=false", "--checkpoint.export=false", *overrides]
    starts = {"pretrained": [f"--model.name_or_path={export}"], "fresh": fresh_overrides(export)}
    if control:
        starts["permuted"] = [f"--model.name_or_path={permuted_copy(export, out / 'permuted', 0)}"]
    report = {"from": str(export), "seeds": seeds, "overrides": overrides, "recipes": {}}
    for recipe in recipes:
        metric = score_metric(load_config(REPO / "recipes" / f"{recipe}.yaml", []))
        scores = {name: [] for name in starts}
        for seed in seeds:
            for name, start in starts.items():
                print(f"[pvf] {recipe}, seed {seed}, {name} ...", flush=True)
                scores[name].append(fine_tune(recipe, start, out / recipe / f"{name}-{seed}", seed, common)[metric])
        pairs = [("pretrained", "fresh")] + [("permuted", "fresh"), ("pretrained", "permuted")] * control
        row = {"metric": metric, "scores": scores,
               "ahead": {f"{a} over {b}": sum(x > y for x, y in zip(scores[a], scores[b])) for a, b in pairs}}
        report["recipes"][recipe] = row
        print(line(recipe, row, len(seeds)), flush=True)
    return report


def line(recipe: str, row: dict, n: int) -> str:
    shown = ", ".join(f"{name} {statistics.mean(v):.4f} ({min(v):.4f}..{max(v):.4f})"
                      for name, v in row["scores"].items())
    ahead = ", ".join(f"{pair} on {k}/{n} seeds" for pair, k in row["ahead"].items())
    return f"[pvf] {recipe}: {row['metric']}: {shown}; {ahead}"


def main(argv: list[str] | None = None) -> int:
    from quality import seed_list   # its offline, one-thread environment for every fine-tune, too
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(TWINS), help=f"comma-separated, of {', '.join(TWINS)}")
    parser.add_argument("--seeds", default="1-3", help="1,2 or 1-3")
    parser.add_argument("--from", dest="export", default=str(REPO / "runs/tiny-mlm/model"),
                        help="the pretrained export (default: make demo's)")
    parser.add_argument("--control", choices=["permuted"], help="add the positive control")
    parser.add_argument("--sample-dir", default=str(REPO / "data/sample"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    recipes, export = args.recipes.split(","), Path(args.export)
    try:
        unknown = [r for r in recipes if r not in TWINS]
        if unknown:
            raise ValueError(f"--recipes {','.join(unknown)}: not a twin (one of {', '.join(TWINS)})")
        seeds = seed_list(args.seeds)
        if not (export / "config.json").is_file():
            raise ValueError(f"--from {export}: no exported model there (run make demo, or give an export)")
        fresh_overrides(export)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        report = compare(recipes, seeds, export, out, args.control == "permuted", args.sample_dir,
                         overrides)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    (out / "pvf.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"[pvf] -> {out / 'pvf.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
