"""The encoder architectures a recipe builds (model.architecture): a row each here, and a file each beside this one
(bert.py, modernbert.py) holding its config from the recipe's fields, its training classes (the shared forward is
modeling.RecipeMaskedLM's) and its terms for the memory planner and the MFU. A third architecture is one file and
one row. No torch at import time: config validation reads the rows before a launch, and which architecture a
checkpoint is (its config.json's model_type: of_checkpoint), which is model.architecture's default."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..config.readers import looks_local


@dataclass(frozen=True)
class Architecture:
    """One row: model_type, the transformers config's (a checkpoint of this type builds this architecture);
    own_fields, the model.* recipe fields only this architecture has (set under another: one line, never ignored);
    layer_class, its encoder layer (FSDP's unit, accelerate_configs/fsdp.yaml); attention_dropout, its default
    (a fresh config's, or a checkpoint's that does not say); title, for lines; position_weights, whether
    max_position_embeddings shapes a weight (BERT's learned positions; RoPE has none, so a later phase may grow it);
    special_ids, the tokenizer's special ids its fresh config takes (modeling.special_token_ids' keys);
    divisible, the model.* pairs (a, b) of a fresh model where a must be a multiple of b (one line in config
    validation otherwise); shape_fields, its own model.* fields that shape a weight, which a resumed checkpoint must
    match beside the shared ones (checkpoint.shape_keys)."""
    model_type: str
    own_fields: tuple[str, ...]
    layer_class: str
    attention_dropout: float
    title: str
    position_weights: bool
    special_ids: tuple[str, ...] = ("pad_token_id",)
    divisible: tuple[tuple[str, str], ...] = (("hidden_size", "num_attention_heads"),)
    shape_fields: tuple[str, ...] = ()


ARCHITECTURES = {
    "bert": Architecture("bert", ("hidden_dropout_prob",), "BertLayer", 0.1, "BERT", True),
    "modernbert": Architecture("modernbert", ("local_attention", "global_attn_every_n_layers", "global_rope_theta",
                                              "local_rope_theta", "attention_output_dropout"), "ModernBertEncoderLayer", 0.0, "ModernBERT", False,
                               special_ids=("pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id",
                                            "eos_token_id")),   # its defaults, 50281-50283, lie past a small vocabulary
}


def module(name: str | None):
    """The architecture's file (bert_recipes/architectures/<name>.py): imported on first use (it imports torch).
    None: bert's, a fresh model's default (a ModelConfig built in code, which no config.validate resolved)."""
    return importlib.import_module(f".{name or 'bert'}", __name__)


def of_model_type(model_type: str) -> str | None:
    """The architecture that builds a checkpoint of this model_type (None: none here)."""
    return next((name for name, row in ARCHITECTURES.items() if row.model_type == model_type), None)


def of_config(config) -> str:
    """The architecture of a transformers config (bert for any other model_type: a classifier from the Hub keeps
    BERT's planner terms, as before there were two)."""
    return of_model_type(getattr(config, "model_type", "bert")) or "bert"


def of_checkpoint(name_or_path: str) -> str:
    """The model_type of a checkpoint (model.name_or_path), as its config.json says: a local directory's, or a Hub
    model's through huggingface_hub (its cache, then the Hub; offline, the cache only; 0.1 s to import where
    transformers takes 1.6). OSError or ValueError where it cannot be read (a directory not written yet, the Hub out
    of reach)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    elif looks_local(name_or_path):
        raise FileNotFoundError(f"no such directory: {name_or_path}")
    else:
        from huggingface_hub import hf_hub_download
        path = Path(hf_hub_download(name_or_path, "config.json"))
    config = json.loads(path.read_text())
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{name_or_path}'s config.json names no model_type")
    return config["model_type"]


def of_run(init_from: str) -> str | None:
    """The model.architecture a run trained (checkpoint.init_from: its output_dir, or one of its checkpoints), as
    the config.yaml there says (each run and each checkpoint saves its resolved config; one saved before
    model.architecture existed holds a BERT): a phase's default. None where there is none yet (a phase validated
    before the run it starts from): phases.resolve_init's line comes with the run's path checks."""
    import yaml
    path = Path(init_from).expanduser()
    try:   # its latest checkpoint's (what the phase loads), else the run's own
        saved_with = [c.parent / "config.yaml" for c in sorted(path.glob("checkpoints/step_*/train_state.json"))]
        saved = yaml.safe_load((saved_with[-1] if saved_with else path / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):   # not there, unreadable: the path checks say so
        return None
    model = saved.get("model") if isinstance(saved, dict) else None
    return (model.get("architecture") if isinstance(model, dict) else None) or "bert"


def foreign_field(architecture: str, model) -> tuple[str, object, str] | None:
    """The first model.* field set in `model` (a ModelConfig) that only another architecture has -> (its key, its
    value, that architecture's name); None: none."""
    for other, row in ARCHITECTURES.items():
        for key in row.own_fields:
            if other != architecture and key not in ARCHITECTURES[architecture].own_fields \
                    and getattr(model, key, None) is not None:
                return key, getattr(model, key), other
    return None


def of_fields(model) -> str | None:
    """The architecture whose own fields (model.local_attention, ...) the recipe sets; None where it sets none."""
    return next((name for name, row in ARCHITECTURES.items()
                 if any(getattr(model, key, None) is not None for key in row.own_fields)), None)


def misplaced_field(architecture: str, model) -> str | None:
    """The first model.* field set in the recipe that belongs to another architecture -> one line (None: none)."""
    found = foreign_field(architecture, model)
    if found is None:
        return None
    key, value, other = found
    return (f"model.{key}={value} is {ARCHITECTURES[other].title}'s; model.architecture={architecture} has no "
            f"such field: remove it (or set model.architecture={other})")
