"""AdamW or LAMB with decoupled weight decay, and a warmup + decay schedule."""
from __future__ import annotations

import math

import torch

from .config import OptimConfig


def build_optimizer(model, cfg: OptimConfig, offloaded: bool = False) -> torch.optim.Optimizer:
    """AdamW (optim.name: adamw) or LAMB (lamb); biases and LayerNorm weights get no weight decay.
    The recipe owns the maths; the backend picks the implementation: torch's fused AdamW kernel (CUDA
    and CPU; optim.fused=false: the foreach multi-tensor one), and under ZeRO offload
    (offloaded: the step runs on the CPU) DeepSpeed's vectorised CPU Adam (optim.cpu_adam)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if offloaded and cfg.cpu_adam:
        from .backends.deepspeed import cpu_adam
        return cpu_adam(groups, cfg)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=True if cfg.fused else None, foreach=None if cfg.fused else True)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2), as NVIDIA's
    BERT pretraining uses it: Adam's bias-corrected moments give r = m_hat / (sqrt(v_hat) + eps); the
    update u = r + weight_decay * x is scaled per parameter tensor by the trust ratio ||x|| / ||u||
    (1 when either norm is 0; phi = identity, as apex's FusedLAMB): x <- x - lr * ||x|| / ||u|| * u.
    Each layer thus moves by a set fraction of its own norm, which keeps very large batches stable.
    tests/test_user_path.py checks it step by step against the rule written out in numpy.
    The trust ratio needs whole tensors: ZeRO and FSDP, which hand the optimizer shards, are refused."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter; none where `self.found_inf` (a 0-d tensor, set by the engine
        for a non-finite step) is non-zero: the moments, the step count and the weights keep their
        values, decided on the device (as torch's fused AdamW does with the same attribute)."""
        loss = closure() if closure is not None else None
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if not torch.is_tensor(state["step"]):   # a checkpoint from before the step became a tensor
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float64, device=p.device)
                keep = 1.0 if found_inf is None else (found_inf.to(p.device) == 0).to(p.dtype)
                state["step"] += keep
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                m.lerp_(torch.lerp(m, p.grad, 1 - beta1), keep)                 # m <- beta1 m + (1 - beta1) g
                v.lerp_(torch.lerp(v, p.grad * p.grad, 1 - beta2), keep)        # (where kept)
                t = t.clamp(min=1)   # a first step that was skipped leaves t = 0: no division by zero
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * (-group["lr"] * trust * keep))   # no host sync: the ratio stays a tensor
        return loss


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, warmup: int, total: int, decay: str, min_ratio: float, poly_power: float = 1.0) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
             "polynomial": (1.0 - progress) ** poly_power}[decay]
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    warmup = warmup_steps(cfg, total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total_steps, cfg.decay, cfg.min_lr_ratio, cfg.poly_power))
    scheduler.total_steps, scheduler.warmup_steps = total_steps, warmup   # for a DeepSpeed-owned schedule
    return scheduler
