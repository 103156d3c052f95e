"""The bad-input matrix generated from the config tree (bert_recipes/config.py), not picked by hand: for
every key of every section a value of the wrong type; for every range (config._RANGES) a value just
outside it at each end; for every path-valued key (config.PATH_KEYS) and train.py's --recipe, a missing
path and a path of the wrong kind (a directory for a file, a file for a directory), and an unreadable one
where the suite does not run as root (root reads everything). Each case runs train.py's command line
in this process (train.run_cli) under the rules of tests/test_bad_input.py: exit code 2, one `config
error:` line that names the key and the value, no traceback, nothing written. A sample runs as
`python train.py` processes. The hand-picked cases (relations between keys, data, checkpoints,
launch files) stay in tests/test_bad_input.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from bert_recipes import config as C
from conftest import REPO, refused_in_process, tiny_args

# Number-valued keys without a range, and why (reviewed: a new number key must get a range or a line here).
NO_RANGE: dict[str, str] = {}


def config_keys() -> dict[str, typing.Any]:
    """{section.key: annotation} of the whole tree."""
    return {f"{section}.{key}": tp for section, cls in typing.get_type_hints(C.Config).items()
            for key, tp in typing.get_type_hints(cls).items()}


def _kinds(tp) -> list:
    return [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]


def wrong_type(key: str, tp) -> tuple[str, object] | None:
    """-> (how, value): an override the command line passes as YAML, or a recipe value (text keys, whose
    override takes any text as written)."""
    kinds = _kinds(tp)
    origin = typing.get_origin(kinds[0])
    if kinds[0] is bool:
        return "override", "maybe"
    if origin is list:
        return ("override", "[a, b]") if typing.get_args(kinds[0])[0] is float else ("override", "5")
    if kinds[0] is int or origin is typing.Literal or kinds[0] is float:
        return "override", "bogus"
    assert kinds == [str], (key, tp)
    return "recipe", [1, 2]


def outside(rule: C.Range, tp) -> list:
    """Values just outside the range, one at each bounded end."""
    whole = int in _kinds(tp)
    step = 1 if whole else 1e-3
    values = []
    if rule.low is not None:
        values.append(rule.low if rule.open_low else rule.low - step)
    if rule.high is not None:
        values.append(rule.high if rule.open_high else rule.high + step)
    if rule.items is not None:   # a list: one value too few, then each end inside a list of the right length
        return [[0.9], *([v] * rule.items for v in values)]
    return [int(v) if whole else v for v in values]


TYPE_CASES = [(key, *wrong_type(key, tp)) for key, tp in config_keys().items()]
RANGE_CASES = [(rule.key, value) for rule in C._RANGES for value in outside(rule, config_keys()[rule.key])]


def test_every_number_key_has_a_range_or_a_reason():
    ranged = {rule.key for rule in C._RANGES}
    numbers = {key for key, tp in config_keys().items() if {int, float} & set(_kinds(tp)) and bool not in _kinds(tp)}
    assert numbers - ranged - set(NO_RANGE) == set()
    assert set(NO_RANGE) <= numbers - ranged   # no stale reason
    assert ranged <= set(config_keys()), ranged - set(config_keys())


@pytest.fixture
def base(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    out = tmp_path / "out"
    return out, [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache,
                                               **{"tokenizer.name_or_path": shared_tokenizer})]


def _said(how: str, value) -> str:
    """What the line must quote of the wrong value: the value as the config read it, with its type."""
    if how == "recipe":
        return f"got list {value}"
    return {"5": "got int 5", "[a, b]": "got str 'a'"}.get(value, f"'{value}'")


@pytest.mark.parametrize("key, how, value", TYPE_CASES, ids=[c[0] for c in TYPE_CASES])
def test_a_value_of_the_wrong_type_is_one_line(key, how, value, base, tmp_path, capsys):
    out, args = base
    if how == "override":
        argv = args + [f"--{key}={value}"]
    else:
        section, name = key.split(".")
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"{section}:\n  {name}: {value}\n")
        argv = ["--recipe", str(recipe)] + args
    line = refused_in_process(argv, out, capsys)
    assert key in line and _said(how, value) in line, line


@pytest.mark.parametrize("key, value", RANGE_CASES, ids=[f"{k}={v}" for k, v in RANGE_CASES])
def test_a_value_outside_its_range_is_one_line(key, value, base, capsys):
    out, args = base
    shown = "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else value
    line = refused_in_process(args + [f"--{key}={shown}"], out, capsys)
    read = C._coerce(value, config_keys()[key], key)   # as the config holds it: 0 -> 0.0 for a float key
    rule = next(r for r in C._RANGES if r.key == key)
    assert f"config error: {key}={read} is not allowed: it must be {rule.must()}" == line, line


# ----------------------------------------------------------------------------- paths
def _path_cases() -> list[tuple[str, str, dict]]:
    """(key, wrong, context): wrong is missing / a file (for a directory) / a directory (for a file) /
    unreadable; context: the other keys that make the run read this path."""
    cases = []
    for key, kind in C.PATH_KEYS.items():
        context = PATH_CONTEXT.get(key, {})
        wrongs = {"read dir": ["missing", "file"], "read dir or hub": ["missing", "file"],
                  "write dir": ["file", "below a file"], "read files": ["missing", "directory"],
                  "read file": ["missing", "directory"]}[kind]
        if os.geteuid() != 0 and kind.startswith("read"):
            wrongs.append("unreadable")
        cases += [(key, wrong, context) for wrong in wrongs]
    return cases


# the other keys under which the run reads a path
PATH_CONTEXT = {"data.prepared_dir": {"data.source": "prepared"}, "data.train_files": {"data.source": "files"},
                "data.validation_files": {"data.source": "files", "data.train_files": "[{train_file}]"}}
PATH_CASES = _path_cases()


def _wrong_path(tmp: Path, wrong: str, kind: str) -> Path:
    if wrong == "missing":
        return tmp / "no" / "such"
    if wrong in ("file", "below a file"):
        (tmp / "a_file").write_text("not a directory\n")
        return tmp / "a_file" / "run" if wrong == "below a file" else tmp / "a_file"
    if wrong == "directory":
        (tmp / "a_dir").mkdir()
        return tmp / "a_dir"
    locked = tmp / "locked"
    locked.mkdir()
    (locked / "train.txt").write_text("text\n")
    locked.chmod(0)
    return locked / "train.txt" if kind in ("read files", "read file") else locked


@pytest.mark.parametrize("key, wrong, context", PATH_CASES, ids=[f"{k}-{w}" for k, w, _ in PATH_CASES])
def test_a_path_that_cannot_serve_its_key_is_one_line(key, wrong, context, base, tmp_path, capsys):
    out, args = base
    path = _wrong_path(tmp_path, wrong, C.PATH_KEYS[key])
    train_file = tmp_path / "train.txt"
    train_file.write_text("".join(f"line {i} of some text to train on\n" for i in range(400)))
    extra = {k: str(v).format(train_file=train_file) for k, v in context.items()}
    value = f"[{path}]" if C.PATH_KEYS[key] == "read files" else str(path)
    if key == "recipe":
        argv = ["--recipe", value] + args
    else:
        argv = args + [f"--{k}={v}" for k, v in extra.items()] + [f"--{key}={value}"]
    if key == "run.output_dir":
        out = path
    line = refused_in_process(argv, out, capsys)
    assert key in line and str(path) in line, line
    said = {"file": ["is a file"], "below a file": ["is a file"], "directory": ["is a directory"],
            "unreadable": ["cannot be read"], "missing": ["not found", "no such directory", "holds no prepared data",
                                                          "not a complete checkpoint"]}[wrong]
    assert any(s in line for s in said), line


READ_KEYS = [key for key, kind in C.PATH_KEYS.items() if kind.startswith("read")]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="not root: test_a_path_that_cannot_serve_its_key_is_one_line has the unreadable cases")
@pytest.mark.parametrize("key", READ_KEYS)
def test_an_unreadable_path_is_one_line_even_for_root(key, tmp_path):
    """CI runs as root, who reads everything: the checks a launch makes first (python -m bert_recipes.preflight,
    what train.py and the Make targets run) run here without root's power to read past file modes (setpriv
    drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), on a directory of mode 000."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "train.txt").write_text("text\n")
    train = tmp_path / "train.txt"
    train.write_text("".join(f"line {i} of some text to train on\n" for i in range(400)))
    kind = C.PATH_KEYS[key]
    path = locked / "train.txt" if kind in ("read file", "read files") else locked
    args = ["--recipe", "recipes/tiny-mlm.yaml", f"--run.output_dir={tmp_path / 'out'}", "--data.source=files",
            f"--data.train_files=[{train}]"]
    if key == "recipe":
        args[1] = str(path)
    else:
        extra = {k: str(v).format(train_file=train) for k, v in PATH_CONTEXT.get(key, {}).items()}
        args += [f"--{k}={v}" for k, v in extra.items()] + [f"--{key}=" + (f"[{path}]" if kind == "read files" else str(path))]
    locked.chmod(0)
    try:
        proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
                               "bert_recipes.preflight", "accelerate_configs/cpu.yaml", "--", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        locked.chmod(0o755)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert key in lines[0] and str(path) in lines[0] and "cannot be read" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_sample_of_the_matrix_as_train_py_processes(base, tmp_path):
    """Through `python train.py` itself: a wrong type, a range and a path of the wrong kind."""
    out, args = base
    (tmp_path / "a_dir").mkdir()
    for extra, expected in ((["--train.max_steps=bogus"], "train.max_steps: expected int"),
                            (["--data.length_bins=9"], "data.length_bins=9 is not allowed"),
                            (["--recipe", str(tmp_path / "a_dir")], f"recipe {tmp_path / 'a_dir'} is a directory")):
        proc = subprocess.run([sys.executable, "train.py", *args, *extra], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not out.exists()
