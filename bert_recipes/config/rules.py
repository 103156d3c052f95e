"""The rules between values, checked before the run starts: batch arithmetic (global = micro x accumulation x
world), the schedule's warnings, the settings derived from others (`resolve`), the ranges and relations
(`validate`, with the numbers in the message), and the facts about a run's shapes that the engines read.
"""
from __future__ import annotations

import math

from ..metrics import available_metrics   # the metric scripts' names (stdlib only)
from ..tasks import TASKS, reported_metrics   # the task kinds' rows (data)
from .readers import ConfigError
from .schema import _RANGES, Config, DataConfig, TaskConfig, TrainConfig




# ---------------------------------------------------------------------------- relations
def grad_accum_steps(train: TrainConfig, world_size: int) -> int:
    """global = micro x accumulation x world; the global batch must divide evenly."""
    per_step = train.micro_batch_size * world_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by "
            f"train.micro_batch_size={train.micro_batch_size} x world_size={world_size} = {per_step}. "
            f"Pick a global batch that is a multiple of {per_step}, or change the micro batch.")
    return train.global_batch_size // per_step


def optimizer_steps(train: TrainConfig, train_sequences: int, replicas: int, accum: int) -> tuple[int, int]:
    """-> (steps per epoch, total steps), the same for every engine.

    Each replica gets train_sequences // micro // replicas micro batches per epoch (drop_last,
    sharded), and every optimizer step takes exactly `accum` of them: a step always sees the whole
    global batch, so an epoch's incomplete last step is dropped, as drop_last drops an incomplete
    micro batch. (The DeepSpeed pipeline cannot run a short step at all.)"""
    batches_per_epoch = train_sequences // train.micro_batch_size // replicas
    steps_per_epoch = batches_per_epoch // accum
    if steps_per_epoch == 0:
        raise ConfigError(f"{train_sequences} training sequences cannot fill one optimizer step: "
                          f"train.global_batch_size={train.global_batch_size} (micro {train.micro_batch_size} x "
                          f"accum {accum} x {replicas} replicas). Use more data or a smaller global batch")
    limits = [train.max_steps] if train.max_steps else []
    if train.epochs is not None:
        limits.append(math.ceil(train.epochs * steps_per_epoch))
    return steps_per_epoch, min(limits)


def schedule_warnings(cfg: Config, total_steps: int, slots: bool = True) -> list[str]:
    """Legal but probably unintended: one line each. slots: the MLM head predicts K position slots (not
    under the pipeline, whose head predicts every position)."""
    o, t, out = cfg.optim, cfg.train, []
    warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_ratio * total_steps)
    if warmup >= total_steps:
        out.append(f"[warning] the warmup ({warmup} steps) is not shorter than the run ({total_steps} steps): the lr "
                   f"never reaches optim.lr={o.lr} and there is no decay; lower optim.warmup_steps / warmup_ratio")
    if o.decay == "wsd" and o.wsd_decay_start is not None and o.wsd_decay_start >= total_steps:
        out.append(f"[warning] optim.wsd_decay_start={o.wsd_decay_start} >= the run's {total_steps} steps: it never "
                   "decays (resume it with a larger train.max_steps to decay)")
    if cfg.checkpoint.save_every and cfg.checkpoint.save_every >= total_steps:
        out.append(f"[warning] checkpoint.save_every={cfg.checkpoint.save_every} >= the run's {total_steps} steps: "
                   "the only checkpoint is the final one")
    if t.halt_at_step is not None and t.halt_at_step >= total_steps:
        out.append(f"[warning] train.halt_at_step={t.halt_at_step} >= the run's {total_steps} steps: it never halts")
    if t.eval_every is not None and t.eval_every >= total_steps:
        then = "the only evaluation is the final one" if t.eval_final else "the run never evaluates (train.eval_final=false)"
        out.append(f"[warning] train.eval_every={t.eval_every} >= the run's {total_steps} steps: {then}")
    if o.name == "stable_adamw" and o.max_grad_norm:   # unset, it is 0 under StableAdamW: this one was set
        out.append(f"[warning] optim.max_grad_norm={o.max_grad_norm} with optim.name=stable_adamw: \"The StableAdamW "
                   "optimizer replaces gradient clipping\" (ModernBERT's main.py, which warns the same): leave it unset "
                   "(no clipping under StableAdamW) or set 0")
    chosen = round(cfg.data.mlm_probability * cfg.data.max_seq_length)
    k = cfg.data.max_predictions_per_seq if TASKS[cfg.task.kind].masked_lm else None
    if slots and isinstance(k, int) and k > max(1, chosen):   # slots: the pipeline's head predicts every position
        out.append(f"[warning] data.max_predictions_per_seq={k}, but at most round(data.mlm_probability x "
                   f"data.max_seq_length) = {max(1, chosen)} tokens of a sequence are chosen: {k - max(1, chosen)} of "
                   f"its {k} slots are always empty (the head computes them for nothing); set it to {max(1, chosen)} or auto")
    return out


# The keys that name paths (and train.py's --recipe), and what the run does with each: bert_recipes.preflight
# checks every one before a rank starts; the generated bad-input matrix tries a path of each wrong kind.
# "read dir or hub": a local directory, or a Hub id where the value cannot be a path (config.looks_local).
PATH_KEYS = {
    "recipe": "read file",
    "run.output_dir": "write dir",
    "model.name_or_path": "read dir or hub",
    "tokenizer.name_or_path": "read dir or hub",
    "data.prepared_dir": "read dir",
    "data.store_dir": "read dir",
    "data.train_files": "read files",
    "data.validation_files": "read files",
    "data.cache_dir": "write dir",
    "data.sample_dir": "write dir",
    "checkpoint.resume": "read dir",
    "checkpoint.init_from": "read dir",
    "checkpoint.downstream": "read file",
}


def predictions_per_seq(cfg: Config) -> int | None:
    """K of data.max_predictions_per_seq ("auto": round(mlm_probability x max_seq_length)); None: the
    per-token Bernoulli choice, or not MLM."""
    d = cfg.data
    if not TASKS[cfg.task.kind].masked_lm:
        return None
    if d.max_predictions_per_seq == "auto" or (d.max_predictions_per_seq is None and cfg.train.compile):
        return max(1, round(d.mlm_probability * d.max_seq_length))
    return d.max_predictions_per_seq


def packed_dropout_here(impl: str, compile: bool, device_type: str) -> bool:
    """Does this run draw packed dropout masks? model.dropout_impl=packed, on a CPU, without
    train.compile. The run (build_model, with plan.on_gpu's device) and the memory planner
    (bert_recipes.activations, with the device it plans for) both ask this; the device is an input."""
    return impl == "packed" and device_type == "cpu" and not compile


def padded_batches(data: DataConfig, task: TaskConfig) -> bool:
    """Are this run's training batches padded (lengths that vary, an attention mask)? Packed MLM blocks are not, nor
    unpadded batches (data.unpad: one row of real tokens)."""
    return (not TASKS[task.kind].masked_lm or not data.packing) and not data.unpad


def documents_attend_apart(cfg: Config) -> bool:
    """Do this run's training batches carry documents that attend only within themselves (data.document_mask's
    packed rows, data.unpad's one row)? Their attention path is the plan's (bert_recipes/attention.py)."""
    return cfg.data.document_mask or cfg.data.unpad


def resolve_architecture(model, task_kind: str, init_from: str | None) -> tuple[str, str | None]:
    """model.architecture, where the recipe leaves it unset (None) the checkpoint's own, as it says: model.name_or_path's
    (its config.json's model_type), checkpoint.init_from's (the run's saved config); else bert, a fresh model's.
    A checkpoint of a model type that no architecture here builds: bert's fields for a classifier (transformers'
    own class for it, as models.model_config builds it), one line for MLM. A source not readable here (a directory
    not written yet, the Hub out of reach): the architecture whose fields the recipe sets, else bert, stands in, and
    the run stops at that path in its own line (preflight.check_paths, models.model_config's "cannot load its
    config"). A named architecture is checked against its checkpoint's where that can be read (init_from's: by
    checkpoint.check_checkpoint_fits, a shape key). -> (the architecture, what said it: None where the recipe named
    it or nothing did)."""
    from ..architectures import ARCHITECTURES, of_checkpoint, of_fields, of_model_type, of_run
    named, name = model.architecture, model.name_or_path
    if name:
        try:
            model_type = of_checkpoint(name)
        except (OSError, ValueError):   # not there (yet), or the Hub out of reach: the path's own line, later
            model_type = None
        if model_type is not None:
            built_here = of_model_type(model_type)
            if built_here is None and TASKS[task_kind].masked_lm:
                raise ConfigError(f"model.name_or_path={name} is a {model_type} model: masked-LM pretraining here builds "
                                  f"{', '.join(ARCHITECTURES)} (model.architecture, bert_recipes/architectures/); give a "
                                  "checkpoint of one of them, or leave model.name_or_path unset for a fresh model")
            if named is not None and built_here is not None and named != built_here:
                raise ConfigError(f"model.name_or_path={name} is a {model_type} model and model.architecture={named}: "
                                  f"set model.architecture={built_here}, or leave it unset (the checkpoint's)")
            return named or built_here or "bert", None if named else f"model.name_or_path={name} is a {model_type} model"
    elif init_from and named is None:
        trained = of_run(init_from)
        if trained is not None:
            return trained, f"checkpoint.init_from={init_from} trained model.architecture={trained}"
    if named is None and (name or init_from):   # a checkpoint not readable here: a stand-in until its path's line
        return of_fields(model) or "bert", None
    return named or "bert", None


def check_architecture(cfg: Config) -> None:
    """model.architecture resolved (resolve_architecture: unset, the checkpoint's), a row of
    bert_recipes/architectures/, and no field of another architecture set."""
    from ..architectures import ARCHITECTURES, foreign_field, misplaced_field
    m = cfg.model
    m.architecture, source = resolve_architecture(m, cfg.task.kind, cfg.checkpoint.init_from)
    if m.architecture not in ARCHITECTURES:   # named so, or so in the config init_from's run saved
        raise ConfigError(f"model.architecture={m.architecture} is not one of {', '.join(ARCHITECTURES)}"
                          + (f" ({source})" if source else ""))
    found = foreign_field(m.architecture, m)
    if found and source:   # the checkpoint decided: the field goes, not the architecture
        key, value, other = found
        raise ConfigError(f"model.{key}={value} is {ARCHITECTURES[other].title}'s; model.architecture={m.architecture} "
                          f"(unset, so the checkpoint's: {source}) has no such field: remove it")
    why = misplaced_field(m.architecture, m)
    if why:
        raise ConfigError(why)


def check_documents(cfg: Config) -> None:
    """data.document_mask and data.unpad, each where it means something, and what they cannot be combined with."""
    d, t = cfg.data, cfg.train
    packed_mlm = TASKS[cfg.task.kind].masked_lm and d.packing
    if d.document_mask and not packed_mlm:
        raise ConfigError("data.document_mask=true keeps a packed row's documents apart: it needs packed MLM "
                          f"(task.kind=mlm, data.packing=true; now task.kind={cfg.task.kind}, data.packing={d.packing}); "
                          "for padded batches use data.unpad")
    if d.packing == "best_fit" and not (packed_mlm and d.document_mask):
        raise ConfigError("data.packing=best_fit packs whole documents into a row and pads its tail: the documents and "
                          "the padding must attend apart, so it needs task.kind=mlm and data.document_mask=true (now "
                          f"task.kind={cfg.task.kind}, data.document_mask={d.document_mask}); set them, or data.packing="
                          "true")
    if d.unpad and packed_mlm:
        raise ConfigError("data.unpad=true is for padded batches (fine-tuning, unpacked MLM); packed MLM blocks have no "
                          "padding: set data.unpad=false (data.document_mask keeps their documents apart)")
    if d.unpad and isinstance(d.length_bins, int) and d.length_bins > 0:
        raise ConfigError(f"data.length_bins={d.length_bins} pads batches to fixed lengths and data.unpad=true runs them "
                          "without padding: set data.length_bins=0 (or auto), or data.unpad=false")
    if t.document_attention != "auto" and not (d.document_mask or d.unpad):
        raise ConfigError(f"train.document_attention={t.document_attention} chooses how documents attend apart, and this "
                          "run has none (data.document_mask and data.unpad are false): set one, or leave it auto")
    if d.unpad and t.compile:
        raise ConfigError("train.compile with data.unpad=true: the unpadded row's length changes every batch, a "
                          "recompile each; set train.compile=false, or data.unpad=false with data.length_bins")


def check_mask_rate(cfg: Config) -> None:
    """data.mlm_probability_end and data.eval_mlm_probability: MLM only, and a rate that moves in levels train.compile
    can compile (bert_recipes/mask_rate.py). Again once data.length_bins=auto is decided (preflight)."""
    d = cfg.data
    for key in ("mlm_probability_end", "eval_mlm_probability"):
        if getattr(d, key) is not None and not TASKS[cfg.task.kind].masked_lm:
            raise ConfigError(f"data.{key}={getattr(d, key)} is a masking rate: it needs task.kind=mlm (now "
                              f"{cfg.task.kind}); remove it")
    bins = d.length_bins if isinstance(d.length_bins, int) else 0
    moving = d.mlm_probability_end is not None and d.mlm_probability_end != d.mlm_probability
    if moving and TASKS[cfg.task.kind].masked_lm and cfg.train.compile and not d.packing and 8 // max(bins, 1) < 2:
        raise ConfigError(f"data.mlm_probability_end={d.mlm_probability_end} under train.compile with data.length_bins="
                          f"{bins}: each level of the rate is one more compiled shape a bin, and {bins} bins leave no "
                          "room for a second level within dynamo's 8: set data.length_bins to 4 or fewer, or "
                          "train.compile=false")


def check_mixture(cfg: Config) -> None:
    """data.mixture: pretraining from several sources, each named once, with files or a dataset (not both) and a
    positive, finite weight;
    in place of data.train_files and data.validation_files, and not from prepared data."""
    d = cfg.data
    if d.mixture is None:
        return
    if not TASKS[cfg.task.kind].masked_lm or d.source != "files":
        raise ConfigError(f"data.mixture samples pretraining sources by weight: it needs task.kind=mlm and "
                          f"data.source=files (now task.kind={cfg.task.kind}, data.source={d.source}): remove "
                          "data.mixture, or set both")
    if d.train_files or d.validation_files:
        raise ConfigError("data.mixture and data.train_files / data.validation_files are both set: the mixture's "
                          "sources are the training files, each holding out data.validation_split_percentage for "
                          "evaluation; give the files as sources of data.mixture and remove the others")
    if not d.mixture:
        raise ConfigError("data.mixture is an empty list: give at least one {name, files, weight} (or {name, "
                          "dataset_name, weight}), or remove it")
    seen = set()
    for i, source in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        if not source.name or not all(c.isalnum() or c in "-_." for c in source.name):
            raise ConfigError(f"{key}.name={source.name!r}: give each source a name of letters, digits, '-', '_' or '.' "
                              "(metrics are reported as <name>/eval_loss)")
        if source.name in seen:
            raise ConfigError(f"{key}.name={source.name!r} names two sources: give each its own name")
        seen.add(source.name)
        if source.files and source.dataset_name:
            raise ConfigError(f"{key} (source {source.name}) gives both files and dataset_name={source.dataset_name}: "
                              "a source reads one of them; make each its own source")
        if not source.files and not source.dataset_name:
            raise ConfigError(f"{key}.files is empty (source {source.name}): give its files, directories or patterns, "
                              "or a dataset (dataset_name: a Hub name or a local directory)")
        if source.files and (source.dataset_config or source.split):
            given = "dataset_config" if source.dataset_config else "split"
            raise ConfigError(f"{key}.{given} (source {source.name}) is for a dataset source (dataset_name), and this "
                              "one reads files: remove it")
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise ConfigError(f"{key}.weight={source.weight} (source {source.name}) must be positive and finite (the "
                              "weights are shares of the stream, relative to each other); remove a source to leave "
                              "it out")


def repeating_shapes(cfg: Config) -> bool:
    """Do the training batches take a fixed set of shapes (so torch.compile can compile each once, with
    dynamic=False)? Packed MLM blocks with K predictions (or the dense head) have one shape; padded
    batches repeat only with length bins (data.length_bins, once resolved to a number); unpadded ones never."""
    if cfg.data.unpad:
        return False
    if padded_batches(cfg.data, cfg.task):
        return isinstance(cfg.data.length_bins, int) and cfg.data.length_bins > 0
    return (not TASKS[cfg.task.kind].masked_lm or cfg.data.max_predictions_per_seq is not None
            or not cfg.model.sparse_mlm_head)


def resolve(cfg: Config) -> list[str]:
    """Settings derived from others, filled in before the run starts; -> one note per setting."""
    notes = []
    d, was = cfg.data, cfg.data.max_predictions_per_seq
    d.max_predictions_per_seq = predictions_per_seq(cfg)
    if d.max_predictions_per_seq is not None and d.max_predictions_per_seq != was:
        why = "train.compile needs static shapes" if was is None else "auto"
        notes.append(f"[config] data.max_predictions_per_seq={d.max_predictions_per_seq} ({why}: round("
                     f"{d.mlm_probability} x {d.max_seq_length}) tokens predicted per sequence, static shapes)")
    return notes


def validate(cfg: Config) -> None:
    """Checks that need no hardware knowledge; world-size checks happen in grad_accum_steps."""
    if cfg.task.kind not in TASKS:
        raise ConfigError(f"task.kind={cfg.task.kind} is not one of {', '.join(TASKS)} (bert_recipes/tasks/)")
    for rule in _RANGES:
        section, name = rule.key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not rule.ok(value):
            raise ConfigError(f"{rule.key}={value} is not allowed: it must be {rule.must()}")
    t, d, m = cfg.train, cfg.data, cfg.model
    if t.micro_batch_size != "auto" and t.global_batch_size % t.micro_batch_size:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                          f"train.micro_batch_size={t.micro_batch_size}")
    o = cfg.optim
    if o.decay == "wsd" and o.wsd_decay_start is not None and (o.warmup_steps or 0) > o.wsd_decay_start:
        raise ConfigError(f"optim.wsd_decay_start={o.wsd_decay_start} falls inside the warmup "
                          f"(optim.warmup_steps={o.warmup_steps}): set it to at least {o.warmup_steps}")
    if t.max_steps is None and t.epochs is None:
        raise ConfigError("set train.max_steps and/or train.epochs: the run needs an end")
    if d.max_seq_length > m.max_position_embeddings and m.name_or_path is None:
        raise ConfigError(f"data.max_seq_length={d.max_seq_length} exceeds "
                          f"model.max_position_embeddings={m.max_position_embeddings}")
    check_architecture(cfg)
    c = cfg.checkpoint
    if c.init_optimizer and not c.init_from:
        raise ConfigError("checkpoint.init_optimizer=true needs checkpoint.init_from (the run whose optimizer state to "
                          "carry over)")
    if c.init_from and m.name_or_path:
        raise ConfigError(f"checkpoint.init_from={c.init_from} and model.name_or_path={m.name_or_path} both give the "
                          "weights: keep one (init_from: a run's checkpoint; name_or_path: an export or a Hub model)")
    from ..architectures import ARCHITECTURES
    for a, b in ARCHITECTURES[m.architecture].divisible if m.name_or_path is None else ():   # its row's relations
        if getattr(m, a) is not None and getattr(m, b) is not None and getattr(m, a) % getattr(m, b):   # unset: the
            # architecture's default, which divides
            raise ConfigError(f"model.{a}={getattr(m, a)} is not divisible by model.{b}={getattr(m, b)}")
    if d.source == "sample" and TASKS[cfg.task.kind].sample is None:
        raise ConfigError(f"data.source=sample: the embedded sample has no data for task.kind={cfg.task.kind}; give "
                          "data.source=files (data.train_files) or data.source=hub (data.dataset_name)")
    if d.source == "hub" and not d.dataset_name:
        raise ConfigError("data.source=hub needs data.dataset_name (e.g. wikitext or glue)")
    if d.source == "prepared" and TASKS[cfg.task.kind].masked_lm and d.packing:
        raise ConfigError("data.source=prepared: packed MLM reads a token store now, which a run makes of its text on "
                          "first use, in data.cache_dir (bert_recipes/data/store_cache.py): give the source the directory "
                          "was prepared from (data.source=sample, hub or files); to make the store ahead of time, make "
                          "prepare RECIPE=<this recipe> OUT=DIR, then train with --data.cache_dir=DIR")
    if d.source == "prepared" and not d.prepared_dir:
        raise ConfigError("data.source=prepared needs data.prepared_dir (a directory written by make prepare: "
                          "classification, or MLM a line a row)")
    if d.source == "store" and not d.store_dir:
        raise ConfigError("data.source=store needs data.store_dir (a directory written by make prepare STORE=1)")
    if d.source == "store" and not (TASKS[cfg.task.kind].masked_lm and d.packing):
        raise ConfigError(f"data.source=store holds packed MLM blocks: it needs task.kind=mlm and data.packing=true "
                          f"(now task.kind={cfg.task.kind}, data.packing={d.packing}); train from data.source=files")
    if d.source == "files" and not d.train_files and d.mixture is None:
        raise ConfigError("data.source=files needs data.train_files (or data.mixture: sources by weight)")
    row = TASKS[cfg.task.kind]
    if not row.masked_lm and m.name_or_path is None and cfg.tokenizer.name_or_path is None:   # MLM trains its own
        raise ConfigError(f"{cfg.task.kind} needs a tokenizer: set model.name_or_path (a pretrained "
                          "or exported model) or tokenizer.name_or_path")
    if row.sentence_embeddings:
        if not cfg.data.text_pair_column:
            raise ConfigError(f"task.kind={cfg.task.kind} needs data.text_pair_column: the positive passage's column "
                              "(data.text_column is the query's), e.g. data.text_pair_column=positive")
        if cfg.data.unpad:
            raise ConfigError(f"data.unpad=true: task.kind={cfg.task.kind} pools each text over its own padded row "
                              "(task.pooling); set data.unpad=false")
        if cfg.data.group_by_length:
            raise ConfigError(f"data.group_by_length=true: task.kind={cfg.task.kind} batches a query with its passages, "
                              "whose lengths differ; set data.group_by_length=false")
    if row.labelled:
        if cfg.task.label_names and len(cfg.task.label_names) != cfg.task.num_labels:
            raise ConfigError(f"task.label_names has {len(cfg.task.label_names)} names but "
                              f"task.num_labels={cfg.task.num_labels}")
    for name in cfg.task.metrics or []:
        if name not in available_metrics():
            raise ConfigError(f"task.metrics: unknown metric '{name}' (available: {available_metrics()})")
    if cfg.data.test_splits and not row.test_predictions:
        writes = [kind for kind, r in TASKS.items() if r.test_predictions]
        raise ConfigError(f"data.test_splits: test predictions are for {' or '.join(writes)} tasks (task.kind="
                          f"{' or '.join(writes)}; now {cfg.task.kind}): remove it")
    best = cfg.checkpoint.metric_for_best
    reported = reported_metrics(cfg.task)
    if best is not None and best not in reported:
        raise ConfigError(f"checkpoint.metric_for_best={best} is not among this task's evaluation metrics {reported}")
    check_documents(cfg)
    check_mask_rate(cfg)
    check_mixture(cfg)
    if cfg.checkpoint.push_to_hub and not (cfg.checkpoint.hub_model_id and cfg.checkpoint.export):
        raise ConfigError("checkpoint.push_to_hub needs checkpoint.hub_model_id (user-or-org/name) and "
                          "checkpoint.export: true")
