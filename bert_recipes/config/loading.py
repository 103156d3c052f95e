"""Loading a config: defaults < recipe < `--section.key=value` overrides, and nothing else.

Unknown keys and wrong types are errors that name the key. Also the config written out: to_dict,
to_yaml (the resolved recipe beside every checkpoint), flat_dict (trackers' hparams).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from .readers import ConfigError, load_yaml, path_kind, read_text, yaml_problem
from .schema import Config


# ---------------------------------------------------------------------------- typing
def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; ints are accepted where a float is expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        kinds = [f"one of {list(typing.get_args(a))}" if typing.get_origin(a) is Literal else getattr(a, "__name__", str(a))
                 for a in args if a is not type(None)] + (["null"] if type(None) in args else [])
        raise ConfigError(f"{key}: expected {' or '.join(kinds)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("no" if value is False else "yes") in choices:
            value = "no" if value is False else "yes"   # YAML 1.1 reads a bare `no` as false
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):   # an item of a list of mappings (data.mixture)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {', '.join(_hints(tp))}, got {type(value).__name__} {value!r}")
        item = tp()
        _merge(item, value, f"{key}.")
        return item
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):   # PyYAML reads 1e-4 (no dot) as text
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
        if tp is str and isinstance(value, bool):   # YAML 1.1 reads a bare no/yes/on/off as a boolean
            raise ConfigError(f"{key}: YAML read this text as the boolean {value}; quote it (e.g. 'no', 'yes')")
    else:
        raise TypeError(f"unsupported annotation {tp} for {key}")
    raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _merge(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {data!r}")
    hints = _hints(type(obj))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            valid = ", ".join(hints)
            raise ConfigError(f"unknown key '{path}' (valid keys here: {valid})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _merge(getattr(obj, key), value, f"{path}.")
        else:
            setattr(obj, key, _coerce(value, tp, path))


def _field_type(dotted: str) -> Any:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"override '{dotted}' must look like section.key (e.g. train.max_steps)")
    section, key = parts
    sections = _hints(Config)
    if section not in sections:
        raise ConfigError(f"unknown key '{dotted}' (sections: {', '.join(sections)})")
    keys = _hints(sections[section])
    if key not in keys:
        raise ConfigError(f"unknown key '{dotted}' (valid keys here: {', '.join(keys)})")
    return keys[key]


def set_key(cfg: Config, dotted: str, raw: str) -> None:
    """Apply one `section.key=value` override. Values are parsed as YAML ('1e-4', 'null',
    '[a, b]'), except that a text field takes the text as written (run.name=007 stays '007')."""
    tp = _field_type(dotted)
    text_field = tp is str or tp == Optional[str]
    if text_field:
        value = None if (tp != str and raw in ("null", "None", "~")) else raw
    else:
        try:
            value = load_yaml(raw, f"override {dotted}={raw!r}")
        except yaml.YAMLError as e:
            raise ConfigError(f"override {dotted}={raw!r} is not valid YAML: {yaml_problem(e)}") from None
    section, key = dotted.split(".")
    _merge(cfg, {section: {key: value}})


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    cfg = Config()
    if recipe is not None:
        path = Path(recipe)
        if path_kind(path, "recipe") == "missing":
            raise ConfigError(f"recipe not found: {path}")
        try:
            data = load_yaml(read_text(path, "recipe", "recipes/tiny-mlm.yaml"), f"recipe {path}")
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path} is not valid YAML: {yaml_problem(e)}") from None
        if data is None:
            raise ConfigError(f"recipe {path} is empty: give its sections (see recipes/), or leave out --recipe "
                              "to start from the defaults")
        _merge(cfg, data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        key, raw = item.split("=", 1)
        set_key(cfg, key.lstrip("-"), raw)
    if cfg.optim.max_grad_norm is None:   # unset: the optimizer's own (schema: OptimConfig.max_grad_norm)
        cfg.optim.max_grad_norm = 0.0 if cfg.optim.name == "stable_adamw" else 1.0
    return cfg


def parse_train_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    """train.py's command line (also read by bert_recipes.preflight): --recipe, --resume, --profile,
    --print-config and --section.key=value overrides. -> (config, print the config and exit?)"""
    import argparse
    parser = argparse.ArgumentParser(prog="train.py", description="Pretrain (masked LM) or fine-tune (sequence "
                                     "classification) BERT with Hugging Face Accelerate.",
                                     epilog="Any setting can be overridden as --section.key=value, "
                                            "e.g. --train.max_steps=100 --optim.lr=3e-4")
    parser.add_argument("--recipe", help="recipe YAML (see recipes/)")
    parser.add_argument("--resume", help="shorthand for --checkpoint.resume: 'auto' or a checkpoint directory")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--profile", action="store_true", help="shorthand for --logging.profile=true")
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(f"unrecognized argument {item!r}: overrides look like --section.key=value "
                              "(e.g. --train.max_steps=100)")
        overrides.append(item[2:])
    if args.resume:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.profile:
        overrides.append("logging.profile=true")
    return load_config(args.recipe, overrides), args.print_config


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flat_dict(cfg: Config) -> dict[str, Any]:
    """section/key -> scalar (lists and None as strings), as trackers' hparams want it."""
    out = {}
    for section, values in to_dict(cfg).items():
        for key, v in values.items():
            out[f"{section}/{key}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
