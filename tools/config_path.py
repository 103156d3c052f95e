"""Follow the recipe's config through a real run: which files it is handed to, and how often it goes
back up the layers. One process, on CPU, offline, a few steps of recipes/tiny-mlm.yaml (or any
train.py arguments after `--`):

    python tools/config_path.py [--json OUT] [-- <train.py arguments>]

What counts: every call of a function in train.py or bert_recipes/ that receives the Config or one
of its sections (cfg.train, cfg.data, ...) as an argument. A method of the config itself (`self`) is
not a hand-over.
- files: the distinct files such calls enter;
- stops: the sequence of files they enter from another file (a call within one file, main to its
  own helpers, is no hand-over), consecutive repeats merged;
- trips back up the layers: consecutive stops where the config goes from a lower layer to a higher
  one (config/readers.py > backends/plan.py, say), a layer being a file's height in our module-level imports
  (config/readers.py imports none of ours: 0; backends/plan.py imports config/: higher; ...). A path that goes
  down once, train.py > engine > backend > config, has none; every bounce adds one;
- cycles: calls into a file already on the call stack below the caller (a lower layer calling up);
- whole: the functions below train.py that receive the whole Config rather than a section.
Run it on any commit (git worktree) to compare before and after a change.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_ARGS = ["--recipe", "recipes/tiny-mlm.yaml", "--train.max_steps=2", "--train.global_batch_size=8",
                "--train.micro_batch_size=8", "--train.eval_every=2", "--checkpoint.save_every=2",
                "--logging.log_every=1", "--run.overwrite=true"]


def ours(filename: str) -> str | None:
    """The repository-relative path of a file of ours (train.py, bert_recipes/), else None."""
    path = Path(filename)
    if not path.is_absolute():
        return None
    try:
        rel = path.resolve().relative_to(REPO)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] == "bert_recipes" or str(rel) == "train.py" else None


def layers() -> dict[str, int]:
    """Each file's height in the module-level imports among our files (0: imports none of ours)."""
    import ast
    files = {str(p.relative_to(REPO)): p for p in [REPO / "train.py", *sorted((REPO / "bert_recipes").rglob("*.py"))]}
    deps: dict[str, set[str]] = {}
    for rel, path in files.items():
        deps[rel] = set()
        package = Path(rel).parent
        for node in ast.parse(path.read_text()).body:   # module level only: a lazy import is not a layer
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("bert_recipes")):
                base = package if node.level else Path()
                for _ in range(max(node.level - 1, 0)):
                    base = base.parent
                mod = base / Path(*(node.module or "").split(".")) if node.module else base
                for name in [mod] + [mod / a.name for a in node.names]:
                    for cand in (f"{name}.py", f"{name}/__init__.py"):
                        if cand in files and cand != rel:
                            deps[rel].add(cand)
    height: dict[str, int] = {}

    def h(rel, seen=()):
        if rel not in height:
            height[rel] = 1 + max((h(d, seen + (rel,)) for d in deps[rel] if d not in seen), default=-1)
        return height[rel]
    return {rel: h(rel) for rel in files}


class Tracer:
    def __init__(self, cfg):
        self.whole = id(cfg)
        self.ids = {id(cfg)} | {id(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
        self.calls: list[dict] = []

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        callee = ours(frame.f_code.co_filename)
        if callee is None:
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        carried = [n for n in names if n != "self" and id(frame.f_locals.get(n)) in self.ids]
        if not carried:
            return
        stack, up = [], frame.f_back
        while up is not None:
            stack.append(ours(up.f_code.co_filename))
            up = up.f_back
        caller = stack[0] if stack else None
        below = [f for f in stack[1:] if f is not None]
        whole = any(id(frame.f_locals.get(n)) == self.whole for n in carried)
        self.calls.append({"callee": callee, "function": code.co_name, "caller": caller, "whole": whole,
                           "back_up": callee != caller and callee in below})


def follow(cfg) -> list[dict]:
    """Run train.main(cfg) in this process, recording every hand-over of the config."""
    import train
    tracer = Tracer(cfg)
    sys.setprofile(tracer)
    try:
        train.main(cfg)
    finally:
        sys.setprofile(None)
    return tracer.calls


def summary(calls: list[dict]) -> dict:
    layer = layers()
    stops = []
    for call in calls:
        if call["caller"] == call["callee"]:
            continue
        if not stops or stops[-1] != call["callee"]:
            stops.append(call["callee"])
    files = sorted({c["callee"] for c in calls})
    ups = [f"{a} > {b}" for a, b in zip(stops, stops[1:]) if layer.get(b, 0) > layer.get(a, 0)]
    return {"calls": len(calls), "files": files, "stops": stops, "back_up": ups,
            "layers": {f: layer.get(f) for f in files},
            "cycles": [f"{c['caller']} -> {c['callee']}:{c['function']}" for c in calls if c["back_up"]],
            "visits": {f: stops.count(f) for f in files},
            "functions": [f"{c['callee']}:{c['function']}" for c in calls],
            "whole": sorted({f"{Path(c['callee']).stem}.{c['function']}" for c in calls
                             if c["whole"] and c["callee"] != "train.py"})}


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv[:split])
    train_args = argv[split + 1:] or DEFAULT_ARGS
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.chdir(REPO)
    import tempfile

    import train
    # (train.parse_args before the preflight moved it to bert_recipes.config: older commits)
    parse_train_args = getattr(train, "parse_train_args", None) or getattr(train, "parse_args")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, _ = parse_train_args(train_args + [f"--run.output_dir={tmp}/run"])
        result = summary(follow(cfg))
    print(f"[config path] {result['calls']} calls hand the config over; {len(result['files'])} files, "
          f"{len(result['stops'])} stops, {len(result['back_up'])} trips back up the layers, "
          f"{len(result['cycles'])} calls up into a file on the stack")
    print("  stops:   " + " > ".join(Path(s).stem for s in result["stops"]))
    print("  visits:  " + ", ".join(f"{Path(f).stem} {n} (layer {result['layers'][f]})"
                                    for f, n in sorted(result["visits"].items(), key=lambda x: -x[1])))
    print("  back up: " + ", ".join(result["back_up"]))
    print(f"  whole:   {len(result['whole'])} functions below train.py take the whole Config: "
          + ", ".join(result["whole"]))
    for trip in result["cycles"]:
        print(f"  cycle:   {trip}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from bert_recipes.cli import quick_exit   # without the interpreter's teardown (about 1 s)
    quick_exit(main(sys.argv[1:]))
