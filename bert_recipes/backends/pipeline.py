"""Pipeline parallelism: BERT as a DeepSpeed PipelineModule, and the engine that runs it.

Accelerate has no pipeline parallelism for training, so when the DeepSpeed JSON has a `pipeline`
section train.py builds `PipelineEngine` here instead of the Accelerate engine. The loop, the
recipe, the data order, the schedule and the outputs (checkpoints/, model/ in Hugging Face format,
metrics.json) are train.py's, the same as on every other backend; this module holds only the
model split (layer specs), the engine, its step (train_batch: the pipeline's branch of train.py's
train_step) and its export.

BERT is cut into a flat list of layers, each taking and returning (hidden, attention_mask); the
mask travels as an integer tensor, so the pipeline sends no gradient for it:

  mlm:            [word embeddings*] + [positions, types, LayerNorm] + encoder layers
                  + [head transform] + [decoder*] + [decoder bias]
  classification: [embeddings]  + encoder layers + [pooler + classifier]

(*) one TiedLayerSpec holding only the word-embedding matrix: the lookup and the MLM decoder are
the same weight even when they sit on different stages; DeepSpeed all-reduces its gradient
between the owning stages.
Micro-batches per optimizer step = gradient accumulation = global / (micro x data-parallel size).
"""
from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn

from ..data.batching import Indexed
from ..config import ConfigError, DataConfig, OptimConfig, TaskConfig, TrainConfig
from ..export import write_export
from ..memory import bubble_line
from ..metrics import joined_rows
from ..optim import resume_schedule
from ..phases import carry_over
from ..ranks import all_sum, broadcast, control_group, print0, slow_barrier
from ..rng import load_rng_state, save_rng_state
from ..tasks import kind_of
from .accelerator import cpu_affinity
from .deepspeed import saved_meeting_the_barrier
from .deepspeed_universal import resharded

TIED_KEY = "embeddings"


# ---------------------------------------------------------------------------- layers
class WordEmbeddingPipe(nn.Module):
    """The tied module: the word-embedding matrix alone. As the first layer it looks tokens up;
    as the last-but-one it is the MLM decoder (see `decode`)."""

    def __init__(self, word_embeddings: nn.Embedding):
        super().__init__()
        self.word_embeddings = word_embeddings

    def forward(self, inputs):
        input_ids, attention_mask, token_type_ids = inputs
        return self.word_embeddings(input_ids), attention_mask, token_type_ids


def decode(tied: WordEmbeddingPipe, inputs):
    """The MLM decoder: hidden @ word_embeddings^T, sharing the tied weight."""
    hidden, _ = inputs
    return hidden @ tied.word_embeddings.weight.t()


class EmbeddingPipe(nn.Module):
    """(word vectors | input_ids, attention_mask, token_type_ids) -> (hidden, attention_mask):
    position and token-type embeddings, LayerNorm, dropout."""

    def __init__(self, embeddings: nn.Module, words_given: bool):
        super().__init__()
        self.embeddings = embeddings
        self.words_given = words_given
        if words_given:   # the words live in the tied module; do not keep a second copy here
            embeddings.word_embeddings = None

    def forward(self, inputs):
        first, attention_mask, token_type_ids = inputs
        if self.words_given:
            return self.embeddings(inputs_embeds=first, token_type_ids=token_type_ids), attention_mask
        return self.embeddings(input_ids=first, token_type_ids=token_type_ids), attention_mask


class EncoderLayerPipe(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        hidden, mask = inputs
        bias = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        out = self.layer(hidden, attention_mask=bias)
        return (out[0] if isinstance(out, tuple) else out), mask


class TransformPipe(nn.Module):
    def __init__(self, transform: nn.Module):
        super().__init__()
        self.transform = transform

    def forward(self, inputs):
        hidden, mask = inputs
        return self.transform(hidden), mask


class BiasPipe(nn.Module):
    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.bias = nn.Parameter(bias.detach().clone())

    def forward(self, logits):
        return logits + self.bias


class ClassifierPipe(nn.Module):
    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module):
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, inputs):
        hidden, _ = inputs
        return self.classifier(self.dropout(self.pooler(hidden)))


class _Existing(nn.Module):
    """LayerSpec needs a class to build: this one hands back a module built beforehand."""

    def __new__(cls, module):
        return module


def layer_specs(model, task_kind: str):
    """The pipeline layers, built from an ordinary Hugging Face model so that initialisation and
    pretrained weights are exactly those of the other backends, its head cut as the task kind's (HEAD_CUTS).
    Returns (specs, name_map) where name_map turns PipelineModule state-dict prefixes back into Hugging Face names."""
    return HEAD_CUTS[task_kind](model, model.bert, list(model.bert.encoder.layer))


def masked_lm_cut(model, bert, layers):
    """[word embeddings*] + [positions, types, LayerNorm] + encoder layers + [transform] + [decoder*] + [bias]."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    names = {}
    head = model.cls.predictions
    words = WordEmbeddingPipe(bert.embeddings.word_embeddings)
    specs = [TiedLayerSpec(TIED_KEY, _Existing, words, tied_weight_attr=["word_embeddings.weight"]),
             LayerSpec(_Existing, EmbeddingPipe(bert.embeddings, words_given=True))]
    names[f"tied_modules.{TIED_KEY}.word_embeddings."] = "bert.embeddings.word_embeddings."
    names["1.embeddings."] = "bert.embeddings."
    for i, layer in enumerate(layers):
        specs.append(LayerSpec(_Existing, EncoderLayerPipe(layer)))
        names[f"{len(specs) - 1}.layer."] = f"bert.encoder.layer.{i}."
    specs.append(LayerSpec(_Existing, TransformPipe(head.transform)))
    names[f"{len(specs) - 1}.transform."] = "cls.predictions.transform."
    specs.append(TiedLayerSpec(TIED_KEY, _Existing, words, forward_fn=decode,
                               tied_weight_attr=["word_embeddings.weight"]))
    specs.append(LayerSpec(_Existing, BiasPipe(head.bias)))
    names[f"{len(specs) - 1}.bias"] = "cls.predictions.bias"
    return specs, names


def classification_cut(model, bert, layers):
    """[embeddings] + encoder layers + [pooler + classifier]."""
    from deepspeed.pipe import LayerSpec
    names = {}
    specs = [LayerSpec(_Existing, EmbeddingPipe(bert.embeddings, words_given=False))]
    names["0.embeddings."] = "bert.embeddings."
    for i, layer in enumerate(layers):
        specs.append(LayerSpec(_Existing, EncoderLayerPipe(layer)))
        names[f"{len(specs) - 1}.layer."] = f"bert.encoder.layer.{i}."
    specs.append(LayerSpec(_Existing, ClassifierPipe(bert.pooler, model.dropout, model.classifier)))
    names[f"{len(specs) - 1}.pooler."] = "bert.pooler."
    names[f"{len(specs) - 1}.classifier."] = "classifier."
    return specs, names


# The task kinds whose heads the pipeline cuts (backends/consistency.py refuses the others in one line)
HEAD_CUTS = {"mlm": masked_lm_cut, "classification": classification_cut}
PIPELINE_HEADS = tuple(HEAD_CUTS)


def to_hf_name(key: str, names: dict[str, str]) -> str | None:
    for prefix, target in names.items():
        if key.startswith(prefix):
            return target + key[len(prefix):]
    return None


# ---------------------------------------------------------------------------- the run
class PipelineEngine:
    """The DeepSpeed pipeline engine behind train.py's engine interface (see bert_recipes/engine.py).
    Creating it starts the process group: `stages` consecutive ranks form one pipeline, and
    world / stages pipelines are the data-parallel replicas."""

    name = "pipeline"

    def __init__(self, plan, output_dir: Path, *, train: TrainConfig, data: DataConfig, optim: OptimConfig,
                 task: TaskConfig, seed: int):
        import deepspeed
        import deepspeed.comm as dist

        from .accelerator import set_kernels
        from .deepspeed import ask_cpuinfo_once, ask_numa_once
        ask_cpuinfo_once()   # (what the pipeline cannot run was refused in preflight: backends/deepspeed.pipeline_conflicts)
        ask_numa_once()
        self.plan, self.output_dir = plan, output_dir
        self.train_cfg, self.data_cfg, self.optim_cfg, self.task, self.seed = train, data, optim, task, seed
        self.kind = kind_of(task.kind)   # the task contract: its loss, evaluation's rows, predictions
        self.on_gpu = plan.on_gpu   # decided once (backend.launch_plan_here)
        kernels = set_kernels(plan)
        deepspeed.init_distributed(dist_backend=None if self.on_gpu else "gloo",
                                   timeout=timedelta(seconds=train.collective_timeout_s))
        self.dist = dist
        from accelerate import PartialState
        PartialState()   # no Accelerator here, but Accelerate's trackers (logs.Trackers) log through its state
        self.control = control_group(train.collective_timeout_s)
        self.prep_barrier = slow_barrier(self.control, data.prepare_timeout_s, "rank 0's data preparation")
        world, self.rank = dist.get_world_size(), dist.get_rank()
        if world != plan.world:
            raise ConfigError(f"the launcher started {plan.world} processes (WORLD_SIZE) but DeepSpeed sees {world}")
        # world, replicas and accumulation: resolved once (backends.consistency.resolve_run), recipe vs JSON compared there
        self.num_processes, self.replicas, self.accum = world, plan.replicas, plan.accum
        self.stages, self.partition = world // self.replicas, plan.ds_config["pipeline"].get("partition", "parameters")
        self.is_main = self.rank == 0
        self.is_local_main = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        self.fixed_length = data.max_seq_length   # the pipeline's buffers have fixed shapes
        self.setup_line = (f"DeepSpeed pipeline engine, {self.stages} stages x {self.replicas} data-parallel replicas = "
                           f"{world} processes, precision={plan.precision}; global batch "
                           f"{train.global_batch_size} = micro {train.micro_batch_size} x accum {self.accum} "
                           f"x dp {self.replicas}; {bubble_line(self.stages, self.accum)}")
        if kernels:
            print0(kernels)

    def finish(self):
        pass   # DeepSpeed's pipeline leaves nothing to clear

    # ------------------------------------------------------------ setup
    def wrap(self, model):
        """BERT cut into layers; this rank builds its stage's. Initialisation and pretrained
        weights are exactly those of the Hugging Face model, as on the other backends."""
        from deepspeed.pipe import PipelineModule
        if not hasattr(model, "bert"):
            raise ConfigError("the pipeline engine builds BERT models only (model_type bert)")
        task = self.task
        self.full_param_numel = sum(p.numel() for p in model.parameters())
        self.model_class, self.model_config = type(model), model.config   # for the export
        specs, self.names = layer_specs(model, task.kind)
        self.net = PipelineModule(layers=specs, num_stages=self.stages, loss_fn=self.kind.loss(task),
                                  partition_method=self.partition)
        return self.net

    def prepare(self, module, optimizer, scheduler, data, collate, mixture=None):
        import deepspeed
        from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
        from torch.utils.data import BatchSampler, DataLoader

        from ..data.batching import loader_kwargs
        from ..data.mixture import MixedOrder
        t = self.train_cfg
        ds_config = {k: v for k, v in self.plan.ds_config.items() if k != "pipeline"}
        ds_config.update(train_micro_batch_size_per_gpu=t.micro_batch_size, gradient_accumulation_steps=self.accum,
                         train_batch_size=t.global_batch_size, gradient_clipping=self.optim_cfg.max_grad_norm)
        for mode in ("bf16", "fp16"):
            if isinstance(ds_config.get(mode), dict):
                ds_config[mode] = {**ds_config[mode], "enabled": t.mixed_precision == mode}
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
            model_parameters=[p for p in module.parameters() if p.requires_grad])
        self.replica = self.engine.grid.data_parallel_id   # PipeDataParallelTopology: data axis is fastest
        assert self.replica == (self.rank % self.replicas if self.replicas > 1 else 0)
        train_set = Indexed(data["train"])
        self.sampler = (MixedOrder(mixture) if mixture is not None else   # data.mixture: bert_recipes/data/mixture.py
                        data["train"].training_order(self.seed) if hasattr(data["train"], "training_order") else
                        SeedableRandomSampler(train_set, generator=torch.Generator(), data_seed=self.seed))
        # Accelerate's own sharding, by replica rather than rank: batch i of the seedable order goes to
        # replica i % replicas (whole rounds only), so a pipeline run sees exactly the batches of a DDP
        # run with as many ranks; a resumed epoch's first batches are skipped before they are collated.
        self.batch_sampler = SkipBatchSampler(BatchSamplerShard(
            BatchSampler(self.sampler, t.micro_batch_size, drop_last=True), self.replicas, self.replica), 0)
        # the loader's own generator: each new iterator draws its base seed from it, not from the global
        # RNG, whose dropout stream a resumed run must continue exactly
        kwargs = loader_kwargs(self.data_cfg, collate, self.seed, pin=self.plan.pin_memory)
        self.loader = DataLoader(train_set, batch_sampler=self.batch_sampler, **kwargs)
        self.eval_set, self.eval_collate = Indexed(data["eval"]), collate.evaluation_copy()
        self.scheduler, self.counts_data = scheduler, self.engine.is_first_stage()
        self.engine.train()

    def describe(self) -> dict:
        """Collective: every rank's stage and parameter count, so a test can check who owns what."""
        local = sum(p.numel() for p in self.net.parameters())
        parts = self.net.parts
        info = {"name": self.name, "distributed_type": "DEEPSPEED_PIPELINE", "num_processes": self.num_processes,
                "mixed_precision": self.train_cfg.mixed_precision, "pipeline_stages": self.stages,
                "data_parallel_size": self.replicas, "stage_id": self.engine.stage_id,
                "zero_stage": self.engine.zero_optimization_stage(), "local_param_numel": local,
                "full_param_numel": self.full_param_numel, "params_sharded": local < self.full_param_numel,
                "layers_per_stage": [int(b) - int(a) for a, b in zip(parts[:-1], parts[1:])],
                "cpu_affinity": cpu_affinity(self.on_gpu)}
        everyone = [None] * self.num_processes
        self.dist.all_gather_object(everyone, {"stage_id": info["stage_id"], "local_param_numel": local})
        return {**info, "ranks": everyone}

    # ------------------------------------------------------------ training
    def batches(self, epoch: int, skip: int):
        self.sampler.set_epoch(epoch)
        self.batch_sampler.skip_batches = skip
        return iter(self.loader)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def set_batch(self, global_batch: int):
        """The pipeline's micro batches a step are fixed when its engine is built: a batch ramp is refused before
        (backends/deepspeed.pipeline_conflicts)."""
        assert global_batch == self.train_cfg.global_batch_size, "a batch ramp under the pipeline engine"

    def _outputs(self, ds):
        """(dataset indices, logits, labels) of each batch, on the last stage. Each replica takes every
        replicas-th sample; a short last batch is padded with repeats (the pipeline's buffers have
        fixed shapes) and the repeats are dropped, so every sample comes out once."""
        bs = self.train_cfg.eval_batch_size or self.train_cfg.micro_batch_size
        mine = list(range(self.replica, len(ds), self.replicas))
        n_batches = math.ceil(math.ceil(len(ds) / self.replicas) / bs)   # the same on every replica
        self.engine.eval()
        for b in range(n_batches):
            idx = mine[b * bs:(b + 1) * bs]
            valid = len(idx)
            batch = self.eval_collate([ds[i] for i in idx + [idx[0] if idx else 0] * (bs - valid)])
            if (batch["labels"] < 0).all():   # a test split's hidden labels: any valid class will do
                batch["labels"] = torch.zeros_like(batch["labels"])
            _, logits = self.engine.eval_batch(iter([_as_inputs(batch)]), return_logits=True, num_micro_batches=1)
            if self.engine.is_last_stage() and valid:
                logits = logits[:valid].float()
                yield idx, logits, batch["labels"][:valid].to(logits.device)   # the engine moved only its copy
        self.engine.train()

    def _gather(self, parts: list[dict]) -> dict:
        """Every rank's batches of rows (the last stages hold them) as one set: metrics.joined_rows."""
        everyone = [None] * self.num_processes
        self.dist.all_gather_object(everyone, parts)
        return joined_rows([part for rank_parts in everyone for part in rank_parts])

    def evaluate(self, dataset=None) -> dict:
        """Rows for the task's metrics, every sample once. dataset: another labelled split."""
        parts = [{k: v.cpu() for k, v in self.kind.eval_rows(self.task, logits, labels).items()}
                 for _, logits, labels in self._outputs(self.eval_set if dataset is None else Indexed(dataset))]
        return self._gather(parts)

    def predict(self, dataset):
        """The prediction for every row of `dataset`, in order: class ids, or values for a regression."""
        import numpy as np
        parts = [{"index": torch.tensor(idx), "preds": self.kind.predictions(self.task, logits).cpu()}
                 for idx, logits, _ in self._outputs(Indexed(dataset))]
        rows = self._gather(parts)
        order = np.argsort(rows.get("index", np.zeros(0)), kind="stable")
        return rows.get("preds", np.zeros(0))[order]

    # ------------------------------------------------------------ state
    def save(self, path: str):
        """DeepSpeed's pipeline checkpoint (weights, optimizer, schedule), plus every rank's random
        state, which DeepSpeed does not keep (in the Accelerate engine's format: rng.save_rng_state),
        so dropout continues exactly on resume."""
        saved_meeting_the_barrier(lambda: self.engine.save_checkpoint(path, tag="engine"))   # a failed write too
        save_rng_state(path, self.rank, self.on_gpu)

    def load(self, path: str):
        """Another number of replicas (train.py's [resume] line says so): the ZeRO-1 partitions re-cut through
        DeepSpeed's universal checkpoint, like ZeRO-1's."""
        with resharded(Path(path), self.num_processes, self.engine, self.is_main, broadcast, tag="engine") as source:
            self.engine.load_checkpoint(str(source), tag="engine")
        resume_schedule(self.scheduler)   # this run's schedule from the checkpoint's step (another length: optim.py)
        load_rng_state(path, self.rank, self.on_gpu)

    def start_from(self, path: str):
        carry_over(lambda: self.load(path), self.engine.optimizer, self.scheduler, self.on_gpu)

    def export(self, out_dir: Path, tokenizer, config_yaml: str, card: str) -> Path:
        """Gather every stage's weights onto rank 0 and write an ordinary Hugging Face model, in fp32:
        under bf16/fp16 the optimizer's fp32 master weights, not the 16-bit copies the stages run."""
        from deepspeed.utils import safe_get_full_fp32_param
        masters = {name: safe_get_full_fp32_param(p) for name, p in self.net.named_parameters()}   # collective
        local = {}
        if self.replica == 0:   # one replica of each stage is enough
            for key, value in self.net.state_dict().items():
                hf = to_hf_name(key, self.names)
                if hf is not None:
                    master = masters.get(key)
                    local[hf] = (master if master is not None else value).detach().float().cpu()
        gathered = [None] * self.num_processes
        self.dist.all_gather_object(gathered, local)
        if self.is_main:
            state_dict = {k: v for part in gathered for k, v in part.items()}
            model = self.model_class(self.model_config)
            missing, unexpected = model.load_state_dict(state_dict, strict=False)
            tied_ok = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
            if set(missing) - tied_ok or unexpected:
                raise RuntimeError(f"pipeline export: missing {sorted(set(missing) - tied_ok)}, unexpected {unexpected}")
            write_export(model, out_dir, tokenizer, config_yaml, card)   # the other engines' writer
        return out_dir   # no barrier: the caller agrees on the write (train.finish)

    def final(self) -> dict:
        from ..throughput import peak_memory_gb
        return {"peak_memory_gb_per_rank": peak_memory_gb(all_sum, self.rank, self.num_processes, self.device,
                                                          self.on_gpu),
                "distributed_type": "DEEPSPEED_PIPELINE"}


def train_batch(engine, batches):
    """One optimizer step of DeepSpeed's pipeline `engine` over the step's micro batches (the first and last
    stages read them; DeepSpeed runs the schedule of micro batches, clips, steps and schedules). ZeRO-1
    (ds_configs/pipeline.json) skips a step whose gradient norm is not finite, a host decision inside its step.
    -> (loss, grad norm, skipped, fp16 overflow), as train.train_step returns them."""
    loss = engine.train_batch(data_iter=map(_as_inputs, batches))
    return loss, engine.get_global_grad_norm(), not engine.was_step_applied(), False


def _as_inputs(batch: dict):
    """A collated batch as the pipeline passes it: ((input_ids, attention_mask, token_type_ids), labels)."""
    ids = batch["input_ids"]
    return (ids, batch.get("attention_mask", torch.ones_like(ids)), batch.get("token_type_ids", torch.zeros_like(ids))), \
        batch["labels"]
