"""The schema: one typed dataclass tree holds every setting, its default and, beside the field, its range.
Recipe YAML sections map onto it one to one (bert_recipes/config/loading.py reads them in).

A number's range sits in the field: `lr: float = ranged(1e-4, **POSITIVE, hint="e.g. 1e-4")`. `_RANGES` is
collected from the fields, so a new ranged key is one edit, here; config/rules.py's `validate` checks them
and tests/test_input_matrix.py tries a value just outside each.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union


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


def ranged(default: Any = None, *, factory: Callable[[], Any] | None = None, **limits) -> Any:
    """A dataclass field whose value must lie in a range: `limits` are Range's arguments without the key
    (the field's own section.key). factory: a default built per instance (a list)."""
    meta = {"range": limits}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    name: str = "bert"
    """Run name, used for the tracker run and the log lines."""
    output_dir: str = "runs/bert"
    """Everything the run writes goes here: checkpoints/, model/, logs/, metrics.json, curves.png."""
    seed: int = ranged(42, low=0, high=2**32 - 1, hint="numpy's generator takes no other")
    """Seeds python, numpy and torch on every rank (model init is identical on all ranks)."""
    overwrite: bool = False
    """A new run (no checkpoint.resume) in an output_dir that already holds checkpoints is refused;
    true deletes them (and the old model/, metrics.json) and starts over."""
    lock_wait_s: Optional[float] = ranged(None, low=0, hint="seconds")
    """How long this run waits for another live run's hold on output_dir (its run.lock) before it stops with one
    line naming the holder. None: no wait, except under a SLURM requeue (SLURM_RESTART_COUNT > 0): 300, the old
    allocation's time to save its checkpoint and leave (bert_recipes/run_dir.py)."""
    lock_stale_s: float = ranged(120.0, low=30, hint="seconds: at least 3 of the lock's 10-second heartbeats")
    """A hold from another host whose heartbeat (renewed every 10 s from a thread, data preparation included) is
    older than this is stale: its holder is gone (a lost node), and this run takes it over with one line. On the
    same host the holder's process is asked directly."""


@dataclass
class TaskConfig:
    kind: str = "mlm"
    """One of bert_recipes/tasks/'s rows. mlm: masked-LM pretraining (BertForMaskedLM). classification: sequence
    classification or regression (BertForSequenceClassification)."""
    num_labels: int = ranged(2, low=1, hint="1 = regression")
    """classification only. 1 means regression (MSE loss, Pearson/Spearman), e.g. STS-B."""
    metrics: Optional[list[str]] = None
    """Metric scripts from bert_recipes/metrics. None: accuracy+f1 (classification),
    pearsonr+spearmanr (regression); mlm always reports loss and perplexity."""
    label_names: Optional[list[str]] = None
    """Optional label names, saved into the exported model config (id2label)."""
    unanswerable: bool = False
    """question_answering: some questions have no answer in their context (SQuAD v2.0): the null answer ([CLS])
    competes with the best span (task.null_threshold), and the scores split HasAns / NoAns."""
    max_answer_length: int = ranged(30, **POSITIVE, hint="tokens")
    """question_answering: the longest answer span considered (run_qa.py's --max_answer_length)."""
    null_threshold: float = ranged(0.0, low=-100, high=100, hint="a margin of start + end logits")
    """question_answering with task.unanswerable: the empty answer wins where the null score exceeds the best span's
    by more than this (run_qa.py's --null_score_diff_threshold)."""
    pooling: Literal["mean", "cls", "lasttoken"] = "mean"
    """retrieval: how a text's token states become its embedding (sentence-transformers' Pooling modes: the mean over
    its tokens, its first token, its last); the export's 1_Pooling/config.json says the same."""
    temperature: float = ranged(0.05, low=0, open_low=True, high=10, hint="sentence-transformers' scale 20 = 0.05")
    """retrieval: the in-batch softmax's temperature over cosine similarities (MultipleNegativesRankingLoss's scale is
    its inverse)."""
    negatives: Literal["global", "micro"] = "global"
    """retrieval: whose passages a query is scored against. global: every query's positive and hard negatives of the
    whole optimizer step on every rank (GradCache: the loss is the same on any process count and accumulation).
    micro: those of the micro batches of one accumulation step, gathered across ranks (sentence-transformers'
    MultipleNegativesRankingLoss with gather_across_devices): cheaper, but the loss depends on micro batch x
    processes, so a resume on another process count is refused."""


@dataclass
class ModelConfig:
    architecture: Optional[str] = None
    """bert, or modernbert (RoPE, GeGLU, pre-norm without biases, local and global attention layers): one of
    bert_recipes/architectures/'s rows. None (the default): the checkpoint's own, as its config says (name_or_path's
    model_type; checkpoint.init_from's run), else bert for a fresh model; decided once, by config.validate, and saved
    so. Named beside a checkpoint of another architecture: one line."""
    name_or_path: Optional[str] = None
    """Hub name or local directory to start from (e.g. an exported mlm run's model/ dir).
    None: a fresh config of the architecture built from the fields below."""
    hidden_size: int = ranged(768, **POSITIVE)
    num_hidden_layers: int = ranged(12, **POSITIVE)
    num_attention_heads: int = ranged(12, **POSITIVE)
    intermediate_size: int = ranged(3072, **POSITIVE)
    max_position_embeddings: int = ranged(512, low=8, hint="positions, at least data.max_seq_length")
    hidden_dropout_prob: Optional[float] = ranged(None, low=0, high=1, open_high=True)
    """BERT's. None keeps the checkpoint's value (0.1 for a fresh BertConfig)."""
    attention_probs_dropout_prob: Optional[float] = ranged(None, low=0, high=1, open_high=True)
    """None keeps the checkpoint's value (0.1 for a fresh BertConfig, 0 for a fresh ModernBERT, whose
    attention_dropout it sets)."""
    attention_output_dropout: Optional[float] = ranged(None, low=0, high=1, open_high=True)
    """ModernBERT's: the dropout of the attention's output (after its projection Wo: ModernBERT's
    attn_out_dropout_prob, 0.1 in its pretraining), apart from the attention probabilities' (attention_probs_dropout_prob,
    0 there). It runs on every attention path, varlen and flex included. None: attention_probs_dropout_prob's value, as
    transformers' one attention_dropout drives both. The export's config.json keeps it as `attention_output_dropout`
    (transformers' own class ignores the key: inference has no dropout). BERT's hidden_dropout_prob covers it."""
    local_attention: Optional[int] = ranged(None, low=2, hint="tokens a local layer sees, e.g. 128")
    """ModernBERT's: the width of a local (sliding-window) layer's attention, centred on each token; None keeps
    the checkpoint's (128 for a fresh one)."""
    global_attn_every_n_layers: Optional[int] = ranged(None, **POSITIVE)
    """ModernBERT's: layers 0, n, 2n, ... attend globally, the others locally (None: 3, ModernBERT's)."""
    global_rope_theta: Optional[float] = ranged(None, **POSITIVE, hint="e.g. 10000 at 1k tokens, 160000 at 8k")
    """ModernBERT's RoPE base of the global layers (None: the checkpoint's; 160,000 for a fresh one)."""
    local_rope_theta: Optional[float] = ranged(None, **POSITIVE)
    """ModernBERT's RoPE base of the local layers (None: the checkpoint's; 10,000 for a fresh one)."""
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
    vocab_size: int = ranged(30522, low=100)
    """Size of a tokenizer trained here (the vocabulary actually learned can be smaller)."""
    lowercase: bool = True


@dataclass
class MixtureSource:
    """One source of data.mixture: its name (metrics and lines name it), its rows: either its files (what
    data.train_files takes: files, directories, glob patterns, compressed or not; resolved into the run's config) or a
    dataset (dataset_name, as data.dataset_name takes: a Hub name or a local directory datasets.load_dataset reads,
    with dataset_config and its split), and its weight (the share of the training stream it gets, relative to the
    other sources' weights)."""
    name: str = ""
    files: list[str] = field(default_factory=list)
    weight: float = 1.0
    dataset_name: Optional[str] = None
    dataset_config: Optional[str] = None
    split: Optional[str] = None
    """a dataset source's split it trains on (holding out data.validation_split_percentage of it); null: train"""


@dataclass
class DataConfig:
    source: Literal["sample", "hub", "files", "prepared", "store"] = "sample"
    """sample: the embedded stdlib-docs sample. hub: datasets.load_dataset(dataset_name, dataset_config).
    files: local train_files / validation_files (text, json/jsonl, csv or parquet; plain or .gz/.bz2/.xz; each entry a
    file, a directory or a glob pattern, resolved into the run's config: bert_recipes/data/files.py). store: a token
    store (store_dir) for MLM pretraining on a large corpus."""
    prepared_dir: Optional[str] = None
    """source: prepared: a directory written by `make prepare` (tools/prepare.py) for classification or MLM a line a
    row: the tokenized splits, memory-mapped by every rank, and the tokenizer; training starts in seconds. (Packed MLM
    reads a token store: its run makes one on first use.)"""
    store_dir: Optional[str] = None
    """source: store: a token store of data.train_files written ahead of time by `make prepare STORE=1` (datatrove:
    flat token files and their documents' boundaries, bert_recipes/data/store.py; on many machines:
    slurm/prepare.sbatch): packed MLM blocks memory-mapped from it, the last
    validation_split_percentage of them held out for evaluation; the tokenizer beside it."""
    dataset_name: Optional[str] = None
    dataset_config: Optional[str] = None
    dataset_revision: Optional[str] = None
    """source: hub: the dataset repository's revision (a branch, tag or commit). A dataset that ships a loading script,
    which datasets 5 does not run, loads from the Hub's parquet conversion: refs/convert/parquet
    (eriktks/conll2003)."""
    train_files: Optional[list[str]] = None
    mixture: Optional[list[MixtureSource]] = None
    """source: files, mlm: training data from several sources, sampled by weight: a list of {name, files, weight}, or
    {name, dataset_name, dataset_config, split, weight} for a dataset (bert_recipes/data/mixture.py). Each source
    holds out data.validation_split_percentage of its rows for evaluation, reported per source (<name>/eval_loss) and overall; each runs its own passes over its rows (a source that runs
    out starts its next pass, with a line). The order is a function of the seed and the position in the run only: a
    resume seeks to it, on any process count. Replaces data.train_files and data.validation_files."""
    validation_files: Optional[list[str]] = None
    train_split: str = "train"
    eval_split: str = "validation"
    validation_split_percentage: int = ranged(5, low=0, high=100, open_low=True, open_high=True)
    """When the source has no eval split, hold out this percent of train (seeded)."""
    text_column: str = "text"
    text_pair_column: Optional[str] = None
    """classification on sentence pairs (MRPC, MNLI, ...): the second sentence's column; retrieval: the positive
    passage's column (data.text_column is the query's)."""
    negative_columns: Optional[list[str]] = None
    """retrieval: columns of hard negatives, a passage each that the query should rank below its positive."""
    beir_dir: Optional[str] = None
    """retrieval: evaluate on a BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv: SciFact, NFCorpus, ...)
    by nDCG@10, MRR@10 and recall@100 instead of the evaluation split's pairs (each query against every positive of
    the split)."""
    doc_stride: int = ranged(128, **POSITIVE, hint="tokens")
    """question_answering: a context longer than a window is read in several, each sharing this many tokens with the
    one before (the tokenizer's stride, as run_qa.py passes its doc_stride); less than data.max_seq_length."""
    label_column: str = "label"
    """classification: a row's label; token_classification: a row's tags, one a word of data.text_column (a list of
    words)."""
    label_all_tokens: bool = False
    """token_classification: every sub-token of a word takes its tag (an I- tag after a B- one, as run_ner.py's
    label_all_tokens); false: only the first, the rest skipped by the loss and the scores."""
    max_seq_length: int = ranged(128, low=8, hint="tokens")
    group_by_length: bool = False
    """Batch sequences of similar length together (classification, unpacked MLM), so little compute
    goes to padding: ~70% of the positions of the sample task are padding without, under 10% with.
    Still exact on resume. (The pipeline pads to max_seq_length anyway: no effect there.)"""
    length_bins: Union[int, Literal["auto"]] = ranged("auto", low=0, high=8, also=("auto",))
    """Padded batches (classification, unpacked MLM) are padded to one of at most this many lengths: the
    quantiles of the training set's lengths that leave the least padding (the longest length of the run's
    splits is always one), so the same few shapes repeat: each new shape costs kernels, cuDNN graphs and a
    torch.compile recompile. auto: 8 on GPUs, off on CPUs; 0: off (each batch padded to its longest, rounded up to a
    multiple of 8 on GPUs). At most 8: dynamo's recompile limit (train.compile compiles each bin once)."""
    packing: Union[bool, Literal["best_fit"]] = True
    """mlm only. True: concatenate then chunk into full blocks (no padding, standard for pretraining), read from a
    token store the run makes of its text on first use, in the data cache (bert_recipes/data/store_cache.py).
    best_fit: ModernBERT's packing, from the same store: whole documents (cut only where longer than a row) packed
    greedily best-fit into rows of data.max_seq_length, the rest of a row padding; needs data.document_mask
    (bert_recipes/data/best_fit.py). False: one line per example, padded dynamically per batch."""
    document_mask: bool = False
    """Packed MLM: attention stays within each document of a packed row, and positions restart at each document
    (a document: a line of .txt, a row of JSON, CSV or parquet; a document longer than a block is cut, and its
    continuation starts the next row as a document of its own, positions from 0). Masking is unchanged. The path
    (a block-diagonal mask on CPUs, varlen or FlexAttention on GPUs) is the run's plan's: bert_recipes/attention.py."""
    unpad: bool = False
    """Fine-tuning and unpacked MLM: the training batch's real tokens run as one row, each sequence attending
    within itself with its own positions, so no compute goes to padding (on GPUs: varlen attention). The pooled
    output, the loss and the metrics are the padded path's; evaluation runs padded."""
    mlm_probability: float = ranged(0.15, low=0, high=1, open_low=True, open_high=True, hint="e.g. 0.15")
    """Share of tokens selected; of those 80% -> [MASK], 10% -> random token, 10% kept. With
    data.mlm_probability_end, the rate the run starts at."""
    mlm_probability_end: Optional[float] = ranged(None, low=0, high=1, open_low=True, open_high=True,
                                                  hint="e.g. 0.05")
    """mlm: the rate the run ends at (this repository's own, for ablations: ModernBERT, ettin and mmBERT change the
    rate only between phases, mmBERT's 0.25, 0.15, 0.05 a phase). The rate moves linearly from data.mlm_probability, in at
    most 8 levels evenly spaced over the run's steps (8 // data.length_bins under train.compile with padded batches:
    each K is one more compiled shape), the first at data.mlm_probability and the last at this; K follows the rate.
    A function of the step and the run's length only: a resume masks as the uninterrupted run
    (bert_recipes/mask_rate.py). null: the rate stays data.mlm_probability."""
    eval_mlm_probability: Optional[float] = ranged(None, low=0, high=1, open_low=True, open_high=True, hint="e.g. 0.15")
    """mlm: the rate evaluation masks at, fixed for the whole run so eval losses compare (ModernBERT evaluates at a
    fixed rate). null: data.mlm_probability, the rate the run starts at (today's recipes are unchanged)."""
    max_predictions_per_seq: Union[int, Literal["auto"], None] = ranged("auto", **POSITIVE, also=("auto",))
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
    max_train_samples: Optional[int] = ranged(None, **POSITIVE)
    """The first N training examples (lines or rows), before tokenizing and packing. Prepared data
    records the limits it was prepared with; a run must give the same."""
    max_eval_samples: Optional[int] = ranged(None, **POSITIVE)
    num_proc: Optional[int] = ranged(None, low=1, hint="processes")
    """Processes that tokenize: datatrove's, making a packed MLM run's token stores; datasets.map's for the rest
    (results are cached by fingerprint)."""
    num_workers: Union[int, Literal["auto"]] = ranged("auto", low=0, also=("auto",))
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
    prepare_timeout_s: float = ranged(7200.0, **POSITIVE, hint="seconds")
    """How long the other ranks wait for rank 0 to download, tokenize and cache the data (a
    separate, long wait: the short train.collective_timeout_s would kill a first run on a big corpus)."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "lamb", "stable_adamw"] = "adamw"
    """adamw; lamb for very large batches (NVIDIA's BERT: global 64k/32k with LAMB); stable_adamw, ModernBERT's
    (AdamW with debiased moments whose step each tensor clips by its update RMS; ModernBERT: betas [0.9, 0.98],
    eps 1e-6; weight decay fully decoupled, scaled by lr / optim.lr). LAMB's trust ratio and StableAdamW's RMS need
    whole parameter tensors: DDP only (not ZeRO, its offload, FSDP or a ZeRO pipeline)."""
    lamb_trust_ratio: Literal["decayed", "all"] = "decayed"
    """Where LAMB scales the update by the trust ratio ||w|| / ||u||. decayed: only the tensors with weight
    decay (apex FusedLAMB's default use_nvlamb=False, NVIDIA's BERT pretraining, timm's always_adapt=False);
    biases and LayerNorm weights take plain Adam steps. all: every tensor (use_nvlamb=True; this project's
    rule before 2026-12-03, which a checkpoint without this key was trained with)."""
    lr: float = ranged(1e-4, **POSITIVE, hint="e.g. 1e-4")
    """Peak learning rate, reached after warmup."""
    fused: bool = True
    """AdamW's kernel: true: torch's fused kernel (CUDA and CPU); false: the foreach (multi-tensor)
    one. On the 2-core CPU, fused is 3-8% faster per step (make bench, docs/speed.md)."""
    cpu_adam: bool = True
    """Under ZeRO offload the optimizer steps on the CPU: DeepSpeed's vectorised CPU Adam, built from
    these settings (the maths stays the recipe's). false: torch's AdamW on the CPU."""
    weight_decay: float = ranged(0.01, low=0)
    """Applied to weights only: biases and LayerNorm parameters get none."""
    betas: list[float] = ranged(factory=lambda: [0.9, 0.999],
                                low=0, high=1, open_high=True, items=2, hint="e.g. [0.9, 0.999]")
    eps: float = ranged(1e-8, **POSITIVE, hint="e.g. 1e-8")
    max_grad_norm: Optional[float] = ranged(None, low=0, hint="0 disables clipping")
    """Clip the global gradient norm to this; 0 disables clipping. None (unset): 1.0, and no clipping under
    optim.name=stable_adamw, as ModernBERT trains (StableAdamW's update clipping replaces it); a clip set with
    StableAdamW prints ModernBERT's warning."""
    warmup_steps: Optional[int] = ranged(None, low=0)
    warmup_ratio: float = ranged(0.0, low=0, high=1, open_high=True)
    """Used when warmup_steps is None: warmup = ratio x total optimizer steps."""
    decay: Literal["linear", "cosine", "polynomial", "constant", "wsd"] = "linear"
    """After warmup: linear, cosine, polynomial ((1 - progress) ** poly_power), constant, or wsd
    (warmup-stable-decay: the peak lr held until the decay phase, then wsd_decay_shape down to min_lr_ratio).
    Only wsd lets a stable-phase checkpoint resume with a larger train.max_steps and its past unchanged: the
    others are shaped by the run's length from the first step (docs/config.md#warmup-stable-decay)."""
    wsd_decay_ratio: float = ranged(0.2, low=0, high=1, hint="the share of steps that decay, e.g. 0.2")
    """wsd: the share of the run's steps that decay (the last round(ratio x steps); torchtitan's decay_ratio).
    0: none (a constant lr after warmup, to decay later from a checkpoint). Ignored when wsd_decay_start is set."""
    wsd_decay_start: Optional[int] = ranged(None, low=0, hint="a 0-based optimizer step")
    """wsd: the first decay step (0-based optimizer step, at least the warmup's steps) instead of a ratio; at
    or beyond the run's last step the run never decays (resume it with a larger train.max_steps to decay)."""
    wsd_decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"
    """wsd: the decay's shape over progress p in [0, 1): 1 - p, (1 + cos(pi p)) / 2, or 1 - sqrt(p)
    (transformers' decay_type names; 1-sqrt: ModernBERT's, best of the three in Hägele et al. 2024)."""
    poly_power: float = ranged(1.0, **POSITIVE, hint="e.g. 0.5 or 1")
    """The exponent of the polynomial decay (NVIDIA's LAMB phase 1 uses 0.5)."""
    min_lr_ratio: float = ranged(0.0, low=0, high=1)
    """The lr decays to min_lr_ratio x lr at the last step."""


@dataclass
class TrainConfig:
    global_batch_size: int = ranged(32, **POSITIVE)
    """Sequences per optimizer step, summed over all ranks and accumulation steps (with a ramp: the batch it ends at)."""
    global_batch_size_start: Optional[int] = ranged(None, **POSITIVE, hint="sequences")
    """A batch that grows (ModernBERT, mmBERT, Megatron's rampup_batch_size): the global batch the run starts at,
    a divisor of train.global_batch_size. The batch rises through stages of multiples of this one
    (train.batch_rampup_stages) over train.batch_rampup_tokens; the micro batch stays, the accumulation grows. The lr schedule counts optimizer
    steps. Exactly resumable on any process count (bert_recipes/batch_ramp.py). Not under the pipeline."""
    batch_rampup_tokens: Optional[int] = ranged(None, **POSITIVE, hint="tokens: sequences x data.max_seq_length")
    """The tokens (sequences x data.max_seq_length) the batch takes to reach train.global_batch_size; each stage's
    steps are rounded so that no step crosses an epoch's end."""
    batch_rampup_stages: Literal["divisors", "multiples"] = "divisors"
    """The ramp's stages. divisors: the multiples of the start that divide the full batch (768 -> 4608: 768, 1536,
    2304, 4608), each but the last for an equal share of the tokens, whole full-size steps each. multiples:
    ModernBERT's (BatchSizeWarmupScheduler, src/sequence_packer.py): every multiple of the start (768, 1536, 2304,
    3072, 3840, 4608: a micro batch a device more each stage where the start is one a device), each but the last
    the same number of steps (its tokens grow with its batch), that number even, and an epoch cut to whole steps of
    every stage (a multiple of lcm(1..full/start) x start sequences). ModernBERT derives its stages from the world
    size; here they come from the recipe alone, so a resume on any process count keeps them."""
    micro_batch_size: Union[int, Literal["auto"]] = ranged(32, **POSITIVE, also=("auto",), hint="auto: GPUs")
    """Sequences per forward pass on one rank. Accumulation = global / (micro x world). auto (GPUs): the
    largest divisor of global / data-parallel ranks that the memory planner says fits this GPU's free
    memory with a margin (bert_recipes.memory.auto_micro_batch), decided before the run starts, written
    into its resolved config (a resume keeps it) and logged with the reason. Under DDP a trial of one whole
    step (optimizer states included) then confirms it on every GPU before the model is wrapped, stepping
    down to the next divisor on an out-of-memory error; the ranks take the smallest (bert_recipes/trial.py).
    Under ZeRO, FSDP and the pipeline the planner's choice stands untried. Refused on CPU processes."""
    eval_batch_size: Optional[int] = ranged(None, **POSITIVE)
    """Per rank; None = micro_batch_size."""
    max_steps: Optional[int] = ranged(None, **POSITIVE)
    """Optimizer steps. If both max_steps and epochs are set, the first reached stops."""
    epochs: Optional[float] = ranged(None, **POSITIVE)
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
    document_attention: Literal["auto", "mask", "varlen", "flex"] = "auto"
    """How documents attend apart (data.document_mask, data.unpad; bert_recipes/attention.py). auto: the plan's
    choice (CPUs: mask; GPUs: varlen under bf16/fp16 without attention dropout, flex in fp32 without it, else mask up
    to 1,024 tokens). mask, varlen, flex: that path (a benchmark's comparison), refused in one line where it cannot run
    (varlen and flex need a CUDA GPU and no attention dropout; varlen bf16 or fp16)."""
    compile_backend: Literal["inductor", "eager", "aot_eager"] = "inductor"
    """inductor generates the kernels. eager / aot_eager are dynamo's debugging backends: the same
    tracing and guards, no kernels, so recompiles can be checked in seconds."""
    tf32: bool = True
    """On GPUs of compute capability 8.0 or newer, fp32 matmuls run on TF32 tensor cores (10-bit
    mantissa, ~8x the fp32 rate), as NVIDIA's BERT recipes train; MFU divides by the TF32 peak.
    false: full-FP32 matmuls, and MFU against the FP32 peak. Has no effect on CPUs."""
    eval_every: Optional[int] = ranged(None, **POSITIVE, hint="steps")
    """Evaluate every N optimizer steps (and at the end, see eval_final). None: only at the end."""
    eval_final: bool = True
    """Evaluate once more at the end of the run. false: no final evaluation (benchmarks, launch-cost
    measurements): metrics.json then has the evaluations of train.eval_every only."""
    halt_at_step: Optional[int] = ranged(None, **POSITIVE, hint="a step")
    """Stop at this step after saving a checkpoint, as if the job's time ran out; the schedule
    still spans the whole run. Continue with --resume auto (splits a run over job-time limits)."""
    max_bad_steps: int = ranged(10, low=1)
    """Updates with a non-finite loss or gradient norm are skipped and counted; this many in a row
    stop the run with a diagnosis (exit code 3), keeping the last good checkpoint."""
    collective_timeout_s: float = ranged(600.0, **POSITIVE, hint="seconds")
    """The longest any collective (all-reduce, barrier) may wait for a peer. A stuck rank or a lost
    node then ends the run with exit code 4 and a message, instead of hanging (NCCL's own default is
    10 minutes; gloo's 30)."""


@dataclass
class CheckpointConfig:
    save_every: Optional[int] = ranged(None, **POSITIVE, hint="steps")
    """accelerator.save_state every N optimizer steps (and always at the end)."""
    keep_last: int = ranged(2, low=1)
    """Older checkpoints are deleted once a newer one is complete."""
    resume: Optional[str] = None
    """None: start fresh. 'auto': the latest complete checkpoint in output_dir, if any.
    Or a path to one checkpoint directory."""
    init_from: Optional[str] = None
    """Start this run (a phase: context extension, decay) from another run's checkpoint: a run's output_dir (its
    latest complete checkpoint) or one checkpoint directory, resolved into the run's config. Its weights carry over
    (and with init_optimizer its optimizer state); the step, this recipe's lr schedule, the data position and the
    random generators start anew. The tokenizer is the source run's unless the recipe names one. A resume of this
    run (checkpoint.resume) comes first: a preempted phase continues itself (bert_recipes/phases.py)."""
    init_optimizer: bool = False
    """checkpoint.init_from: also carry the optimizer's state over (AdamW's moments and step counts); false starts
    them at zero, as a new run does."""
    accept_data_change: bool = False
    """Each checkpoint records its data files (data.source files: each file's size and a digest of sampled blocks;
    prepared: the store's prepared.json). A resume whose files changed since (one rewritten in place, one gone) is
    refused in one line naming the file; true resumes on the files as they are now, with a [resume] line for each
    change (the data order from the checkpoint's step on is then another). Files a pattern added since are not a
    change: a resume reads the checkpoint's own files (docs/checkpoints.md#the-data-of-a-resume)."""
    downstream: Optional[str] = None
    """mlm: a fine-tuning recipe that scores each saved checkpoint (e.g. recipes/tiny-classify.yaml). Every save also
    exports that step's model to <output_dir>/downstream/step_XXXXXXXX/model, which the rotation (keep_last) does
    not touch; make downstream RUN=<output_dir> (tools/downstream.py) fine-tunes each in its own process and adds
    the scores to metrics.json, curves.png and the run's trackers (bert_recipes/downstream.py)."""
    save_final: bool = True
    """Save a checkpoint at the end of a finished run (a halted or preempted run always saves one, to
    resume from). false: benchmarks, which need no 1.3 GB checkpoint of BERT-base."""
    export: bool = True
    """At the end, write model + tokenizer in Hugging Face format to output_dir/model."""
    metric_for_best: Optional[str] = None
    """An evaluation metric (accuracy, f1, matthews_correlation, pearsonr, spearmanr, eval_loss, ...):
    the state of the best evaluation is kept in checkpoints/best, apart from the rotation, and the
    export, the final metrics, the test predictions and SQuAD's answer files come from it. None: from the last
    step."""
    push_to_hub: bool = False
    """Upload the export (with its model card) to the Hugging Face Hub at the end (needs
    checkpoint.hub_model_id and a login: huggingface-cli login, or HF_TOKEN)."""
    hub_model_id: Optional[str] = None
    """user-or-org/name of the Hub repository for checkpoint.push_to_hub (created if missing)."""


@dataclass
class LoggingConfig:
    log_every: int = ranged(10, **POSITIVE, hint="steps")
    """Optimizer steps between log lines / tracker points."""
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Any of tensorboard, wandb, mlflow (the last two when installed); [] for none."""
    progress_bar: bool = True
    """The train loop's bar (tqdm, on each node's first rank) and the data libraries' (datasets' loading, tokenizing
    and packing; the tokenizer trainer's: data.data_progress_bars). false: none of them, for a log file (make demo, a
    SLURM job), where the [train] lines say the same every logging.log_every steps. transformers' "Writing model
    shards" bar never shows (export.no_shard_bar)."""
    profile: bool = False
    """torch.profiler over steps 2-4 (wait 1, warmup 1, active 3): a TensorBoard trace in
    output_dir/profile and a printed top-10 of operators by self time. CLI: --profile."""
    dataloader_warn_share: float = ranged(0.2, low=0, high=1)
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
    site: each log line gets `host_syncs`, metrics.json the sites (bert_recipes.sync_audit.SyncAudit). It also
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


def _collect_ranges() -> list[Range]:
    """Every field's range, in the tree's order: section by section, field by field."""
    return [Range(f"{section}.{f.name}", **f.metadata["range"])
            for section, cls in typing.get_type_hints(Config).items()
            for f in dataclasses.fields(cls) if "range" in f.metadata]


# The ranges of single values; None (unset) always passes. A number-valued key with no range is
# listed, with the reason, in tests/test_input_matrix.py (NO_RANGE).
_RANGES = _collect_ranges()
