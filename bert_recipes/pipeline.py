"""Pipeline parallelism: BERT as a DeepSpeed PipelineModule, and the engine that runs it.

Accelerate has no pipeline parallelism for training, so when the DeepSpeed JSON has a `pipeline`
section train.py builds `PipelineEngine` here instead of the Accelerate engine. The loop, the
recipe, the data order, the schedule and the outputs (checkpoints/, model/ in Hugging Face format,
metrics.json) are train.py's, the same as on every other backend; this module holds only the
model split (layer specs), the engine and its export.

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

import itertools
import json
import math
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler

from .config import Config, ConfigError
from .guard import control_group, slow_barrier
from .data import Indexed
from .modeling import masked_lm_loss, per_sample_mlm_loss

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


def layer_specs(model, task: str):
    """The pipeline layers, built from an ordinary Hugging Face model so that initialisation and
    pretrained weights are exactly those of the other backends. Returns (specs, name_map) where
    name_map turns PipelineModule state-dict prefixes back into Hugging Face names."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    bert = model.bert
    layers = list(bert.encoder.layer)
    names = {}
    if task == "mlm":
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
    else:
        specs = [LayerSpec(_Existing, EmbeddingPipe(bert.embeddings, words_given=False))]
        names["0.embeddings."] = "bert.embeddings."
        for i, layer in enumerate(layers):
            specs.append(LayerSpec(_Existing, EncoderLayerPipe(layer)))
            names[f"{len(specs) - 1}.layer."] = f"bert.encoder.layer.{i}."
        specs.append(LayerSpec(_Existing, ClassifierPipe(bert.pooler, model.dropout, model.classifier)))
        names[f"{len(specs) - 1}.pooler."] = "bert.pooler."
        names[f"{len(specs) - 1}.classifier."] = "classifier."
    return specs, names


def to_hf_name(key: str, names: dict[str, str]) -> str | None:
    for prefix, target in names.items():
        if key.startswith(prefix):
            return target + key[len(prefix):]
    return None


def mlm_loss(logits, labels):
    return masked_lm_loss(logits.view(-1, logits.size(-1)), labels.view(-1))


def classification_loss(num_labels: int):
    def loss(logits, labels):
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(-1).float(), labels.float())
        return F.cross_entropy(logits.float(), labels)
    return loss


# ---------------------------------------------------------------------------- the run
class _ReplicaBatches(BatchSampler):
    """Accelerate's sharding for the pipeline: batch i of the seedable order goes to replica
    i % replicas, so a pipeline run sees exactly the batches of a DDP run with as many ranks.
    `skip` leaves out a resumed epoch's first batches before they are collated."""

    def __init__(self, sampler, batch_size: int, replicas: int, replica: int):
        super().__init__(sampler, batch_size=batch_size, drop_last=True)
        self.replicas, self.replica, self.skip = replicas, replica, 0

    def __iter__(self):
        mine = (b for i, b in enumerate(super().__iter__()) if i % self.replicas == self.replica and i < len(self) * self.replicas)
        yield from itertools.islice(mine, self.skip, None)

    def __len__(self):
        return super().__len__() // self.replicas


class PipelineEngine:
    """The DeepSpeed pipeline engine behind train.py's engine interface (see bert_recipes/engine.py).
    Creating it starts the process group: `stages` consecutive ranks form one pipeline, and
    world / stages pipelines are the data-parallel replicas."""

    name = "pipeline"

    def __init__(self, cfg: Config, plan, output_dir: Path):
        import deepspeed
        import deepspeed.comm as dist

        from .backend import (check_consistency, check_trackers, decide_on_gpu, local_capability,
                              pipeline_replicas, set_tf32)
        from .config import grad_accum_steps
        if cfg.model.gradient_checkpointing:
            raise ConfigError("model.gradient_checkpointing under the pipeline: use the DeepSpeed JSON's "
                              "pipeline.activation_checkpoint_interval instead")
        if {"optimizer", "scheduler"} & set(plan.ds_config):
            raise ConfigError(f"{plan.ds_config_path} has an optimizer or scheduler block: the pipeline engine takes "
                              "the recipe's own (optim section); remove the block from the JSON")
        if cfg.train.compile:
            raise ConfigError("train.compile under the pipeline engine: DeepSpeed's pipeline runs its stages "
                              "itself; set train.compile=false")
        trackers = check_trackers(cfg.logging.trackers)
        if set(trackers) - {"tensorboard"}:
            raise ConfigError(f"logging.trackers={trackers}: the pipeline engine logs to tensorboard only")
        self.cfg, self.plan, self.output_dir, self.trackers = cfg, plan, output_dir, trackers
        self.on_gpu = decide_on_gpu(plan)
        set_tf32(cfg.train.tf32, self.on_gpu)
        deepspeed.init_distributed(dist_backend=None if self.on_gpu else "gloo",
                                   timeout=timedelta(seconds=cfg.train.collective_timeout_s))
        self.dist = dist
        self.control = control_group(cfg.train.collective_timeout_s)
        self.prep_barrier = slow_barrier(self.control, cfg.data.prepare_timeout_s, "rank 0's data preparation")
        world, self.rank = dist.get_world_size(), dist.get_rank()
        self.num_processes, self.replicas = world, pipeline_replicas(plan, world)
        self.stages, self.partition = world // self.replicas, plan.ds_config["pipeline"].get("partition", "parameters")
        self.accum = grad_accum_steps(cfg.train, self.replicas)
        check_consistency(cfg, plan, self.replicas, self.accum, self.on_gpu, local_capability() if self.on_gpu else None)
        self.is_main = self.rank == 0
        self.is_local_main = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        self.fixed_length = cfg.data.max_seq_length   # the pipeline's buffers have fixed shapes
        self.writer = None
        self.setup_line = (f"DeepSpeed pipeline engine, {self.stages} stages x {self.replicas} data-parallel replicas = "
                           f"{world} processes, precision={cfg.train.mixed_precision}; global batch "
                           f"{cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accum {self.accum} "
                           f"x dp {self.replicas}")

    # ------------------------------------------------------------ communication and output
    def print0(self, *args):
        if self.is_main:
            print(*args, flush=True)

    def barrier(self):
        self.dist.barrier()

    def broadcast(self, obj):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_sum(self, tensor):
        tensor = tensor.to(self.device)
        torch.distributed.all_reduce(tensor)
        return tensor

    def start_trackers(self, run_name: str, config: dict):
        if self.is_main and "tensorboard" in self.trackers:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.output_dir / "logs" / run_name))

    def log(self, values: dict, step: int):
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)

    def finish(self):
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------ setup
    def wrap(self, model):
        """BERT cut into layers; this rank builds its stage's. Initialisation and pretrained
        weights are exactly those of the Hugging Face model, as on the other backends."""
        from deepspeed.pipe import PipelineModule
        if not hasattr(model, "bert"):
            raise ConfigError("the pipeline engine builds BERT models only (model_type bert)")
        task = self.cfg.task
        self.full_param_numel = sum(p.numel() for p in model.parameters())
        self.model_class, self.model_config = type(model), model.config   # for the export
        specs, self.names = layer_specs(model, task.kind)
        loss_fn = mlm_loss if task.kind == "mlm" else classification_loss(task.num_labels)
        self.net = PipelineModule(layers=specs, num_stages=self.stages, loss_fn=loss_fn,
                                  partition_method=self.partition)
        return self.net

    def prepare(self, module, optimizer, scheduler, data, collate):
        import copy

        import deepspeed
        from accelerate.data_loader import SeedableRandomSampler
        from torch.utils.data import DataLoader

        from .data import loader_kwargs
        t = self.cfg.train
        ds_config = {k: v for k, v in self.plan.ds_config.items() if k != "pipeline"}
        ds_config.update(train_micro_batch_size_per_gpu=t.micro_batch_size, gradient_accumulation_steps=self.accum,
                         train_batch_size=t.global_batch_size, gradient_clipping=self.cfg.optim.max_grad_norm)
        for mode in ("bf16", "fp16"):
            if isinstance(ds_config.get(mode), dict):
                ds_config[mode] = {**ds_config[mode], "enabled": t.mixed_precision == mode}
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
            model_parameters=[p for p in module.parameters() if p.requires_grad])
        self.replica = self.engine.grid.data_parallel_id   # PipeDataParallelTopology: data axis is fastest
        assert self.replica == (self.rank % self.replicas if self.replicas > 1 else 0)
        train_set = Indexed(data["train"])
        self.sampler = SeedableRandomSampler(train_set, generator=torch.Generator(), data_seed=self.cfg.run.seed)
        self.batch_sampler = _ReplicaBatches(self.sampler, t.micro_batch_size, self.replicas, self.replica)
        # the loader's own generator: each new iterator draws its base seed from it, not from the global
        # RNG, whose dropout stream a resumed run must continue exactly
        kwargs = loader_kwargs(self.cfg.data, collate, self.cfg.run.seed, pin=False)
        self.loader = DataLoader(train_set, batch_sampler=self.batch_sampler, **kwargs)
        self.eval_set, self.eval_collate = Indexed(data["eval"]), copy.copy(collate)
        self.scheduler, self.counts_data = scheduler, self.engine.is_first_stage()
        self.engine.train()

    def describe(self) -> dict:
        """Collective: every rank's stage and parameter count, so a test can check who owns what."""
        local = sum(p.numel() for p in self.net.parameters())
        parts = self.net.parts
        info = {"name": self.name, "distributed_type": "DEEPSPEED_PIPELINE", "num_processes": self.num_processes,
                "mixed_precision": self.cfg.train.mixed_precision, "pipeline_stages": self.stages,
                "data_parallel_size": self.replicas, "stage_id": self.engine.stage_id,
                "zero_stage": self.engine.zero_optimization_stage(), "local_param_numel": local,
                "full_param_numel": self.full_param_numel, "params_sharded": local < self.full_param_numel,
                "layers_per_stage": [int(b) - int(a) for a, b in zip(parts[:-1], parts[1:])]}
        everyone = [None] * self.num_processes
        self.dist.all_gather_object(everyone, {"stage_id": info["stage_id"], "local_param_numel": local})
        return {**info, "ranks": everyone}

    # ------------------------------------------------------------ training
    def batches(self, epoch: int, skip: int):
        self.sampler.set_epoch(epoch)
        self.batch_sampler.skip = skip
        return iter(self.loader)

    def train_step(self, batches):
        """`accum` micro batches through the pipeline (the first and last stages read them; DeepSpeed
        clips, steps and schedules)."""
        loss = self.engine.train_batch(data_iter=map(_as_inputs, batches))
        # ZeRO-1 (ds_configs/pipeline.json) skips a step whose gradient norm is not finite (a host
        # decision inside DeepSpeed's step); -> (loss, grad norm, skipped, fp16 overflow)
        return loss, self.engine.get_global_grad_norm(), not self.engine.was_step_applied(), False

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def _outputs(self, ds):
        """(dataset indices, logits, labels) of each batch, on the last stage. Each replica takes every
        replicas-th sample; a short last batch is padded with repeats (the pipeline's buffers have
        fixed shapes) and the repeats are dropped, so every sample comes out once."""
        bs = self.cfg.train.eval_batch_size or self.cfg.train.micro_batch_size
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

    def _gather(self, rows: dict) -> dict:
        everyone = [None] * self.num_processes
        self.dist.all_gather_object(everyone, rows)
        return {key: sum((part.get(key, []) for part in everyone), []) for key in set().union(*everyone)}

    def evaluate(self, dataset=None) -> dict:
        """Rows for metrics.eval_metrics, every sample once. dataset: another labelled split."""
        task, rows = self.cfg.task, {}
        for _, logits, labels in self._outputs(self.eval_set if dataset is None else Indexed(dataset)):
            if task.kind == "mlm":
                sums, counts, correct = per_sample_mlm_loss(logits, labels)
                found = {"loss_sums": sums, "token_counts": counts, "correct": correct}
            else:
                found = {"preds": logits.squeeze(-1) if task.num_labels == 1 else logits.argmax(-1), "refs": labels}
            for key, value in found.items():
                rows.setdefault(key, []).extend(value.tolist())
        return self._gather(rows)

    def predict(self, dataset):
        """The prediction for every row of `dataset`, in order: class ids, or values for a regression."""
        import numpy as np
        rows = {"index": [], "preds": []}
        for idx, logits, _ in self._outputs(Indexed(dataset)):
            rows["index"] += idx
            rows["preds"] += (logits.squeeze(-1) if self.cfg.task.num_labels == 1 else logits.argmax(-1)).tolist()
        rows = self._gather(rows)
        order = np.argsort(rows.get("index", []), kind="stable")
        return np.asarray(rows.get("preds", []))[order]

    # ------------------------------------------------------------ state
    def save(self, path: str):
        """DeepSpeed's pipeline checkpoint (weights, optimizer, schedule), plus every rank's random
        state, which DeepSpeed does not keep: dropout then continues exactly on resume."""
        self.engine.save_checkpoint(path, tag="engine")
        (Path(path) / f"rng_rank{self.rank}.json").write_text(json.dumps(rng_state(self.on_gpu)))

    def load(self, path: str):
        self.engine.load_checkpoint(str(path), tag="engine")
        saved = Path(path) / f"rng_rank{self.rank}.json"
        if saved.exists():
            set_rng_state(json.loads(saved.read_text()))

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
            out_dir.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(out_dir, safe_serialization=True)
            tokenizer.save_pretrained(out_dir)
            (out_dir / "recipe.yaml").write_text(config_yaml)
            (out_dir / "README.md").write_text(card)
        self.dist.barrier()
        return out_dir

    def final(self) -> dict:
        from .perf import peak_memory_gb
        return {"peak_memory_gb_per_rank": peak_memory_gb(self.all_sum, self.rank, self.num_processes, self.device,
                                                          self.on_gpu),
                "distributed_type": "DEEPSPEED_PIPELINE"}


def rng_state(on_gpu: bool) -> dict:
    """This process's random generators as plain JSON (loading it needs no pickle)."""
    import random

    import numpy as np
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state().tolist(), "cuda": torch.cuda.get_rng_state().tolist() if on_gpu else None,
            "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
            "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]}


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _as_inputs(batch: dict):
    """A collated batch as the pipeline passes it: ((input_ids, attention_mask, token_type_ids), labels)."""
    ids = batch["input_ids"]
    return (ids, batch.get("attention_mask", torch.ones_like(ids)), batch.get("token_type_ids", torch.zeros_like(ids))), \
        batch["labels"]
