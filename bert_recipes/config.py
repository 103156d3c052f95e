"""One typed dataclass tree holds every setting and its default. Recipe YAML sections map
onto it one to one. Precedence: defaults < recipe < `--section.key=value` overrides.

Unknown keys and wrong types are errors that name the key. Relations between values
(batch arithmetic, task/model consistency) are checked up front by `validate`, with the
numbers in the message.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from .metrics import available_metrics, default_metrics   # the metric scripts' names (stdlib only)


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message names the key."""


def first_line(err: BaseException) -> str:
    """An exception's message in one line, for messages that quote a library's error."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


@dataclass
class RunConfig:
    name: str = "bert"
    """Run name, used for the tracker run and the log lines."""
    output_dir: str = "runs/bert"
    """Everything the run writes goes here: checkpoints/, model/, logs/, metrics.json, curves.png."""
    seed: int = 42
    """Seeds python, numpy and torch on every rank (model init is identical on all ranks)."""
    overwrite: bool = False
    """A new run (no checkpoint.resume) in an output_dir that already holds checkpoints is refused;
    true deletes them (and the old model/, metrics.json) and starts over."""


@dataclass
class TaskConfig:
    kind: Literal["mlm", "classification"] = "mlm"
    """mlm: masked-LM pretraining (BertForMaskedLM). classification: BertForSequenceClassification."""
    num_labels: int = 2
    """classification only. 1 means regression (MSE loss, Pearson/Spearman), e.g. STS-B."""
    metrics: Optional[list[str]] = None
    """Metric scripts from bert_recipes/metrics. None: accuracy+f1 (classification),
    pearsonr+spearmanr (regression); mlm always reports loss and perplexity."""
    label_names: Optional[list[str]] = None
    """Optional label names, saved into the exported model config (id2label)."""


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = None
    """Hub name or local directory to start from (e.g. an exported mlm run's model/ dir).
    None: a fresh BertConfig built from the fields below."""
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    hidden_dropout_prob: Optional[float] = None
    """None keeps the checkpoint's value (0.1 for a fresh BertConfig)."""
    attention_probs_dropout_prob: Optional[float] = None
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    dropout_impl: Literal["torch", "packed"] = "torch"
    """How dropout masks are drawn; the keep probability and scaling are torch's either way. torch:
    torch's dropout (fused on GPUs). packed, an opt-in for CPUs only (refused on GPUs, ignored under
    train.compile): four 16-bit words per 64-bit random draw (bert_recipes/dropout.py; keep probability
    exact to 2^-17) instead of torch's serial per-element bernoulli_, and a BERT encoder's attention
    dropout then runs SDPA's math path with that mask. make bench measures it (the "packed dropout" row)."""
    sparse_mlm_head: bool = True
    """mlm: run the prediction head on masked positions only (same loss, ~3x less head compute)."""
    gradient_checkpointing: bool = False
    """Recompute encoder activations in backward: ~30% slower, activations O(layers) smaller."""
    reinit_head: bool = False
    """Classification from a checkpoint fine-tuned for another label count (its classifier has the
    wrong shape): true starts a new classifier on its encoder; false refuses the run."""
    trust_remote_code: bool = False
    """Let a Hub model run its own Python code (from_pretrained's trust_remote_code). Off: BERT
    needs none, and a checkpoint should not execute code you have not read."""


@dataclass
class TokenizerConfig:
    name_or_path: Optional[str] = None
    """Hub name or local directory. None: the model's own tokenizer if model.name_or_path is
    set, else (mlm from scratch) a WordPiece tokenizer trained on the training corpus."""
    vocab_size: int = 30522
    """Size of a tokenizer trained here (the vocabulary actually learned can be smaller)."""
    lowercase: bool = True


@dataclass
class DataConfig:
    source: Literal["sample", "hub", "files", "prepared"] = "sample"
    """sample: the embedded stdlib-docs sample. hub: datasets.load_dataset(dataset_name, dataset_config).
    files: local train_files / validation_files (text, json/jsonl, csv or parquet; plain or .gz/.bz2/.xz; each entry a
    file, a directory or a glob pattern, resolved into the run's config: bert_recipes/corpora.py)."""
    prepared_dir: Optional[str] = None
    """source: prepared: a directory written by `make prepare` (tools/prepare.py): the tokenized,
    packed splits, memory-mapped by every rank, and the tokenizer; training starts in seconds."""
    dataset_name: Optional[str] = None
    dataset_config: Optional[str] = None
    train_files: Optional[list[str]] = None
    validation_files: Optional[list[str]] = None
    train_split: str = "train"
    eval_split: str = "validation"
    validation_split_percentage: int = 5
    """When the source has no eval split, hold out this percent of train (seeded)."""
    text_column: str = "text"
    text_pair_column: Optional[str] = None
    """classification on sentence pairs (MRPC, MNLI, ...): the second sentence's column."""
    label_column: str = "label"
    max_seq_length: int = 128
    group_by_length: bool = False
    """Batch sequences of similar length together (classification, unpacked MLM), so little compute
    goes to padding: ~70% of the positions of the sample task are padding without, under 10% with.
    Still exact on resume. (The pipeline pads to max_seq_length anyway: no effect there.)"""
    length_bins: Union[int, Literal["auto"]] = "auto"
    """Padded batches (classification, unpacked MLM) are padded to one of at most this many lengths: the
    quantiles of the training set's lengths that leave the least padding (the longest length of the run's
    splits is always one), so the same few shapes repeat: each new shape costs kernels, cuDNN graphs and a
    torch.compile recompile. auto: 8 on GPUs, off on CPUs; 0: off (each batch padded to its longest, rounded up to a
    multiple of 8 on GPUs). At most 8: dynamo's recompile limit (train.compile compiles each bin once)."""
    packing: bool = True
    """mlm only. True: concatenate then chunk into full blocks (no padding, standard for
    pretraining). False: one line per example, padded dynamically per batch."""
    mlm_probability: float = 0.15
    """Share of tokens selected; of those 80% -> [MASK], 10% -> random token, 10% kept."""
    max_predictions_per_seq: Union[int, Literal["auto"], None] = "auto"
    """mlm: K. Exactly min(K, round(mlm_probability x tokens)) tokens of each sequence are chosen, as
    BERT's own data pipeline, and passed to the model as K positions: static shapes (train.compile needs
    them) and no host sync. auto: K = round(mlm_probability x max_seq_length), 19 at 128 and 77 at 512:
    the number of tokens BERT masks in a full sequence (its data had 20 and 80 slots, one or three of
    them always empty). null: each token is chosen with probability mlm_probability, and the head
    indexes the masked positions with a boolean mask (shapes vary per batch; a host sync every micro
    batch on a GPU); runs from before the K default resume with a note that this setting changed."""
    whole_word_masking: bool = False
    """mlm: select whole words (a WordPiece token and its "##" pieces) rather than single tokens, as
    BERT's whole-word-masking checkpoints were trained; still a pure function of (seed, epoch, example)."""
    extra_eval_splits: Optional[list[str]] = None
    """More labelled splits evaluated at the end (MNLI: [validation_mismatched]); their metrics are
    reported as <split>/<metric>."""
    test_splits: Optional[list[str]] = None
    """classification: splits to predict at the end, into output_dir/predictions/<split>.tsv (index and
    prediction, label names where task.label_names gives them): GLUE's test sets, labels hidden."""
    max_train_samples: Optional[int] = None
    """The first N training examples (lines or rows), before tokenizing and packing. Prepared data
    records the limits it was prepared with; a run must give the same."""
    max_eval_samples: Optional[int] = None
    num_proc: Optional[int] = None
    """Processes for datasets.map tokenization (results are cached by fingerprint)."""
    num_workers: Union[int, Literal["auto"]] = "auto"
    """DataLoader worker processes per rank. auto: 0 on CPUs (the step needs every core), and on GPUs
    min(4, cores this rank may use - 1): the cores of os.sched_getaffinity shared by the node's ranks
    (LOCAL_WORLD_SIZE), one kept for the training process. Resolved before the run and logged."""
    persistent_workers: bool = True
    """Keep DataLoader workers alive across epochs (needs num_workers > 0). MLM masks still change every
    epoch: the collator's epoch lives in shared memory, which the workers read."""
    pin_memory: bool = True
    """Pinned host memory for faster host->GPU copies (ignored on CPU)."""
    cache_dir: Optional[str] = None
    """datasets cache; None = HF_DATASETS_CACHE default."""
    sample_dir: str = "data/sample"
    """Where the embedded sample is built (source: sample)."""
    prepare_timeout_s: float = 7200.0
    """How long the other ranks wait for rank 0 to download, tokenize and cache the data (a
    separate, long wait: the short train.collective_timeout_s would kill a first run on a big corpus)."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "lamb"] = "adamw"
    """adamw, or lamb for very large batches (NVIDIA's BERT: global 64k/32k with LAMB). LAMB's
    per-layer trust ratio needs whole parameter tensors: DDP only (not ZeRO, FSDP or a ZeRO pipeline)."""
    lamb_trust_ratio: Literal["decayed", "all"] = "decayed"
    """Where LAMB scales the update by the trust ratio ||w|| / ||u||. decayed: only the tensors with weight
    decay (apex FusedLAMB's default use_nvlamb=False, NVIDIA's BERT pretraining, timm's always_adapt=False);
    biases and LayerNorm weights take plain Adam steps. all: every tensor (use_nvlamb=True; this project's
    rule before 2026-12-03, which a checkpoint without this key was trained with)."""
    lr: float = 1e-4
    """Peak learning rate, reached after warmup."""
    fused: bool = True
    """AdamW's kernel: true: torch's fused kernel (CUDA and CPU); false: the foreach (multi-tensor)
    one. On the 2-core CPU, fused is 3-8% faster per step (make bench, docs/speed.md)."""
    cpu_adam: bool = True
    """Under ZeRO offload the optimizer steps on the CPU: DeepSpeed's vectorised CPU Adam, built from
    these settings (the maths stays the recipe's). false: torch's AdamW on the CPU."""
    weight_decay: float = 0.01
    """Applied to weights only: biases and LayerNorm parameters get none."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup_steps: Optional[int] = None
    warmup_ratio: float = 0.0
    """Used when warmup_steps is None: warmup = ratio x total optimizer steps."""
    decay: Literal["linear", "cosine", "polynomial", "constant", "wsd"] = "linear"
    """After warmup: linear, cosine, polynomial ((1 - progress) ** poly_power), constant, or wsd
    (warmup-stable-decay: the peak lr held until the decay phase, then wsd_decay_shape down to min_lr_ratio).
    Only wsd lets a stable-phase checkpoint resume with a larger train.max_steps and its past unchanged: the
    others are shaped by the run's length from the first step (docs/config.md#warmup-stable-decay)."""
    wsd_decay_ratio: float = 0.2
    """wsd: the share of the run's steps that decay (the last round(ratio x steps); torchtitan's decay_ratio).
    0: none (a constant lr after warmup, to decay later from a checkpoint). Ignored when wsd_decay_start is set."""
    wsd_decay_start: Optional[int] = None
    """wsd: the first decay step (0-based optimizer step, at least the warmup's steps) instead of a ratio; at
    or beyond the run's last step the run never decays (resume it with a larger train.max_steps to decay)."""
    wsd_decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"
    """wsd: the decay's shape over progress p in [0, 1): 1 - p, (1 + cos(pi p)) / 2, or 1 - sqrt(p)
    (transformers' decay_type names; 1-sqrt: ModernBERT's, best of the three in Hägele et al. 2024)."""
    poly_power: float = 1.0
    """The exponent of the polynomial decay (NVIDIA's LAMB phase 1 uses 0.5)."""
    min_lr_ratio: float = 0.0
    """The lr decays to min_lr_ratio x lr at the last step."""


@dataclass
class TrainConfig:
    global_batch_size: int = 32
    """Sequences per optimizer step, summed over all ranks and accumulation steps."""
    micro_batch_size: Union[int, Literal["auto"]] = 32
    """Sequences per forward pass on one rank. Accumulation = global / (micro x world). auto (GPUs): the
    largest divisor of global / data-parallel ranks that the memory planner says fits this GPU's free
    memory with a margin (bert_recipes.memory.auto_micro_batch), decided before the run starts, written
    into its resolved config (a resume keeps it) and logged with the reason. Under DDP a trial of one whole
    step (optimizer states included) then confirms it on every GPU before the model is wrapped, stepping
    down to the next divisor on an out-of-memory error; the ranks take the smallest (bert_recipes/trial.py).
    Under ZeRO, FSDP and the pipeline the planner's choice stands untried. Refused on CPU processes."""
    eval_batch_size: Optional[int] = None
    """Per rank; None = micro_batch_size."""
    max_steps: Optional[int] = None
    """Optimizer steps. If both max_steps and epochs are set, the first reached stops."""
    epochs: Optional[float] = None
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """fp16 needs a CUDA GPU: on a CPU it is refused (Accelerate would silently ignore it)."""
    compile: bool = False
    """torch.compile the model (inductor): fused kernels, faster steps after a compile of the first
    steps (make bench measures both). mlm needs static shapes: data.max_predictions_per_seq. Shapes
    that repeat (packed MLM blocks, data.length_bins) compile with dynamic=False, one graph each;
    evaluation runs eagerly (torch.compiler.set_stance("force_eager")), so it adds no graphs."""
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = "default"
    """torch.compile's mode (inductor's; the eager backends ignore it). reduce-overhead: CUDA graphs (the
    fewest host launches; needs static shapes), refused with accumulation over 1 until a GPU run covers it (a
    graph's next replay overwrites the losses the step keeps: backends.consistency.check_cuda_graphs);
    max-autotune-no-cudagraphs: inductor tries kernel configurations (compiles for minutes). train.compile
    runs under DDP (no_sync included) and ZeRO-1/2; under ZeRO-3 it is refused (docs/troubleshooting.md)."""
    compile_backend: Literal["inductor", "eager", "aot_eager"] = "inductor"
    """inductor generates the kernels. eager / aot_eager are dynamo's debugging backends: the same
    tracing and guards, no kernels, so recompiles can be checked in seconds."""
    tf32: bool = True
    """On GPUs of compute capability 8.0 or newer, fp32 matmuls run on TF32 tensor cores (10-bit
    mantissa, ~8x the fp32 rate), as NVIDIA's BERT recipes train; MFU divides by the TF32 peak.
    false: full-FP32 matmuls, and MFU against the FP32 peak. Has no effect on CPUs."""
    eval_every: Optional[int] = None
    """Evaluate every N optimizer steps (and at the end, see eval_final). None: only at the end."""
    eval_final: bool = True
    """Evaluate once more at the end of the run. false: no final evaluation (benchmarks, launch-cost
    measurements): metrics.json then has the evaluations of train.eval_every only."""
    halt_at_step: Optional[int] = None
    """Stop at this step after saving a checkpoint, as if the job's time ran out; the schedule
    still spans the whole run. Continue with --resume auto (splits a run over job-time limits)."""
    max_bad_steps: int = 10
    """Updates with a non-finite loss or gradient norm are skipped and counted; this many in a row
    stop the run with a diagnosis (exit code 3), keeping the last good checkpoint."""
    collective_timeout_s: float = 600.0
    """The longest any collective (all-reduce, barrier) may wait for a peer. A stuck rank or a lost
    node then ends the run with exit code 4 and a message, instead of hanging (NCCL's own default is
    10 minutes; gloo's 30)."""


@dataclass
class CheckpointConfig:
    save_every: Optional[int] = None
    """accelerator.save_state every N optimizer steps (and always at the end)."""
    keep_last: int = 2
    """Older checkpoints are deleted once a newer one is complete."""
    resume: Optional[str] = None
    """None: start fresh. 'auto': the latest complete checkpoint in output_dir, if any.
    Or a path to one checkpoint directory."""
    save_final: bool = True
    """Save a checkpoint at the end of a finished run (a halted or preempted run always saves one, to
    resume from). false: benchmarks, which need no 1.3 GB checkpoint of BERT-base."""
    export: bool = True
    """At the end, write model + tokenizer in Hugging Face format to output_dir/model."""
    metric_for_best: Optional[str] = None
    """An evaluation metric (accuracy, f1, matthews_correlation, pearsonr, spearmanr, eval_loss, ...):
    the state of the best evaluation is kept in checkpoints/best, apart from the rotation, and the
    export, the final metrics and the test predictions come from it. None: from the last step."""
    push_to_hub: bool = False
    """Upload the export (with its model card) to the Hugging Face Hub at the end (needs
    checkpoint.hub_model_id and a login: huggingface-cli login, or HF_TOKEN)."""
    hub_model_id: Optional[str] = None
    """user-or-org/name of the Hub repository for checkpoint.push_to_hub (created if missing)."""


@dataclass
class LoggingConfig:
    log_every: int = 10
    """Optimizer steps between log lines / tracker points."""
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Any of tensorboard, wandb, mlflow (the last two when installed); [] for none."""
    progress_bar: bool = True
    profile: bool = False
    """torch.profiler over steps 2-4 (wait 1, warmup 1, active 3): a TensorBoard trace in
    output_dir/profile and a printed top-10 of operators by self time. CLI: --profile."""
    dataloader_warn_share: float = 0.2
    """Warn (once) when more than this share of step time is spent waiting for batches, on the rank that
    waits most (one slow rank holds every other one back)."""
    gpu_sampler: bool = True
    """On GPUs: NVML every 0.5 s in a background thread (GPU and memory busy, SM clock, temperature,
    throttle reasons; bert_recipes/doctor/nvml.Sampler). Each log line gets the GPU's busy share and any
    throttling, metrics.json the window's aggregates. It never touches a CUDA stream. Off on CPU runs."""
    plot: bool = True
    """Write curves.png (loss and eval metrics) to output_dir at the end."""
    sync_audit: bool = False
    """Count, in the steps between log steps, the calls that would make the host wait for a GPU (a
    tensor read as a number, copied to the host, or indexed by a boolean mask; synchronize), by call
    site: each log line gets `host_syncs`, metrics.json the sites (bert_recipes.perf.SyncAudit). It also
    counts the host-to-device copies the repository's own code makes in the step (a tensor built from
    Python data on the device, a copy onto it). On a GPU it turns on torch.cuda.set_sync_debug_mode("warn")
    in the step too, and each log line gets `sync_warnings`. A diagnostic: it slows the step it watches."""
    step_times: bool = False
    """Time every optimizer step (CUDA events on a GPU, read at log steps without waiting in between;
    the host clock on a CPU): each log row gets `step_times_ms`. make bench's fine-tuning rows use it."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


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


def predated_rules(old: dict, new: dict) -> tuple[list[str], set[str]]:
    """A saved config (flat 'section.key' dicts, as checkpoint.config_differences reads them) from before a
    key existed followed the rule of its time: -> (a line for each rule that changes from here on, the keys
    those lines account for). A key it lacks that changes nothing is no difference either."""
    key = "optim.lamb_trust_ratio"
    if key in old or key not in new:
        return [], set()
    if "lamb" not in (old.get("optim.name"), new.get("optim.name")) or new[key] == "all":
        return [], {key}   # AdamW has no trust ratio; "all" is the old rule
    return [f"LAMB's trust ratio changed: the checkpoint was trained with it on every tensor (the rule before "
            f"{key} existed, = all); from here on only where weight decay applies ({key}={new[key]}, apex "
            f"FusedLAMB's and NVIDIA BERT's); --{key}=all keeps the old rule"], {key}


def flat_dict(cfg: Config) -> dict[str, Any]:
    """section/key -> scalar (lists and None as strings), as trackers' hparams want it."""
    out = {}
    for section, values in to_dict(cfg).items():
        for key, v in values.items():
            out[f"{section}/{key}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


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
    chosen = round(cfg.data.mlm_probability * cfg.data.max_seq_length)
    k = cfg.data.max_predictions_per_seq if cfg.task.kind == "mlm" else None
    if slots and isinstance(k, int) and k > max(1, chosen):   # slots: the pipeline's head predicts every position
        out.append(f"[warning] data.max_predictions_per_seq={k}, but at most round(data.mlm_probability x "
                   f"data.max_seq_length) = {max(1, chosen)} tokens of a sequence are chosen: {k - max(1, chosen)} of "
                   f"its {k} slots are always empty (the head computes them for nothing); set it to {max(1, chosen)} or auto")
    return out


# The keys that name paths (and train.py's --recipe), and what the run does with each: bert_recipes.preflight
# checks every one before a rank starts; the generated bad-input matrix tries a path of each wrong kind.
# "read dir or hub": a local directory, or a Hub id where the value cannot be a path (preflight.looks_local).
PATH_KEYS = {
    "recipe": "read file",
    "run.output_dir": "write dir",
    "model.name_or_path": "read dir or hub",
    "tokenizer.name_or_path": "read dir or hub",
    "data.prepared_dir": "read dir",
    "data.train_files": "read files",
    "data.validation_files": "read files",
    "data.cache_dir": "write dir",
    "data.sample_dir": "write dir",
    "checkpoint.resume": "read dir",
}


@dataclass(frozen=True)
class Range:
    """What a single value may be: at least `low` (more than it if open_low), at most `high` (less than it
    if open_high); the texts in `also` (a Literal choice such as auto) and None (unset) always pass.
    items: a list of exactly this many values, each in the range. The generated bad-input matrix
    (tests/test_input_matrix.py) tries a value just outside every range."""
    key: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    also: tuple[str, ...] = ()
    hint: str = ""
    items: int | None = None

    def __post_init__(self):
        assert self.low is not None, f"{self.key}: a range needs its low end"

    def ok(self, value) -> bool:
        if isinstance(value, str):
            return value in self.also
        if self.items is not None:
            return len(value) == self.items and all(self._within(v) for v in value)
        return self._within(value)

    def _within(self, v) -> bool:
        return ((self.low is None or (v > self.low if self.open_low else v >= self.low))
                and (self.high is None or (v < self.high if self.open_high else v <= self.high)))

    def must(self) -> str:
        if self.high is None:
            text = ("positive" if self.low == 0 and self.open_low else
                    f"{'>' if self.open_low else '>='} {_number(self.low)}")
        else:
            text = (f"in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}"
                    f"{')' if self.open_high else ']'}")
        if self.items is not None:
            text = f"{self.items} values, each {text}"
        text += "".join(f", or {choice}" for choice in self.also)
        return f"{text} ({self.hint})" if self.hint else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


POSITIVE = {"low": 0, "open_low": True}
# The ranges of single values; None (unset) always passes. A number-valued key with no range here is
# listed, with the reason, in tests/test_input_matrix.py (NO_RANGE).
_RANGES = [
    Range("run.seed", low=0, high=2**32 - 1, hint="numpy's generator takes no other"),
    Range("train.global_batch_size", **POSITIVE),
    Range("train.micro_batch_size", **POSITIVE, also=("auto",), hint="auto: GPUs"),
    Range("train.eval_batch_size", **POSITIVE),
    Range("train.max_steps", **POSITIVE),
    Range("train.epochs", **POSITIVE),
    Range("train.eval_every", **POSITIVE, hint="steps"),
    Range("train.halt_at_step", **POSITIVE, hint="a step"),
    Range("train.max_bad_steps", low=1),
    Range("train.collective_timeout_s", **POSITIVE, hint="seconds"),
    Range("optim.lr", **POSITIVE, hint="e.g. 1e-4"),
    Range("optim.weight_decay", low=0),
    Range("optim.eps", **POSITIVE, hint="e.g. 1e-8"),
    Range("optim.max_grad_norm", low=0, hint="0 disables clipping"),
    Range("optim.warmup_steps", low=0),
    Range("optim.warmup_ratio", low=0, high=1, open_high=True),
    Range("optim.min_lr_ratio", low=0, high=1),
    Range("optim.poly_power", **POSITIVE, hint="e.g. 0.5 or 1"),
    Range("optim.wsd_decay_ratio", low=0, high=1, hint="the share of steps that decay, e.g. 0.2"),
    Range("optim.wsd_decay_start", low=0, hint="a 0-based optimizer step"),
    Range("optim.betas", low=0, high=1, open_high=True, items=2, hint="e.g. [0.9, 0.999]"),
    Range("data.mlm_probability", low=0, high=1, open_low=True, open_high=True, hint="e.g. 0.15"),
    Range("data.max_seq_length", low=8, hint="tokens"),
    Range("data.max_train_samples", **POSITIVE),
    Range("data.max_predictions_per_seq", **POSITIVE, also=("auto",)),
    Range("data.max_eval_samples", **POSITIVE),
    Range("data.validation_split_percentage", low=0, high=100, open_low=True, open_high=True),
    Range("data.num_proc", low=1, hint="processes"),
    Range("data.num_workers", low=0, also=("auto",)),
    Range("data.length_bins", low=0, high=8, also=("auto",)),
    Range("data.prepare_timeout_s", **POSITIVE, hint="seconds"),
    Range("model.hidden_size", **POSITIVE),
    Range("model.num_hidden_layers", **POSITIVE),
    Range("model.num_attention_heads", **POSITIVE),
    Range("model.intermediate_size", **POSITIVE),
    Range("model.max_position_embeddings", low=8, hint="positions, at least data.max_seq_length"),
    Range("model.hidden_dropout_prob", low=0, high=1, open_high=True),
    Range("model.attention_probs_dropout_prob", low=0, high=1, open_high=True),
    Range("task.num_labels", low=1, hint="1 = regression"),
    Range("tokenizer.vocab_size", low=100),
    Range("checkpoint.save_every", **POSITIVE, hint="steps"),
    Range("checkpoint.keep_last", low=1),
    Range("logging.log_every", **POSITIVE, hint="steps"),
    Range("logging.dataloader_warn_share", low=0, high=1),
]


def predictions_per_seq(cfg: Config) -> int | None:
    """K of data.max_predictions_per_seq ("auto": round(mlm_probability x max_seq_length)); None: the
    per-token Bernoulli choice, or not MLM."""
    d = cfg.data
    if cfg.task.kind != "mlm":
        return None
    if d.max_predictions_per_seq == "auto" or (d.max_predictions_per_seq is None and cfg.train.compile):
        return max(1, round(d.mlm_probability * d.max_seq_length))
    return d.max_predictions_per_seq


def packed_dropout_here(impl: str, compile: bool, device_type: str) -> bool:
    """Does this run draw packed dropout masks? model.dropout_impl=packed, on a CPU, without
    train.compile. The run (build_model, with plan.on_gpu's device) and the memory planner
    (bert_recipes.activations, with the device it plans for) both ask this; the device is an input."""
    return impl == "packed" and device_type == "cpu" and not compile


def padded_batches(cfg: Config) -> bool:
    """Are this run's batches padded (lengths that vary, an attention mask)? Packed MLM blocks are not."""
    return cfg.task.kind != "mlm" or not cfg.data.packing


def repeating_shapes(cfg: Config) -> bool:
    """Do the training batches take a fixed set of shapes (so torch.compile can compile each once, with
    dynamic=False)? Packed MLM blocks with K predictions (or the dense head) have one shape; padded
    batches repeat only with length bins (data.length_bins, once resolved to a number)."""
    if padded_batches(cfg):
        return isinstance(cfg.data.length_bins, int) and cfg.data.length_bins > 0
    return cfg.task.kind != "mlm" or cfg.data.max_predictions_per_seq is not None or not cfg.model.sparse_mlm_head


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
    if m.name_or_path is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if d.source == "hub" and not d.dataset_name:
        raise ConfigError("data.source=hub needs data.dataset_name (e.g. wikitext or glue)")
    if d.source == "prepared" and not d.prepared_dir:
        raise ConfigError("data.source=prepared needs data.prepared_dir (a directory written by make prepare)")
    if d.source == "files" and not d.train_files:
        raise ConfigError("data.source=files needs data.train_files")
    if cfg.task.kind == "classification":
        if m.name_or_path is None and cfg.tokenizer.name_or_path is None:
            raise ConfigError("classification needs a tokenizer: set model.name_or_path (a pretrained "
                              "or exported model) or tokenizer.name_or_path")
        if cfg.task.label_names and len(cfg.task.label_names) != cfg.task.num_labels:
            raise ConfigError(f"task.label_names has {len(cfg.task.label_names)} names but "
                              f"task.num_labels={cfg.task.num_labels}")
    for name in cfg.task.metrics or []:
        if name not in available_metrics():
            raise ConfigError(f"task.metrics: unknown metric '{name}' (available: {available_metrics()})")
    if cfg.data.test_splits and cfg.task.kind != "classification":
        raise ConfigError("data.test_splits: test predictions are for classification tasks (task.kind=classification)")
    best = cfg.checkpoint.metric_for_best
    reported = (["eval_loss", "perplexity", "mlm_accuracy"] if cfg.task.kind == "mlm" else
                list(cfg.task.metrics or default_metrics(cfg.task.num_labels)) + (["eval_loss"] if cfg.task.num_labels == 1 else []))
    if best is not None and best not in reported:
        raise ConfigError(f"checkpoint.metric_for_best={best} is not among this task's evaluation metrics {reported}")
    if cfg.checkpoint.push_to_hub and not (cfg.checkpoint.hub_model_id and cfg.checkpoint.export):
        raise ConfigError("checkpoint.push_to_hub needs checkpoint.hub_model_id (user-or-org/name) and "
                          "checkpoint.export: true")
