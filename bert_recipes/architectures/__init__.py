"""The encoder architectures a recipe builds (model.architecture): a row each here, and a file each beside this one
(bert.py, modernbert.py) holding its config from the recipe's fields, its training classes (the shared forward is
modeling.RecipeMaskedLM's) and its terms for the memory planner and the MFU. A third architecture is one file and
one row. No torch at import time: config validation reads the rows before a launch."""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One row: model_type, the transformers config's (a checkpoint of this type builds this architecture);
    own_fields, the model.* recipe fields only this architecture has (set under another: one line, never ignored);
    layer_class, its encoder layer (FSDP's unit, accelerate_configs/fsdp.yaml); attention_dropout, its default
    (a fresh config's, or a checkpoint's that does not say); title, for lines; position_weights, whether
    max_position_embeddings shapes a weight (BERT's learned positions; RoPE has none, so a later phase may grow it)."""
    model_type: str
    own_fields: tuple[str, ...]
    layer_class: str
    attention_dropout: float
    title: str
    position_weights: bool


ARCHITECTURES = {
    "bert": Architecture("bert", ("hidden_dropout_prob",), "BertLayer", 0.1, "BERT", True),
    "modernbert": Architecture("modernbert", ("local_attention", "global_attn_every_n_layers", "global_rope_theta",
                                              "local_rope_theta"), "ModernBertEncoderLayer", 0.0, "ModernBERT", False),
}


def module(name: str):
    """The architecture's file (bert_recipes/architectures/<name>.py): imported on first use (it imports torch)."""
    return importlib.import_module(f".{name}", __name__)


def of_model_type(model_type: str) -> str | None:
    """The architecture that builds a checkpoint of this model_type (None: none here)."""
    return next((name for name, row in ARCHITECTURES.items() if row.model_type == model_type), None)


def of_config(config) -> str:
    """The architecture of a transformers config (bert for any other model_type: a classifier from the Hub keeps
    BERT's planner terms, as before there were two)."""
    return of_model_type(getattr(config, "model_type", "bert")) or "bert"


def misplaced_field(architecture: str, model) -> str | None:
    """The first model.* field set in the recipe that belongs to another architecture -> one line (None: none)."""
    for other, row in ARCHITECTURES.items():
        for key in row.own_fields:
            if other != architecture and key not in ARCHITECTURES[architecture].own_fields \
                    and getattr(model, key, None) is not None:
                return (f"model.{key}={getattr(model, key)} is {row.title}'s; model.architecture={architecture} has no "
                        f"such field: remove it (or set model.architecture={other})")
    return None
