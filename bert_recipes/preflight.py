"""What a plain process can check before any rank starts: the recipe and its overrides, the launch
config against the recipe, the output directory and the paths the run will read.

train.main calls `preflight` first, in every rank; the Make targets call it once more before
`accelerate launch`, through this module's command line, with the launch's own environment:

    python -m bert_recipes.preflight <accelerate config> [--num_processes N] -- <train.py arguments>

so a user's mistake is one `config error:` line and exit code 2, before a launcher starts (and
before it can add its own traceback). What only a rank can see (the data's columns and labels, a
prepared-data signature, an output directory shared across nodes) is checked there.
Cheap by design: no model, no data, no process group; about the cost of importing torch.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .backends.consistency import check_trackers, resolve_run
from .backends.plan import LaunchPlan, _true, decide_on_gpu, plan_from_config_file
from .checkpoint import check_checkpoint_fits, check_resume_path, resumed_checkpoint
from .downstream import check_downstream
from .config import (PATH_KEYS, CheckpointConfig, Config, ConfigError, DataConfig, TaskConfig, check_mask_rate, looks_local,
                     padded_batches, parse_train_args, path_kind, resolve, to_yaml, validate)
from .data.files import FILE_KEYS, resolve_into
from .places import check_path_names, check_writable_dir, unwritable_default
from .run_dir import check_output_dir
from .data.prepared import check_prepared_dir
from .data.store import check_store_dir


def path_values(cfg: Config, kinds: tuple[str, ...]) -> list[tuple[str, object]]:
    """(key, value) of every path key (config.PATH_KEYS) of the given kinds ("read ...", "write dir"), in the
    table's order: what places.check_path_names checks, without handing it the whole config."""
    values = [(key, getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])) for key, kind in PATH_KEYS.items()
              if key != "recipe" and kind.startswith(kinds)]
    if "read" in kinds:   # data.mixture's sources read files too
        values += [(f"data.mixture[{i}].files", s.files) for i, s in enumerate(cfg.data.mixture or [])]
    return values


def check_paths(cfg: Config) -> list[str]:
    """The local paths the run reads: model and tokenizer directories, data files, prepared data, the
    checkpoint to resume. First, that each can exist at all: no name over its filesystem's limits. Data files
    given by pattern or directory are resolved into the config here (bert_recipes/data/files.py). -> the lines
    that say which files the run reads."""
    check_path_names(path_values(cfg, ("read",)))
    for key, name in (("model.name_or_path", cfg.model.name_or_path), ("tokenizer.name_or_path", cfg.tokenizer.name_or_path)):
        if name:
            path_kind(Path(name) / "config.json", key)   # a directory this user may not look into: one line
        if name and path_kind(name, key) == "file":
            raise ConfigError(f"{key}={name} is a file, not a directory: give a Hugging Face model directory (such as "
                              "an export's model/) or a Hub name")
        if name and looks_local(name) and not Path(name).expanduser().is_dir():
            raise ConfigError(f"{key}={name}: cannot load it: no such directory (give a Hugging Face model directory, "
                              "such as an export's model/, or a Hub name)")
    named = ([("data.dataset_name", cfg.data.dataset_name)] if cfg.data.source == "hub" else []) + [
        (f"data.mixture[{i}].dataset_name", s.dataset_name) for i, s in enumerate(cfg.data.mixture or [])]
    for key, name in named:
        if name and looks_local(name) and not Path(name).expanduser().is_dir():
            raise ConfigError(f"{key}={name}: no such directory (a dataset on the Hub is named `name` or "
                              "`org/name`; a local one is a directory that datasets.load_dataset reads, or data "
                              "files: data.source=files with data.train_files, or a mixture source's files)")
    notes = []
    if cfg.data.source == "files":   # the checkpoint's lists: a resume reads the files its run read
        notes = resolve_into(cfg.data, _resumed_files(cfg))
    if cfg.data.source == "prepared":
        check_prepared_dir(cfg.data)
    if cfg.data.source == "store":
        check_store_dir(cfg.data.store_dir)
    check_resume_path(cfg.checkpoint.resume)
    check_downstream(cfg.checkpoint.downstream, cfg.task.kind, cfg.model)   # can its recipe fine-tune this model?
    return notes


def _resumed_files(cfg: Config) -> dict[str, list[str]]:
    """The file lists (files.file_lists' keys) of the config of the checkpoint this run resumes: data.train_files and
    data.validation_files, or each source of data.mixture that has the same name at the same place; empty when there
    is no checkpoint (or it cannot be read: check_resume_path says why, next)."""
    if not cfg.checkpoint.resume:
        return {}
    try:
        if cfg.data.mixture:
            saved = resumed_setting(cfg.checkpoint, cfg.run.output_dir, "data", "mixture") or []
            names = [source.name for source in cfg.data.mixture]
            return {f"data.mixture[{i}].files": s.get("files") for i, s in enumerate(saved)
                    if isinstance(s, dict) and i < len(names) and s.get("name") == names[i]}
        return {key: resumed_setting(cfg.checkpoint, cfg.run.output_dir, "data", key.split(".")[1]) for key in FILE_KEYS}
    except (OSError, ValueError):
        return {}


def check_caches(data: DataConfig, env=os.environ) -> None:
    """The cache directories the run writes into: the datasets cache (data.cache_dir, or the datasets
    library's own when unset), and the sample's directory when the sample is still to be built (a built
    sample is only read: sample.build_sample)."""
    built = data.source == "sample" and path_kind(Path(data.sample_dir) / "manifest.json", "data.sample_dir") == "file"
    for key, path in (("data.cache_dir", data.cache_dir or None),
                      ("data.sample_dir", data.sample_dir if data.source == "sample" and not built else None)):
        if path is not None:
            check_writable_dir(Path(path), key)
    problem = unwritable_default(datasets_cache_dir(env)) if data.cache_dir is None else None
    if problem:
        raise ConfigError(f"data.cache_dir is unset, so datasets caches in its own directory (HF_DATASETS_CACHE, else "
                          f"HF_HOME/datasets), {problem.split('; give')[0]}: set data.cache_dir (or HF_HOME) to a "
                          "writable directory")


def datasets_cache_dir(env=os.environ) -> Path:
    """Where datasets caches when data.cache_dir is unset: datasets.config's rule (HF_DATASETS_CACHE, else
    HF_HOME/datasets, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface or ~/.cache/huggingface), read here
    without importing datasets (about 1.5 s)."""
    home = env.get("HF_HOME") or str(Path(env.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface")
    return Path(env.get("HF_DATASETS_CACHE") or Path(home) / "datasets").expanduser()


def preflight(cfg: Config, plan: LaunchPlan, world_size: int, env=os.environ) -> list[str]:
    """Every check that needs no data, model or process group; raises ConfigError naming the field.
    Fills the settings `resolve` derives and train.micro_batch_size=auto, and resolves the plan
    (backends.consistency.resolve_run) that the engines read. -> the notes to print once the run starts.

    Which mistake is told first when a run has several (one line, the first found): from what the user
    wrote to what is on disk.
      1. the recipe and its overrides (their types, ranges and relations: validate, resolve);
      2. the launch files (the accelerate YAML and DeepSpeed JSON, as their libraries read them: plan.py)
         against the recipe, and the recipe against the device (resolve_run and the checks around it);
      3. the paths the run reads (model, tokenizer, data, the checkpoint to resume): first that no name is over
         its filesystem's limits (places.check_path_names), then that each is there and of its kind;
      4. the places it writes: their names' limits, the output directory (another run's checkpoints in it, a
         checkpoint of another model shape: checkpoint.check_checkpoint_fits) and the caches.
    A mistake in what was written makes the later checks moot (a fixed recipe may point elsewhere), and the
    disk's state is read last because fixing an earlier mistake often changes it (another output_dir)."""
    validate(cfg)
    notes = resolve(cfg) + choose_micro_batch(cfg, plan, world_size, env) + choose_loader(cfg.data, cfg.task, plan, env)
    check_mask_rate(cfg)   # with data.length_bins=auto decided
    check_trackers(cfg.logging.trackers)
    if plan.on_gpu and cfg.model.dropout_impl == "packed":   # on_gpu: decided once, with the plan
        raise ConfigError("model.dropout_impl=packed is for CPUs (it replaces a CPU's slow serial dropout masks); "
                          "on GPUs torch's fused dropout is the fast one: use model.dropout_impl=torch")
    resolve_run(cfg, plan, world_size)   # world, accumulation, precision, TF32, masks; recipe vs launch files
    notes += check_paths(cfg)
    check_path_names(path_values(cfg, ("write",)))   # before anything is created: no parent directory made for nothing
    # an output_dir holding another run's checkpoints is refused (run.overwrite replaces it)
    notes += check_output_dir(Path(cfg.run.output_dir), to_yaml(cfg), cfg.checkpoint.resume, cfg.run.overwrite)
    # a checkpoint of another model shape: one line now, not torch's size mismatch after the data is prepared
    resumed = resumed_checkpoint(cfg.run.output_dir, cfg.checkpoint.resume)
    check_checkpoint_fits(resumed, to_yaml(cfg))
    if resumed is None and cfg.checkpoint.init_from:   # a phase's first start (a preempted one resumes itself)
        notes += start_from_checkpoint(cfg)
    check_caches(cfg.data)
    return notes


def start_from_checkpoint(cfg: Config) -> list[str]:
    """checkpoint.init_from resolved into the run's config (the checkpoint itself, not a run directory), the source
    run's tokenizer where the recipe names none, and the checkpoint's shape against this run's. -> the note."""
    from .phases import its_tokenizer, resolve_init
    checkpoint = resolve_init(cfg.checkpoint.init_from)
    if Path(cfg.run.output_dir).resolve() in checkpoint.resolve().parents:
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from} is inside this run's run.output_dir="
                          f"{cfg.run.output_dir}: a phase writes into a directory of its own (its start would replace "
                          "the checkpoint it starts from); set another run.output_dir")
    cfg.checkpoint.init_from = str(checkpoint)
    notes = []
    tokenizer = its_tokenizer(checkpoint)
    if cfg.tokenizer.name_or_path is None and tokenizer is not None:
        cfg.tokenizer.name_or_path = str(tokenizer)
        notes.append(f"[init] tokenizer.name_or_path={tokenizer}: the tokenizer the checkpoint was trained with")
    check_checkpoint_fits(checkpoint, to_yaml(cfg), key="checkpoint.init_from")
    return notes


def choose_micro_batch(cfg: Config, plan: LaunchPlan, world_size: int, env=os.environ) -> list[str]:
    """train.micro_batch_size=auto, decided once before anything is built (bert_recipes.memory.auto_micro_batch,
    from this GPU's free memory), or taken from the checkpoint a run resumes. -> the note saying why."""
    if cfg.train.micro_batch_size != "auto":
        return []
    if not plan.on_gpu:
        raise ConfigError("train.micro_batch_size=auto sizes the batch from a GPU's free memory; on CPU processes set "
                          "a number, e.g. --train.micro_batch_size=32")
    saved = resumed_setting(cfg.checkpoint, cfg.run.output_dir, "train", "micro_batch_size")
    if isinstance(saved, int):
        cfg.train.micro_batch_size = saved
        return [f"[config] train.micro_batch_size=auto -> {saved}: the value of the checkpoint being resumed"]
    import torch

    from .memory import auto_micro_batch
    from .models import model_config
    free, total = torch.cuda.mem_get_info(int(env.get("LOCAL_RANK", "0")))
    config = model_config(cfg.model, cfg.task, cfg.tokenizer.vocab_size, 0)
    cfg.train.micro_batch_size, note = auto_micro_batch(cfg, config, plan, world_size, free, total)
    return [note]


MAX_AUTO_WORKERS = 4   # 4 workers collate a packed 256 x 128 MLM batch each in ~7 ms: ~1 ms a step at 4


def auto_workers(on_gpu: bool, env=os.environ) -> tuple[int, str]:
    """data.num_workers=auto: -> (workers per rank, why). On CPUs 0: the training process's own threads
    need the cores. On GPUs: the cores this process may use (os.sched_getaffinity: a SLURM or taskset
    cpuset counts, not the machine's) shared by this node's ranks (LOCAL_WORLD_SIZE), one of a rank's
    kept for its training process, at most MAX_AUTO_WORKERS."""
    if not on_gpu:
        return 0, "a CPU run: the step's own threads need every core"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    workers = max(0, min(MAX_AUTO_WORKERS, cores // ranks - 1))
    return workers, (f"{cores} cores this process may use (os.sched_getaffinity) / {ranks} ranks on this node, one "
                     f"kept for training, at most {MAX_AUTO_WORKERS}")


def choose_loader(d: DataConfig, task: TaskConfig, plan: LaunchPlan, env=os.environ) -> list[str]:
    """data.num_workers and data.length_bins when auto, decided once for the device (plan.on_gpu) and
    written into the run's resolved config. -> the notes saying what was chosen."""
    notes = []
    if d.num_workers == "auto":
        d.num_workers, why = auto_workers(bool(plan.on_gpu), env)
        if plan.on_gpu:   # on CPUs auto is the default's 0
            notes.append(f"[config] data.num_workers=auto -> {d.num_workers}: {why}")
    if d.length_bins == "auto":
        d.length_bins = 8 if plan.on_gpu else 0
        if plan.on_gpu and padded_batches(d, task):
            notes.append("[config] data.length_bins=auto -> 8: padded batches take one of 8 lengths (a GPU run: "
                         "each new shape costs kernels, cuDNN graphs and compiles)")
    return notes


def resumed_setting(checkpoint: CheckpointConfig, output_dir: str, section: str, key: str):
    """A setting of the checkpoint this run resumes (checkpoint.resume: auto, the latest in output_dir; or a path), or
    None."""
    import yaml

    from .checkpoint import CONFIG_FILE, complete_checkpoints
    resume = checkpoint.resume
    found = complete_checkpoints(output_dir)[-1:] if resume == "auto" else [Path(resume)] if resume else []
    if not found or not (found[0] / CONFIG_FILE).is_file():
        return None
    return (yaml.safe_load((found[0] / CONFIG_FILE).read_text()) or {}).get(section, {}).get(key)


def same_on_every_rank(value: int, group, key: str) -> None:
    """A setting each rank decided alone (train.micro_batch_size=auto, from its own GPU's memory) must
    agree: the smallest is the one to set when it does not."""
    from .ranks import spread
    low, high = spread(value, group)
    if low != high:
        raise ConfigError(f"{key}=auto: the ranks' GPUs allow different values ({int(low)} to {int(high)}); set "
                          f"--{key}={int(low)}")


def launch_plan(config_file: str, env=os.environ) -> LaunchPlan:
    """The plan `accelerate launch --config_file` would give the ranks, in this environment
    (a CPU launch's ACCELERATE_USE_CPU=1 included), with the device decided as the ranks will."""
    plan = plan_from_config_file(config_file)
    plan.cpu = plan.cpu or _true(env.get("ACCELERATE_USE_CPU"))
    plan.on_gpu = decide_on_gpu(plan, env)
    return plan


def main(argv: list[str]) -> int:
    if "--" not in argv or not argv:
        print("usage: python -m bert_recipes.preflight <accelerate config> [--num_processes N] -- <train.py arguments>",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    ours, train_args = argv[:split], argv[split + 1:]
    try:
        plan = launch_plan(ours[0])
        world = plan.num_processes
        if "--num_processes" in ours:
            world = int(ours[ours.index("--num_processes") + 1])
        cfg, _ = parse_train_args(train_args)
        preflight(cfg, plan, world)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from .cli import quick_exit   # without the interpreter's teardown (about 1 s)
    quick_exit(main(sys.argv[1:]))
