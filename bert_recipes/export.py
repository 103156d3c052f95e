"""The Hugging Face export every engine writes: config.json, fp32 model.safetensors (full weights, which each
engine gathers where its backend shards them: engine.full_state_dict, the pipeline's stages), the tokenizer, the recipe and a model card; loadable with plain
from_pretrained. Written through <out>.partial and agreed on by every rank (export_agreed): a full disk is one
line, and the previous export and the checkpoints stay. Then, where checkpoint.push_to_hub asks, uploaded to the
Hub (push_to_hub)."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch
import yaml

from .architectures import ARCHITECTURES
from .config import CheckpointConfig, TaskConfig
from .disk import disk_full
from .ranks import print0, written_by_all
from .tasks import TASKS, kind_of


def write_export(model, out: Path, tokenizer, config_yaml: str, card: str, state_dict: dict | None = None,
                 save_function=torch.save) -> Path:
    """Rank 0's half of every engine's export: config.json and fp32 model.safetensors (from
    `state_dict`, full weights, when the model's own are shards), the tokenizer, the recipe and the
    model card. Tied weights are written once, under the name from_pretrained ties back. Written into
    <out>.partial and renamed: a write that fails (a full disk) leaves the previous export as it was."""
    final, out = out, partial_export(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tied = getattr(model, "_tied_weights_keys", None)
    if state_dict is not None and isinstance(tied, dict) and getattr(model.config, "tie_word_embeddings", True):
        for key in tied:   # gathered state dicts (ZeRO-3, FSDP) repeat tied weights under both names
            state_dict.pop(key, None)
    model.config.dtype = "float32"   # (torch_dtype: transformers 5 says it is deprecated, on every export)
    with no_shard_bar():
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True, save_function=save_function)
    tokenizer.save_pretrained(out)
    if getattr(model, "sentence_pooling", None):   # retrieval's encoder: a sentence-transformers model as well
        from .embeddings import write_sentence_transformer
        write_sentence_transformer(out, model.sentence_pooling,
                                   max_seq_length=yaml.safe_load(config_yaml)["data"]["max_seq_length"])
    (out / "recipe.yaml").write_text(config_yaml)
    (out / "README.md").write_text(card)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(out, final)
    return final


@contextlib.contextmanager
def no_shard_bar():
    """transformers' progress bars off while an export's save_pretrained writes: its "Writing model shards 1/1" bar
    says nothing the `[export] ... -> dir` line after it does not, and came 5 times in the demo's log (each
    checkpoint.downstream export and the final one). The previous state after (a user's bars stay theirs)."""
    from transformers.utils import logging as hf_logging
    was_on = hf_logging.is_progress_bar_enabled()
    if was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def partial_export(out: Path) -> Path:
    """Where write_export writes before it renames: <out>.partial."""
    return Path(out).with_name(Path(out).name + ".partial")


def export_agreed(engine, out: Path, tokenizer, config_yaml: str, card: str, step: int, export_bytes: int) -> Path:
    """engine.export, agreed on by every rank (ranks.written_by_all): a full disk on rank 0 is one line,
    <output_dir>/model.partial is removed and the checkpoints stay, every rank exits with code 5."""
    needed = (export_bytes, "an estimate: 4 bytes per parameter, the fp32 weights")
    then = "the partial export was removed and the checkpoints stay: free space there, then rerun with --resume auto"
    written_by_all(lambda: engine.export(out, tokenizer, config_yaml, card), engine.control, engine.is_main,
                   lambda: shutil.rmtree(partial_export(out), ignore_errors=True),
                   lambda err: disk_full(err, partial_export(out), "the export", step, needed, then))
    return out


def push_to_hub(ckpt: CheckpointConfig, run_name: str, export_dir: Path) -> None:
    """Upload the export (weights, tokenizer, recipe, model card) to checkpoint.hub_model_id. A failed
    upload does not undo the run: it says so and how to retry."""
    repo = ckpt.hub_model_id
    try:
        from huggingface_hub import HfApi
        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        info = api.upload_folder(folder_path=str(export_dir), repo_id=repo, commit_message=f"bert-recipes: {run_name}")
        print0(f"[hub] uploaded {export_dir} -> {getattr(info, 'commit_url', repo)}")
    except Exception as err:   # offline, no token, no permission: the export stays on disk
        print0(f"[hub] upload to {repo} failed ({type(err).__name__}: "
               f"{str(err).splitlines()[0] if str(err) else ''}); the export is in {export_dir}; retry with "
               f"`huggingface-cli upload {repo} {export_dir}`")


def model_card(recipe: dict, final: dict, backend: dict, tokens_seen: int) -> str:
    """README.md of an export: what it is, what it was trained on and how, and how well it did. `recipe`:
    the run's resolved settings as plain data (config.to_dict, what recipe.yaml beside the card holds)."""
    d, t, job, optim = recipe["data"], recipe["train"], recipe["task"], recipe["optim"]
    base = recipe["model"]["name_or_path"] or "none: trained from scratch (randomly initialised)"
    data = {"sample": "the embedded sample (Python standard-library documentation)",
            "hub": f"{d['dataset_name']}" + (f" / {d['dataset_config']}" if d["dataset_config"] else ""),
            "files": "; ".join(f"{m['name']} (weight {m['weight']:g}): " + (", ".join(m["files"]) if m["files"] else
                               m["dataset_name"] + (f" / {m['dataset_config']}" if m.get("dataset_config") else "")
                               + f" ({m.get('split') or 'train'})") for m in d["mixture"])
            if d.get("mixture") else ", ".join(d["train_files"] or [])}.get(d["source"], d["source"])
    skip = {"eval_samples", "steps", "first_train_loss", "last_train_loss", "wall_time_s", "num_processes",
            "eval_dataset_size", "backend", "rank_checksums", "peak_memory_gb_per_rank", "distributed_type",
            "predicted_peak_memory_gb", "skipped_steps"}
    metrics = "\n".join(f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
                         for k, v in final.items() if k not in skip and isinstance(v, (int, float)))
    kind = kind_of(job["kind"])
    task = kind.card_task(TaskConfig(**job))
    arch = ARCHITECTURES[recipe["model"].get("architecture") or "bert"]   # its title and model type
    return f"""---
library_name: transformers
tags: [{arch.model_type}, bert-recipes, {TASKS[job["kind"]].pipeline_tag}]
---
# {recipe["run"]["name"]}

A {arch.title} model trained with bert-recipes' `train.py`; `recipe.yaml` beside this card holds every setting of the
run, resolved.

| | |
|---|---|
| task | {task} |
| base model | {base} |
| data | {data}; train split `{d["train_split"]}`, evaluated on `{d["eval_split"]}`; sequences of {d["max_seq_length"]} tokens |
| steps | {final.get("steps")} optimizer steps of {t["global_batch_size"]} sequences |
| tokens seen | {tokens_seen:,} (non-padding tokens fed to the model) |
| backend | {backend.get("name")} on {final.get("num_processes")} processes ({backend.get("distributed_type")}) |
| precision | {t["mixed_precision"]} (the weights here are fp32) |
| optimizer | {optim["name"]}, peak lr {optim["lr"]}, {optim["decay"]} decay |

## Final evaluation

| metric | value |
|---|---|
{metrics}

Load it with `AutoModel.from_pretrained("<this directory>")` (and `AutoTokenizer`, whose files are here too).
"""
