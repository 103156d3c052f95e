"""The docs agree with the code: every ```bash block in README.md and docs/*.md names real Make targets,
real config keys and paths that exist; the README's file map names files that exist; the memory examples
print what the docs say they print, and what they plan as fitting passes preflight."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# The rule for paths a command creates (they need not exist before it runs):
#   - a placeholder (<name>) or a shell variable ($seq) stands for a path, it is not one;
#   - the value of an output option (OUTPUTS) is written by its command, and so is what lies under it,
#     for the later commands of the same block;
#   - CREATED_ROOTS are written by the project's commands: runs/ by every run (run.output_dir defaults
#     to runs/<run.name>), .whl/ by tools/gpu_wheels.sh, .gpu_data/ by tools/gpu_session.py prepare.
OUTPUTS = {"OUT", "--out", "--results", "--make-corpus", "--run.output_dir", "--data.cache_dir", "venv"}
CREATED_ROOTS = ("runs/", ".whl/", ".gpu_data/")


def fences(doc: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, text) of each fenced block, fences paired in order."""
    blocks, opened, lines = [], None, doc.read_text().splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            if opened is None:
                opened = (n, line[3:].strip(), [])
            else:
                blocks.append((opened[0], opened[1], "".join(opened[2])))
                opened = None
        elif opened is not None:
            opened[2].append(line)
    return blocks


def bash_blocks() -> list[tuple[str, str]]:
    return [(f"{doc.relative_to(REPO)}:{n}", text) for doc in DOCS for n, lang, text in fences(doc) if lang == "bash"]


def commands(block: str) -> list[list[str]]:
    """Each command line of a block as shell words, comments dropped, continuations joined; the words of
    a quoted ARGS="..." are words too (make hands them to the tool)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for word in list(words):
            if word.startswith("ARGS="):
                words += shlex.split(word[len("ARGS="):])
        if words:
            out.append(words)
    return out


def make_targets() -> set[str]:
    rules = re.findall(r"^([a-zA-Z][\w-]*):", (REPO / "Makefile").read_text(), re.M)
    modes = [line.split("\t")[0] for line in (REPO / "accelerate_configs/backends.tsv").read_text().splitlines()
             if line and not line.startswith("#")]
    return set(rules) | set(modes)


def config_keys() -> set[str]:
    import dataclasses

    from bert_recipes.config import Config
    cfg = Config()
    return {f"{section.name}.{key.name}" for section in dataclasses.fields(cfg)
            for key in dataclasses.fields(getattr(cfg, section.name))}


def option_and_value(word: str) -> tuple[str | None, str]:
    """'--out=x' -> ('--out', 'x'); 'OUT=x' -> ('OUT', 'x'); 'x' -> (None, 'x')."""
    m = re.match(r"^(--[\w.-]+|[A-Z_]+)=(.*)$", word)
    return (m.group(1), m.group(2)) if m else (None, word)


def paths_of(words: list[str]) -> list[tuple[str | None, str]]:
    """(the option it is the value of, the path) for each word that names a repository path."""
    found, previous = [], None
    for word in words:
        option, value = option_and_value(word)
        option = option or (previous if previous in OUTPUTS else None)
        for part in value.strip("[]").split(","):
            if "/" in part and "://" not in part and not part.startswith("-") and "=" not in part:
                found.append((option, part))
        previous = word
    return found


def test_every_bash_block_names_real_targets_keys_and_paths():
    targets, keys, problems, blocks = make_targets(), config_keys(), [], bash_blocks()
    assert len(blocks) >= 10, blocks   # the test reads what it means to
    for where, block in blocks:
        created: list[str] = []
        for words in commands(block):
            if words[:2] == ["tools/slurm_cluster.py", "up"] and len(words) > 2:
                created.append(words[2].rstrip("/") + "/")   # the cluster's directory: made by `up`
            if words[0] == "split" and len(words) > 2:
                created.append(words[-1])   # split's last word: the prefix of the files it writes
            if words[0] == "make":
                named = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
                problems += [f"{where}: make {t}: no such target" for t in named[:1] if t not in targets]
            for word in words:
                m = re.match(r"^--([a-z_]+\.[a-z_0-9]+)(=|$)", word)
                if m and m.group(1) not in keys:
                    problems.append(f"{where}: --{m.group(1)}: not a config key")
            for option, path in paths_of(words):
                if "<" in path or "$" in path:
                    continue
                if option in OUTPUTS or (words[:3] == ["python3", "-m", "venv"] and path == words[-1]):
                    created.append(path.rstrip("/") + "/")
                    continue
                if path.startswith(CREATED_ROOTS) or any((path + "/").startswith(c) for c in created):
                    continue
                if not (REPO / path).exists():
                    problems.append(f"{where}: {path}: no such path")
            if words[:3] == ["python3", "-m", "venv"]:
                created.append(words[3].rstrip("/") + "/")
    assert not problems, "\n".join(problems)


def test_the_readme_file_map_names_files_that_exist():
    block = next(text for _, lang, text in fences(REPO / "README.md") if not lang and "train.py " in text)
    named = [line.split()[0] for line in block.splitlines() if line and not line.startswith(" ")]
    assert len(named) > 20 and "train.py" in named, named
    missing = [n for n in named if not (REPO / n).exists()]
    assert not missing, missing
    # and every module of the package is on the map (a new file gets its line)
    modules = {str(p.relative_to(REPO)) for p in (REPO / "bert_recipes").glob("*.py") if p.name != "__init__.py"}
    assert modules <= set(named) | {"bert_recipes/metrics"}, sorted(modules - set(named))


def memory_examples() -> list[tuple[str, list[str], list[str]]]:
    """(where, tools/memory.py's arguments, the output lines the docs show for it) for each `make memory`
    or tools/memory.py command in a bash block; the output shown is the plain block right after the bash
    block when it starts with the tool's verdict or its config error."""
    examples = []
    for doc in DOCS:
        blocks = fences(doc)
        for n, (line, lang, text) in enumerate(blocks):
            if lang != "bash":
                continue
            follows = blocks[n + 1] if n + 1 < len(blocks) and not blocks[n + 1][1] else None
            shown = follows[2].splitlines() if follows and follows[2].startswith(("verdict:", "config error:")) else []
            for words in commands(text):
                if words[:2] == ["make", "memory"]:
                    var = dict(option_and_value(w) for w in words[2:] if option_and_value(w)[0] in ("RECIPE", "CONFIG", "ARGS"))
                    args = ["--recipe", var["RECIPE"]] + (["--config", var["CONFIG"]] if "CONFIG" in var else [])
                    args += shlex.split(var.get("ARGS", ""))
                elif words[:2] == ["python", "tools/memory.py"] and "--measure" not in words:
                    args = words[2:]
                else:
                    continue
                examples.append((f"{doc.relative_to(REPO)}:{line}", args, shown))
    return examples


def run_memory_tool(args: list[str], capsys) -> tuple[int, list[str]]:
    import importlib.util
    spec = importlib.util.spec_from_file_location("memory_tool", REPO / "tools/memory.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    code = tool.main(args)
    out = capsys.readouterr()
    return code, [line.rstrip() for line in (out.out + out.err).splitlines()]


EXAMPLES = memory_examples()


def test_the_docs_show_memory_examples_with_their_output():
    assert len(EXAMPLES) >= 4 and sum(bool(shown) for _, _, shown in EXAMPLES) >= 4, EXAMPLES


@pytest.mark.parametrize("where,args,shown", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_a_memory_example_prints_what_the_docs_show_and_what_fits_passes_preflight(where, args, shown, capsys):
    """The planner on the docs' own command line prints the output the docs show (a verdict, or the one
    config error line a launch would print); a configuration it plans as fitting passes a launch's
    preflight, so the docs never show a plan that training refuses."""
    from bert_recipes.backends.plan import LaunchPlan
    from bert_recipes.config import load_config
    from bert_recipes.preflight import launch_plan, preflight

    code, printed = run_memory_tool(args, capsys)
    for line in shown:
        assert line.rstrip() in printed, (where, line, printed[-12:])
    refused = any(line.startswith("config error:") for line in shown)
    assert code == (2 if refused else 0), (where, printed[-5:])
    if code == 0:
        verdict = next(line for line in printed if line.startswith("verdict:"))
        assert verdict.startswith(("verdict: fits", "verdict: does NOT fit")), verdict
        pairs, overrides, words = {}, [], iter(args)
        for word in words:   # the tool's own options take a value; the rest are --section.key=value
            if "=" in word:
                overrides.append(word)
            else:
                pairs[word] = next(words)
        if "--precision" in pairs:
            overrides.append(f"train.mixed_precision={pairs['--precision']}")
        plan = launch_plan(pairs["--config"]) if "--config" in pairs else LaunchPlan(on_gpu=False)
        world = int(pairs.get("--world", plan.num_processes or 1))
        cfg = load_config(REPO / pairs["--recipe"], overrides)
        if cfg.checkpoint.init_from and not (REPO / cfg.checkpoint.init_from).exists():
            cfg.checkpoint.init_from = None   # a later phase: its source run is not on this machine (the shape is
            cfg.checkpoint.init_optimizer = False   # the recipe's own model fields, which the planner reads)
        preflight(cfg, plan, world)   # raises ConfigError if refused
