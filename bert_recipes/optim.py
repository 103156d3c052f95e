"""AdamW with decoupled weight decay, and a warmup + decay schedule."""
from __future__ import annotations

import math

import torch

from .config import OptimConfig


def build_optimizer(model, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; biases and LayerNorm weights get no weight decay. The fused kernel is used on
    CUDA, the foreach (multi-tensor) one elsewhere."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = torch.cuda.is_available()
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=True if on_cuda else None, foreach=None if on_cuda else True)


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    warmup = warmup_steps(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total_steps, cfg.decay, cfg.min_lr_ratio))
