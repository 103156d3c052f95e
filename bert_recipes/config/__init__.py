"""The config: one typed dataclass tree holds every setting and its default. Recipe YAML sections map
onto it one to one. Precedence: defaults < recipe < `--section.key=value` overrides.

A file per role, and every name importable from here (`from bert_recipes.config import X`):
- schema.py: the tree (the section dataclasses), each field's docstring and range (`Range`, `_RANGES`);
- loading.py: defaults < recipe < overrides (`load_config`, `set_key`, `parse_train_args`), and the
  config written out (`to_dict`, `to_yaml`, `flat_dict`); unknown keys and wrong types name the key;
- rules.py: relations between values, checked up front with the numbers in the message (`validate`,
  `resolve`, the batch arithmetic `grad_accum_steps` / `optimizer_steps`, `schedule_warnings`), `PATH_KEYS`;
- readers.py: the ground floor: YAML / JSON of users' files with the duplicate-key checks, paths,
  `ConfigError`. It imports nothing else of bert_recipes, so any module can import it.
"""
from .loading import _coerce, _field_type, _hints, _merge, flat_dict, load_config, parse_train_args, set_key, to_dict, to_yaml
from .readers import (ConfigError, _yaml_twice, first_line, json_twice, load_json, load_yaml, looks_local, nearest_existing,
                      path_kind, read_text, yaml_problem)
from .rules import (PATH_KEYS, check_mask_rate, documents_attend_apart, grad_accum_steps, optimizer_steps, packed_dropout_here,
                    padded_batches, predictions_per_seq, repeating_shapes, resolve, schedule_warnings, validate)
from .schema import (_RANGES, POSITIVE, CheckpointConfig, Config, DataConfig, LoggingConfig, MixtureSource, ModelConfig, OptimConfig,
                     Range, RunConfig, TaskConfig, TokenizerConfig, TrainConfig, ranged)

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig", "MixtureSource", "ModelConfig", "OptimConfig", "PATH_KEYS",
    "POSITIVE", "Range", "RunConfig", "TaskConfig", "TokenizerConfig", "TrainConfig", "check_mask_rate", "documents_attend_apart",
    "first_line", "flat_dict",
    "grad_accum_steps", "json_twice", "load_config", "load_json", "load_yaml", "nearest_existing", "optimizer_steps",
    "packed_dropout_here", "padded_batches", "parse_train_args", "path_kind", "predictions_per_seq", "ranged",
    "read_text", "repeating_shapes", "resolve", "schedule_warnings", "set_key", "to_dict", "to_yaml", "validate",
    "yaml_problem", "_RANGES", "_coerce", "_field_type", "_hints", "_merge", "_yaml_twice",
]
