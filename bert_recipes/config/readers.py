"""The files users write, read: recipes, overrides, accelerate configs and DeepSpeed JSONs, and the one
error a config problem is (ConfigError). The ground floor of the config package: it imports nothing else
of bert_recipes, so any module may import it without an import circle.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message names the key."""


def first_line(err: BaseException) -> str:
    """An exception's message in one line, for messages that quote a library's error."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# ---------------------------------------------------------------------------- the files users write
# Recipes, overrides, accelerate configs and DeepSpeed JSONs. PyYAML and json keep the last of a key written
# twice in one mapping, without a word: the run then goes ahead on a value the user may have meant to replace.
_MERGE_TAG = "tag:yaml.org,2002:merge"


def load_yaml(text: str, where: str):
    """yaml.safe_load(text), refusing a key written twice in one mapping: one line naming the key, its two
    lines and `where` (e.g. "recipe recipes/x.yaml"). YAML's `<<` merge keys stay allowed: a key that
    replaces a merged one is what merging is for. Parse errors are yaml.YAMLError, as from safe_load."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    twice = _yaml_twice(node, "", set()) if node is not None else None
    if twice:
        key, first, second = twice
        raise ConfigError(f"{where}: key '{key}' is written twice (lines {first} and {second}); YAML would keep only "
                          "the last one, in silence: remove one of them")
    return yaml.safe_load(text)


def _yaml_twice(node, path: str, seen: set) -> tuple[str, int, int] | None:
    """The first key written twice in one mapping below `node`: (dotted key, line, line)."""
    if id(node) in seen:   # an alias: checked where its anchor is
        return None
    seen.add(id(node))
    children = []
    if isinstance(node, yaml.MappingNode):
        lines: dict = {}
        for key, value in node.value:
            if key.tag == _MERGE_TAG:
                children.append((value, path))
                continue
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name is not None and (key.tag, name) in lines:
                return f"{path}{name}", lines[(key.tag, name)], key.start_mark.line + 1
            lines[(key.tag, name)] = key.start_mark.line + 1
            children.append((value, f"{path}{name}."))
    elif isinstance(node, yaml.SequenceNode):
        children = [(item, path) for item in node.value]
    for child, child_path in children:
        twice = _yaml_twice(child, child_path, seen)
        if twice:
            return twice
    return None


def load_json(text: str, where: str):
    """json.loads(text), refusing a key written twice in one object (json and DeepSpeed's own check give no
    position: json_twice scans for the lines). JSON errors are json.JSONDecodeError, as from json.loads."""
    import json
    data = json.loads(text)
    twice = json_twice(text)
    if twice:
        key, first, second = twice
        raise ConfigError(f"{where}: key '{key}' is written twice (lines {first} and {second}); JSON would keep only "
                          "the last one, in silence: remove one of them")
    return data


def json_twice(text: str) -> tuple[str, int, int] | None:
    """The first key written twice in one object of a valid JSON text: (dotted key, line, line). A small
    scanner: strings (with their escapes), the nesting of objects and arrays, and which string was a key."""
    import json
    frames: list[dict] = []   # per open container: {"keys": {key: line} or None for an array, "path", "key"}
    line, i, last = 1, 0, None
    while i < len(text):
        ch = text[i]
        if ch == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            last, i = json.loads(text[i:j + 1]), j + 1
            continue
        if ch == "\n":
            line += 1
        elif ch in "{[":
            parent = frames[-1] if frames else None
            path = "" if parent is None else parent["path"] + (f"{parent['key']}." if parent["keys"] is not None else "")
            frames.append({"keys": {} if ch == "{" else None, "path": path, "key": None})
        elif ch in "}]":
            frames.pop()
        elif ch == ":" and frames and frames[-1]["keys"] is not None:
            frame = frames[-1]
            if last in frame["keys"]:
                return f"{frame['path']}{last}", frame["keys"][last], line
            frame["keys"][last], frame["key"] = line, last
        i += 1
    return None


def yaml_problem(err) -> str:
    """A YAML parse error in one line: what and where."""
    where = getattr(err, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
    return f"{getattr(err, 'problem', None) or str(err).splitlines()[0]}{at}"


def nearest_existing(path: str | Path) -> Path:
    """`path`, or its nearest parent that exists (where a run would create it), absolute."""
    return next(p for p in [Path(path).expanduser().absolute(), *Path(path).expanduser().absolute().parents]
                if p.exists())


def looks_local(name: str) -> bool:
    """A model, tokenizer or dataset name that can only be a directory: a Hub id is `name` or `org/name`."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def path_kind(path: str | Path, key: str) -> str:
    """-> "missing", "dir" or "file"; a path this user may not look into (a directory above it without
    read or search permission) is one config error line, never pathlib's PermissionError."""
    path = Path(path).expanduser()
    try:
        return "dir" if path.is_dir() else "file" if path.exists() else "missing"
    except PermissionError:
        raise ConfigError(f"{key}={path} cannot be read (permission denied): give a path this user can read") from None


def read_text(path: Path, what: str, example: str) -> str:
    """A text file the user named (`what`: recipe, DeepSpeed config), or one config error line: a directory,
    an unreadable file or one that is not text (binary) is refused. example: a file that would do."""
    if path_kind(path, what) == "dir":
        raise ConfigError(f"{what} {path} is a directory: give a file (e.g. {example})")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not a text file (its bytes are not UTF-8 text): give a file such as "
                          f"{example}") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read ({e.strerror}): give a readable file") from None
