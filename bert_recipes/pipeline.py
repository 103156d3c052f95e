"""Pipeline parallelism: BERT as a DeepSpeed PipelineModule. The one fenced path of train.py.

Accelerate has no pipeline parallelism for training, so when the DeepSpeed JSON has a `pipeline`
section train.py hands the run to `train_pipeline` here. The recipe, the data, the schedule and the
outputs (checkpoints/, model/ in Hugging Face format, metrics.json) are the same as on every other
backend; only the engine differs.

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

import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Config, ConfigError

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
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


def classification_loss(num_labels: int):
    def loss(logits, labels):
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(-1).float(), labels.float())
        return F.cross_entropy(logits.float(), labels)
    return loss


# ---------------------------------------------------------------------------- the run
def pipeline_settings(ds_config: dict) -> tuple[int, str]:
    pipe = ds_config.get("pipeline", {})
    stages = pipe.get("stages", 2)
    if not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"pipeline.stages must be a positive integer, got {stages!r}")
    return stages, pipe.get("partition", "parameters")


def train_pipeline(cfg: Config, plan, build_data, build_model_fn, build_optimizer_fn, build_scheduler_fn) -> dict:
    """The pipeline engine's loop: the same recipe, outputs and checkpoints as train.main."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.pipe import PipelineModule

    from .checkpoint import resolve_resume, save_checkpoint
    from .config import flat_dict, grad_accum_steps, to_yaml
    from .logs import plot_curves, write_metrics
    from .perf import DataLoaderWatch, flops_per_token, peak_flops

    t_start = time.perf_counter()
    deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    stages, partition = pipeline_settings(plan.ds_config)
    if world % stages:
        raise ConfigError(f"{world} processes cannot form pipelines of {stages} stages (pipeline.stages in "
                          f"{plan.ds_config_path}): the world size must be a multiple of the stage count")
    dp = world // stages
    accum = grad_accum_steps(cfg.train, dp)
    from .backend import check_consistency
    check_consistency(cfg, plan, dp, accum, torch.cuda.is_available())
    output_dir = Path(cfg.run.output_dir)
    config_yaml = to_yaml(cfg)
    is_main = rank == 0

    def print0(*args):
        if is_main:
            print(*args, flush=True)

    torch.manual_seed(cfg.run.seed)
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(config_yaml)
    print0(f"[setup] DeepSpeed pipeline: {stages} stages x {dp} data-parallel replicas = {world} processes; "
           f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accum {accum} x dp {dp}")

    tokenizer, data, collate = build_data(is_main, dist.barrier)
    model = build_model_fn(tokenizer)
    if not hasattr(model, "bert"):
        raise ConfigError("the pipeline path builds BERT models only (model_type bert)")
    full_param_numel = sum(p.numel() for p in model.parameters())
    mlm_fraction = (cfg.data.mlm_probability if cfg.model.sparse_mlm_head else 1.0) if cfg.task.kind == "mlm" else None
    flops_token = flops_per_token(model.config, cfg.data.max_seq_length, mlm_fraction)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    peak, peak_source = peak_flops(device, cfg.train.mixed_precision)
    print0(f"[mfu] {flops_token / 1e6:.1f} MFLOP per token (train), peak {peak / 1e12:.2f} TFLOP/s per device "
           f"({peak_source}); a pipeline's MFU counts every device, idle bubbles included")
    specs, names = layer_specs(model, cfg.task.kind)
    loss_fn = mlm_loss if cfg.task.kind == "mlm" else classification_loss(cfg.task.num_labels)
    net = PipelineModule(layers=specs, num_stages=stages, loss_fn=loss_fn, partition_method=partition)
    del model

    ds_config = {k: v for k, v in plan.ds_config.items() if k != "pipeline"}
    ds_config.update(train_micro_batch_size_per_gpu=cfg.train.micro_batch_size, gradient_accumulation_steps=accum,
                     train_batch_size=cfg.train.global_batch_size, gradient_clipping=cfg.optim.max_grad_norm)
    for mode in ("bf16", "fp16"):
        if isinstance(ds_config.get(mode), dict):
            ds_config[mode] = {**ds_config[mode], "enabled": cfg.train.mixed_precision == mode}
    optimizer = build_optimizer_fn(net)

    # data: the same sample order as Accelerate's seedable sampler, and batch i goes to replica
    # i % dp (as Accelerate shards batches), so a pipeline run sees exactly the batches of a DDP run
    from accelerate.data_loader import SeedableRandomSampler
    from torch.utils.data import BatchSampler, DataLoader
    from .data import Indexed
    engine_grid_dp_rank = (rank % dp) if dp > 1 else 0   # PipeDataParallelTopology: data axis is fastest
    train_set = Indexed(data["train"])
    sampler = SeedableRandomSampler(train_set, generator=torch.Generator(), data_seed=cfg.run.seed)

    class _Shard(BatchSampler):
        def __iter__(self):
            for i, batch in enumerate(super().__iter__()):
                if i % dp == engine_grid_dp_rank and i < len(self) * dp:
                    yield batch

        def __len__(self):
            return super().__len__() // dp

    batch_sampler = _Shard(sampler, batch_size=cfg.train.micro_batch_size, drop_last=True)
    loader = DataLoader(train_set, batch_sampler=batch_sampler, collate_fn=collate, num_workers=cfg.data.num_workers)
    batches_per_epoch = len(loader)
    steps_per_epoch = batches_per_epoch // accum
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(data['train'])} training sequences cannot fill one optimizer step of "
                          f"{accum} micro batches of {cfg.train.micro_batch_size} per replica")
    limits = [cfg.train.max_steps] if cfg.train.max_steps else []
    if cfg.train.epochs is not None:
        limits.append(math.ceil(cfg.train.epochs * steps_per_epoch))
    total_steps = min(limits)
    stop_at = min(total_steps, cfg.train.halt_at_step or total_steps)
    scheduler = build_scheduler_fn(optimizer, total_steps)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    assert engine.grid.data_parallel_id == engine_grid_dp_rank, (engine.grid.data_parallel_id, engine_grid_dp_rank)
    local = sum(p.numel() for p in net.parameters())
    backend = {"distributed_type": "DEEPSPEED_PIPELINE", "num_processes": world, "pipeline_stages": stages,
               "data_parallel_size": dp, "stage_id": engine.stage_id, "zero_stage": engine.zero_optimization_stage(),
               "local_param_numel": local, "full_param_numel": full_param_numel, "params_sharded": local < full_param_numel,
               "layers_per_stage": [int(b) - int(a) for a, b in zip(net.parts[:-1], net.parts[1:])]}
    print0("[backend] " + ", ".join(f"{k}={v}" for k, v in backend.items()))

    state = {"step": 0, "history": {"train": [], "eval": []}}
    checkpoint = resolve_resume(cfg.checkpoint.resume, output_dir) if cfg.checkpoint.resume else None
    if checkpoint is not None:
        engine.load_checkpoint(str(checkpoint), tag="engine")
        state = json.loads((checkpoint / "train_state.json").read_text())
        print0(f"[resume] from {checkpoint} at step {state['step']}")

    data_wait = [0.0]   # seconds this rank's engine spent waiting for the loader (first and last stage read it)

    def batches(epoch: int, skip: int):
        sampler.set_epoch(epoch)
        collate.epoch = epoch
        it = iter(loader)
        for i in range(len(loader)):
            t0 = time.perf_counter()
            batch = next(it)
            if i < skip:
                continue
            data_wait[0] += time.perf_counter() - t0
            inputs = (batch["input_ids"], batch["attention_mask"],
                      batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])))
            yield inputs, batch["labels"]

    def run_eval() -> dict:
        metrics = {"step": state["step"], **evaluate_pipeline(engine, cfg, data, collate, dp, engine.grid.data_parallel_id)}
        state["history"]["eval"].append(metrics)
        print0("[eval] " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
        return metrics

    def checkpoint_now():
        save_checkpoint(output_dir, state["step"], state, config_yaml, cfg.checkpoint.keep_last,
                        lambda path: engine.save_checkpoint(path, tag="engine"), is_main, dist.barrier)

    engine.train()
    watch = DataLoaderWatch(cfg.logging.dataloader_warn_share)
    window_t0, window_losses, window_samples, window_tokens = time.perf_counter(), [], 0, 0
    while state["step"] < stop_at:
        epoch = state["step"] // steps_per_epoch
        it = batches(epoch, (state["step"] - epoch * steps_per_epoch) * accum)
        for _ in range(steps_per_epoch - (state["step"] - epoch * steps_per_epoch)):
            loss = engine.train_batch(data_iter=it)   # accum micro-batches through the pipeline
            state["step"] += 1
            window_losses.append(float(loss))
            window_samples += cfg.train.global_batch_size
            window_tokens += cfg.train.global_batch_size * cfg.data.max_seq_length
            step = state["step"]
            if step % cfg.logging.log_every == 0 or step == total_steps:
                elapsed = time.perf_counter() - window_t0
                row = {"step": step, "epoch": round(step / steps_per_epoch, 3),
                       "loss": sum(window_losses) / len(window_losses), "lr": engine.get_lr()[0],
                       "grad_norm": float(engine.get_global_grad_norm() or float("nan")),
                       "samples_per_sec": window_samples / elapsed, "padded_tokens_per_sec": window_tokens / elapsed,
                       "step_time_s": elapsed / len(window_losses), "data_wait_share": data_wait[0] / elapsed}
                row["mfu"] = flops_token * row["padded_tokens_per_sec"] / (peak * world)
                _, warning = watch.verdict(row["data_wait_share"], len(window_losses), elapsed)
                if warning:
                    print0(warning)
                state["history"]["train"].append(row)
                print0(f"[train] step {step}/{total_steps} loss {row['loss']:.4f} lr {row['lr']:.3e} "
                       f"| {row['padded_tokens_per_sec']:.0f} padded tok/s {row['samples_per_sec']:.1f} samples/s "
                       f"{row['step_time_s'] * 1000:.0f} ms/step MFU {row['mfu']:.1%} "
                       f"data-wait {row['data_wait_share']:.0%} (rank 0)")
                window_t0, window_losses, window_samples, window_tokens = time.perf_counter(), [], 0, 0
                data_wait[0] = 0.0
            t_aside = time.perf_counter()
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total_steps:
                run_eval()
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < total_steps:
                checkpoint_now()
            window_t0 += time.perf_counter() - t_aside   # eval and checkpoints are not training time
            if step >= stop_at:
                break

    if state["step"] < total_steps:
        checkpoint_now()
        halted = {"steps": state["step"], "halted": True}
        if is_main:
            write_metrics(output_dir / "metrics.json", halted, state["history"], {"config": flat_dict(cfg)})
        print0(f"[halt] stopped at step {state['step']}/{total_steps}; continue with --resume auto")
        return halted
    final = run_eval()
    checkpoint_now()
    export_pipeline(engine, net, names, cfg, tokenizer, build_model_fn, output_dir / "model", config_yaml, is_main)
    rows = state["history"]["train"]
    final = {**final, "steps": state["step"], "first_train_loss": rows[0]["loss"], "last_train_loss": rows[-1]["loss"],
             "wall_time_s": time.perf_counter() - t_start, "num_processes": world,
             "eval_dataset_size": len(data["eval"]), "distributed_type": "DEEPSPEED_PIPELINE",
             "backend": gather_backend(backend, world)}
    if is_main:
        write_metrics(output_dir / "metrics.json", final, state["history"], {"config": flat_dict(cfg)})
        if cfg.logging.plot:
            plot_curves(output_dir / "curves.png", state["history"], f"{cfg.run.name} (pipeline)")
    print0(f"[done] {state['step']} steps in {final['wall_time_s']:.0f}s; outputs in {output_dir}")
    return final


def gather_backend(backend: dict, world: int) -> dict:
    """Every rank's stage and parameter count, so a test can check who owns what."""
    import deepspeed.comm as dist
    mine = {"stage_id": backend["stage_id"], "local_param_numel": backend["local_param_numel"]}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {**backend, "ranks": everyone}


def export_pipeline(engine, net, names, cfg, tokenizer, build_model_fn, out_dir: Path, config_yaml: str,
                    is_main: bool) -> None:
    """Gather every stage's weights onto rank 0 and write an ordinary Hugging Face model."""
    import deepspeed.comm as dist
    local = {}
    if engine.grid.data_parallel_id == 0:   # one replica of each stage is enough
        for key, value in net.state_dict().items():
            hf = to_hf_name(key, names)
            if hf is not None:
                local[hf] = value.detach().float().cpu()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if is_main:
        state_dict = {}
        for part in gathered:
            state_dict.update(part)
        model = build_model_fn(tokenizer)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        tied_ok = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
        if set(missing) - tied_ok or unexpected:
            raise RuntimeError(f"pipeline export: missing {sorted(set(missing) - tied_ok)}, unexpected {unexpected}")
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "recipe.yaml").write_text(config_yaml)
    dist.barrier()


def evaluate_pipeline(engine, cfg, data, collate, dp: int, dp_rank: int) -> dict:
    """Eval through the pipeline: each replica takes every dp-th sample; a short last batch is
    padded with repeats (the pipeline's buffers have fixed shapes) and the repeats are dropped
    before the metrics, so every sample counts once."""
    import deepspeed.comm as dist
    import numpy as np
    from .data import Indexed
    from .metrics import compute_metrics, default_metrics

    ds = Indexed(data["eval"])
    bs = cfg.train.eval_batch_size or cfg.train.micro_batch_size
    mine = list(range(dp_rank, len(ds), dp))
    n_batches = math.ceil(math.ceil(len(ds) / dp) / bs)   # the same on every replica
    collate.epoch = 0
    rows = []
    engine.eval()
    for b in range(n_batches):
        idx = mine[b * bs:(b + 1) * bs]
        valid = len(idx)
        idx = idx + [idx[0] if idx else 0] * (bs - valid)
        batch = collate([ds[i] for i in idx])
        inputs = (batch["input_ids"], batch["attention_mask"],
                  batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])))
        _, logits = engine.eval_batch(iter([(inputs, batch["labels"])]), return_logits=True, num_micro_batches=1)
        if engine.is_last_stage() and valid:
            logits, labels = logits[:valid].float(), batch["labels"][:valid]
            if cfg.task.kind == "mlm":
                token_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
                rows += list(zip(token_loss.sum(1).tolist(), (labels != -100).sum(1).tolist()))
            elif cfg.task.num_labels == 1:
                rows += list(zip(logits.squeeze(-1).tolist(), labels.tolist()))
            else:
                rows += list(zip(logits.argmax(-1).tolist(), labels.tolist()))
    engine.train()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    rows = [r for part in everyone for r in part]
    if cfg.task.kind == "mlm":
        total, count = sum(r[0] for r in rows), sum(r[1] for r in rows)
        loss = total / max(count, 1)
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50)), "eval_samples": len(rows)}
    preds, refs = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    out = compute_metrics(cfg.task.metrics or default_metrics(cfg.task.num_labels), preds, refs, cfg.task.num_labels)
    return {**out, "eval_samples": len(rows)}
