"""The bad-input matrix generated from the config tree (bert_recipes/config/schema.py), not picked by hand: for
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
PATH_CONTEXT = {"data.prepared_dir": {"data.source": "prepared", "data.packing": False},   # packed MLM: stores
                "data.store_dir": {"data.source": "store"},
                "data.train_files": {"data.source": "files"},
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


# ----------------------------------------------------------------------------- keys written twice
# Every key of each kind of file a user writes, written twice: the recipe (YAML), the accelerate config (YAML)
# and the DeepSpeed JSON, each generated from the repository's own file of that kind.
DUPLICATED_FILES = {"recipe": "recipes/tiny-mlm.yaml", "accelerate config": "accelerate_configs/zero2.yaml",
                    "DeepSpeed config": "ds_configs/zero2.json"}


def _key_lines(kind: str, text: str) -> list[tuple[str, int]]:
    """(dotted key, 0-based line) of every key of the file that can be written twice by repeating its line:
    YAML, every key; JSON, every key whose value is on its own line (a scalar)."""
    import re

    import yaml
    if kind == "DeepSpeed config":
        out, path = [], []
        for i, line in enumerate(text.splitlines()):
            if m := re.match(r'\s*"(\w+)":\s*\{\s*$', line):
                path.append(m.group(1))
            elif m := re.match(r'\s*"(\w+)":\s*[^{\[]+?,?\s*$', line):
                out.append((".".join(path + [m.group(1)]), i))
            elif line.strip().startswith("}") and path:
                path.pop()
        return out
    found = []

    def walk(node, prefix):
        for key, value in node.value if isinstance(node, yaml.MappingNode) else []:
            found.append((f"{prefix}{key.value}", key.start_mark.line))
            walk(value, f"{prefix}{key.value}.")
    walk(yaml.compose(text), "")
    return found


def _written_twice(kind: str, text: str, line: int) -> str:
    lines = text.splitlines()
    first = lines[line] if kind != "DeepSpeed config" or lines[line].rstrip().endswith(",") else lines[line] + ","
    return "\n".join(lines[:line] + [first] + lines[line:]) + "\n"


DUPLICATE_CASES = [(kind, key, line) for kind, path in DUPLICATED_FILES.items()
                   for key, line in _key_lines(kind, (REPO / path).read_text())]


def preflight_refuses(argv: list[str], watched: Path, capsys) -> str:
    """`python -m bert_recipes.preflight` (what the Make targets run before the launch) in this process, under
    the rules of refused_in_process: exit code 2, one `config error:` line, no traceback, nothing written."""
    from bert_recipes import preflight
    from conftest import snapshot
    before = snapshot(watched)
    code = preflight.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("config error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert snapshot(watched) == before
    return lines[0]


def _accelerate_config(tmp_path: Path, data: dict | None = None, text: str | None = None, ds: Path | None = None) -> Path:
    import yaml
    path = tmp_path / "acc.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(data))
    if ds is not None:
        path.write_text(path.read_text().replace("ds_configs/zero2.json", str(ds)))
    return path


def _ds_config(tmp_path: Path, text: str, monkeypatch) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(text)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    return path


@pytest.mark.parametrize("kind, key, line", DUPLICATE_CASES, ids=[f"{k}:{key}" for k, key, _ in DUPLICATE_CASES])
def test_a_key_written_twice_is_one_line(kind, key, line, base, tmp_path, capsys, monkeypatch):
    out, args = base
    text = _written_twice(kind, (REPO / DUPLICATED_FILES[kind]).read_text(), line)
    if kind == "recipe":
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(text)
        said = refused_in_process(["--recipe", str(recipe)] + args, out, capsys)
    elif kind == "accelerate config":
        said = preflight_refuses([str(_accelerate_config(tmp_path, text=text)), "--"] + args, out, capsys)
    else:
        _ds_config(tmp_path, text, monkeypatch)
        said = refused_in_process(args, out, capsys)
    assert f"key '{key}' is written twice (lines {line + 1} and {line + 2})" in said and kind in said, said


def test_yaml_merge_keys_stay_allowed(base, tmp_path, capsys):
    """A key that replaces one a `<<` merge brought in is what merging is for: not a key written twice."""
    out, args = base
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("defaults: &d\n  lr: 1.0e-3\n  warmup_steps: 5\noptim:\n  <<: *d\n  lr: 2.0e-3\n")
    assert "defaults" in refused_in_process(["--recipe", str(recipe)] + args, out, capsys)   # the next mistake
    (tmp_path / "r2.yaml").write_text("optim: &d\n  lr: 1.0e-3\ntrain:\n  max_steps: 3\n")
    cfg = C.load_config(tmp_path / "r2.yaml")
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 3


# ----------------------------------------------------------------------------- empty labels
# (format, what is empty, the label column's kind): every way each format can leave a label out.
EMPTY_LABELS = [("csv", "an empty cell", "text"), ("csv", "an empty cell", "number"),
                ("jsonl", "null", "text"), ("jsonl", "a missing key", "text"), ("jsonl", "empty text", "text"),
                ("jsonl", "null", "number"), ("parquet", "null", "text"), ("parquet", "empty text", "text"),
                ("parquet", "NaN", "number")]


def _labelled_file(tmp: Path, fmt: str, empty: str, kind: str, empty_rows: tuple[int, ...]) -> Path:
    """A training file of 16 rows whose label is `empty` at empty_rows."""
    import json
    rows = []
    for i in range(16):
        label = ("neg", "pos")[i % 2] if kind == "text" else float(i % 2) if fmt == "parquet" else i % 2
        row = {"text": f"sentence number {i}", "label": label}
        if i in empty_rows:
            if empty == "a missing key":
                del row["label"]
            else:
                row["label"] = {"null": None, "empty text": "", "NaN": float("nan"), "an empty cell": None}[empty]
        rows.append(row)
    path = tmp / f"train.{fmt}"
    if fmt == "csv":
        path.write_text("text,label\n" + "".join(f"{r['text']},{'' if r['label'] is None else r['label']}\n"
                                                 for r in rows))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt, empty, kind", EMPTY_LABELS, ids=[f"{f}-{e}-{k}" for f, e, k in EMPTY_LABELS])
def test_an_empty_label_is_one_line(fmt, empty, kind, base, tmp_path, capsys):
    out, args = base
    train = _labelled_file(tmp_path, fmt, empty, kind, (3, 10))
    valid = _labelled_file(tmp_path / "v", fmt, "null", kind, ()) if (tmp_path / "v").mkdir() is None else None
    names = ["--task.label_names=[neg, pos]"] if kind == "text" else []
    argv = args + ["--task.kind=classification", "--task.num_labels=2", "--data.source=files",
                   f"--data.train_files=[{train}]", f"--data.validation_files=[{valid}]", *names]
    line = refused_in_process(argv, out, capsys)
    assert "data.label_column 'label' of the train split has 2 empty labels (rows 3, 10;" in line, line


# ----------------------------------------------------------------------------- places the run writes, read-only
# Every place the run writes: the path keys it writes into (config.PATH_KEYS), the datasets library's own cache
# when data.cache_dir is unset, and a DeepSpeed JSON's NVMe path; each on a read-only mount and on /proc.
WRITTEN = [key for key, kind in C.PATH_KEYS.items() if kind == "write dir"] + ["HF_HOME", "nvme_path"]
WRITTEN_CASES = [(key, where) for key in WRITTEN for where in ("read-only mount", "proc")]


@pytest.mark.parametrize("key, where", WRITTEN_CASES, ids=[f"{k}-{w}" for k, w in WRITTEN_CASES])
def test_a_place_the_run_cannot_write_is_one_line(key, where, base, tmpfs, tmp_path, capsys, monkeypatch):
    import json
    out, args = base
    place = tmpfs(1 << 20, read_only=True) if where == "read-only mount" else Path("/proc")
    target = place if key == "nvme_path" else place / "bert-recipes"
    if key == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(target))
        monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
        args = args + ["--data.cache_dir=null"]
    elif key == "nvme_path":
        ds = json.loads((REPO / "ds_configs/zero3_nvme.json").read_text())
        for section in ("offload_optimizer", "offload_param"):
            if isinstance(ds["zero_optimization"].get(section), dict) and "nvme_path" in ds["zero_optimization"][section]:
                ds["zero_optimization"][section]["nvme_path"] = str(target)
        _ds_config(tmp_path, json.dumps(ds), monkeypatch)
    else:
        args = args + [f"--{key}={target}"]
    watched = target if key == "run.output_dir" else out
    line = refused_in_process(args, watched, capsys)
    said = "it is mounted read-only" if where == "read-only mount" else "it is on a proc filesystem"
    assert said in line and (key in line or key == "HF_HOME" and "data.cache_dir is unset" in line), line


# ----------------------------------------------------------------------------- values the libraries refuse
def _ds_enum_fields() -> list[tuple[str, type]]:
    """Every enum-valued field of the DeepSpeed JSON sections checked before the launch
    (backends/plan._ds_sections), from DeepSpeed's own pydantic models, nested ones included."""
    import enum

    from pydantic import BaseModel
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    def fields(model, prefix):
        out = []
        for name, field in model.model_fields.items():
            for arg in [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]:
                if isinstance(arg, type) and issubclass(arg, enum.Enum):
                    out.append((prefix + (field.alias or name), arg))
                elif isinstance(arg, type) and issubclass(arg, BaseModel):
                    out += fields(arg, prefix + (field.alias or name) + ".")
        return out
    return (fields(DeepSpeedZeroConfig, "zero_optimization.") + fields(DeepSpeedBF16Config, "bf16.")
            + fields(DeepSpeedFP16Config, "fp16."))


def _accelerate_enum_fields() -> list[str]:
    """Every enum-valued field of Accelerate's cluster config, plus the ones `accelerate launch` reads as enums
    (mixed_precision, dynamo_config.dynamo_backend): backends/plan.ACCELERATE_ENUMS must name each."""
    import enum

    from accelerate.commands.config.config_args import ClusterConfig
    from bert_recipes.backends.plan import ACCELERATE_ENUMS
    typed = {name for name, tp in typing.get_type_hints(ClusterConfig).items()
             if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in typing.get_args(tp) or [tp])}
    assert typed <= set(ACCELERATE_ENUMS.values()), typed - set(ACCELERATE_ENUMS.values())
    return sorted(set(ACCELERATE_ENUMS.values()))


def _set_bogus(data: dict, field: str) -> None:
    """data's dotted `field` set to "bogus", its parent mappings made where missing."""
    *parents, name = field.split(".")
    for parent in parents:
        data = data.setdefault(parent, {})
    data[name] = "bogus"


@pytest.mark.parametrize("field", _accelerate_enum_fields())
def test_an_accelerate_value_accelerate_refuses_is_one_line(field, base, tmp_path, capsys):
    import yaml
    out, args = base
    data = yaml.safe_load((REPO / "accelerate_configs/zero2.yaml").read_text())
    _set_bogus(data, field)
    line = preflight_refuses([str(_accelerate_config(tmp_path, data, ds=REPO / "ds_configs/zero2.json")), "--"] + args,
                             out, capsys)
    assert f"{field}='bogus' is refused by Accelerate; use one of" in line, line


DS_ENUM_FIELDS = _ds_enum_fields()


@pytest.mark.parametrize("field", [f for f, _ in DS_ENUM_FIELDS])
def test_a_deepspeed_value_deepspeed_refuses_is_one_line(field, base, tmp_path, capsys, monkeypatch):
    import json
    out, args = base
    ds = json.loads((REPO / "ds_configs/zero2.json").read_text())
    _set_bogus(ds, field)
    path = _ds_config(tmp_path, json.dumps(ds), monkeypatch)
    line = refused_in_process(args, out, capsys)
    assert f"DeepSpeed config {path}: {field}='bogus' is refused by DeepSpeed (" in line, line


# ----------------------------------------------------------------------------- names the OS refuses
# Every path key (config.PATH_KEYS) with a component over its filesystem's name limit, and with a whole path over
# the path limit (os.pathconf): one line before anything is created, never `OSError: [Errno 36] File name too long`.
NAME_CASES = [(key, too) for key in C.PATH_KEYS if key != "recipe" for too in ("component", "path")]


@pytest.mark.parametrize("key, too", NAME_CASES, ids=[f"{k}-{t}" for k, t in NAME_CASES])
def test_a_name_the_os_refuses_is_one_line(key, too, base, tmp_path, capsys):
    out, args = base
    name_max, path_max = os.pathconf(tmp_path, "PC_NAME_MAX"), os.pathconf(tmp_path, "PC_PATH_MAX")
    if too == "component":
        path = tmp_path / ("n" * (name_max + 1)) / "run"
    else:   # every component allowed, the whole too long
        path = tmp_path.joinpath(*["p" * 200] * (path_max // 201 + 1))
    train_file = tmp_path / "train.txt"
    train_file.write_text("".join(f"line {i} of some text to train on\n" for i in range(400)))
    extra = {k: str(v).format(train_file=train_file) for k, v in PATH_CONTEXT.get(key, {}).items()}
    value = f"[{path}]" if C.PATH_KEYS[key] == "read files" else str(path)
    argv = args + [f"--{k}={v}" for k, v in extra.items()] + [f"--{key}={value}"]
    line = refused_in_process(argv, tmp_path, capsys)   # nothing created anywhere under tmp_path
    assert line.startswith(f"config error: {key}={path}: ") and "give a shorter" in line, line[:300]
    assert ("PC_NAME_MAX" if too == "component" else "PC_PATH_MAX") in line, line[:300]


def test_an_os_error_creating_a_place_is_one_line(base, tmp_path, capsys):
    """What no check foresees (here a directory named `config.yaml` where the run writes its resolved config):
    the OSError from creating the place is one line naming the key and the path (places.creating)."""
    out, args = base
    out.mkdir()
    (out / "config.yaml").mkdir()
    code, err = __import__("conftest").run_cli_in_process(args, capsys)
    lines = [line for line in err.splitlines() if line.startswith("config error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"config error: run.output_dir={out}: cannot be created") and "config.yaml" in lines[0]
