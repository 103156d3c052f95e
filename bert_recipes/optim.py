"""AdamW, LAMB or StableAdamW with decoupled weight decay, the device-side skip of a step that is not finite (skip_update_if, the
optimizers' found_inf), and a warmup + decay schedule (warmup-stable-decay among them)."""
from __future__ import annotations

import math

import torch

from .config import OptimConfig


def build_optimizer(model, cfg: OptimConfig, host_adam=None) -> torch.optim.Optimizer:
    """AdamW (optim.name: adamw), LAMB (lamb) or StableAdamW (stable_adamw); biases and LayerNorm weights get no
    weight decay.
    The recipe owns the maths; the backend picks the implementation: torch's fused AdamW kernel (CUDA
    and CPU; optim.fused=false: the foreach multi-tensor one), or host_adam(groups, cfg), the backend's own AdamW
    for a step on the host (ZeRO offload: DeepSpeed's vectorised CPU Adam, backends/deepspeed.host_adam)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if full_ndim(p) < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, trust_ratio=cfg.lamb_trust_ratio)
    if cfg.name == "stable_adamw":
        return StableAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if host_adam is not None:
        return host_adam(groups, cfg)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=True if cfg.fused else None, foreach=None if cfg.fused else True)


def full_ndim(p: torch.Tensor) -> int:
    """A parameter's dimensions as the model declares them. A model loaded under ZeRO-3 (from_pretrained inside
    DeepSpeed's zero.Init) holds each parameter as an empty 1-D partition with its shape in ds_shape: read off
    p.ndim, every weight matrix would take no weight decay and the decay group would be empty (DeepSpeed then drops
    it, and the schedule's two lr factors meet one group)."""
    return len(p.ds_shape) if hasattr(p, "ds_shape") else p.ndim


def skip_flag(found_inf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """found_inf as the update kernels take it: fp32 on the parameters' device. skip_update_if sets it there
    already (the loss's device), so no copy is made; a .to() would be a no-op the sync audit still counts."""
    if found_inf.device == like.device and found_inf.dtype == torch.float32:
        return found_inf
    return found_inf.to(device=like.device, dtype=torch.float32)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2) as NVIDIA trains
    BERT with apex's FusedLAMB (defaults: adam_w_mode, use_nvlamb=False): Adam's bias-corrected moments
    give r = m_hat / (sqrt(v_hat) + eps) and the update u = r + weight_decay * x. Where weight decay
    applies, u is scaled per tensor by the trust ratio ||x|| / ||u|| (1 when either norm is 0; phi =
    identity, no clamp): x <- x - lr * ||x|| / ||u|| * u; biases and LayerNorm weights (weight decay 0)
    take plain Adam steps, x <- x - lr * u. trust_ratio="all" scales every tensor (use_nvlamb=True: the
    rule this file had before 2026-12-03). Each layer thus moves by a set fraction of its own norm, which
    keeps very large batches stable. The gradient is clipped before the step (optim.max_grad_norm; apex
    clips inside its step).
    The step is multi-tensor: torch's fused Adam kernel gives the moments and r for a whole group at
    once, then a few foreach ops the decay, the norms and the scaled step, so the operator calls per
    step grow with the number of groups, not of tensors (docs/speed.md: 6,136 -> 27 on BERT-base).
    tests/test_references.py checks it step by step against timm's Lamb (always_adapt=False).
    The trust ratio needs whole tensors: ZeRO and FSDP, which hand the optimizer shards, are refused."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 trust_ratio: str = "decayed"):
        if trust_ratio not in ("decayed", "all"):
            raise ValueError(f"trust_ratio={trust_ratio!r}: decayed or all")
        # fused=True: load_state_dict then puts each step count on its parameter's device as float32 (what
        # torch's fused kernel reads), as it does for torch's fused AdamW. The rule is no group key: a
        # checkpoint's groups replace these on a resume, and the run's config decides the rule.
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
        self.trust_ratio = trust_ratio

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:   # the groups of a checkpoint from before 2026-12-03
            group.setdefault("fused", True)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter; none where `self.found_inf` (a 0-d tensor, set by the engine
        for a non-finite step) is non-zero: the moments, the step count and the weights keep their
        values, decided on the device (as torch's fused AdamW does with the same attribute)."""
        loss = closure() if closure is not None else None
        found_inf = getattr(self, "found_inf", None)
        skip = None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                if found_inf is not None and skip is None:
                    skip = skip_flag(found_inf, params[0])
                self._group_step(group, params, skip)
        return loss

    def _group_step(self, group: dict, params: list, skip) -> None:
        """About a dozen operator calls for the whole group, whatever its number of tensors. skip: None,
        or a float32 0-d tensor on the parameters' device, 1 for a step to skip."""
        beta1, beta2 = group["betas"]
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        # r lands in `updates`: the fused Adam kernel moves its "parameters" by -lr * r, so zeros and lr = -1.
        # The zeros come from the weights, not the gradients: a skipped step's gradients may be NaN, and
        # the kernel leaves `updates` untouched then (0 * NaN would be NaN).
        updates = torch._foreach_mul(params, 0.0)
        torch._foreach_add_(steps, 1.0)
        torch._fused_adam_(updates, [p.grad for p in params], [s["exp_avg"] for s in states],
                           [s["exp_avg_sq"] for s in states], [], steps, lr=-1.0, beta1=beta1, beta2=beta2,
                           weight_decay=0.0, eps=group["eps"], amsgrad=False, maximize=False, found_inf=skip)
        if skip is not None:   # as torch's fused AdamW: a skipped step does not count (a list: no .item())
            torch._foreach_sub_(steps, [skip] * len(steps))
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        if not group["weight_decay"] and self.trust_ratio == "decayed":
            scale = torch.full((len(params),), -group["lr"], device=params[0].device)
        else:
            w_norm = torch.stack(torch._foreach_norm(params))
            u_norm = torch.stack(torch._foreach_norm(updates))
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
            scale = trust * -group["lr"]
        if skip is not None:   # where, not a product: nothing of a skipped step reaches the weights
            scale = torch.where(skip == 0, scale, 0.0)
        torch._foreach_addcmul_(params, updates, scale.unbind())

    def _state(self, p) -> dict:
        return _adam_state(self.state[p], p)


class StableAdamW(torch.optim.Optimizer):
    """StableAdamW (Wortsman et al. 2023, "Stable and low-precision training for large-scale vision-language
    models"), as ModernBERT trains with torch-optimi's (decouple_lr=True): AdamW with debiased moments, whose step
    size each tensor clips by its own update RMS. At step t, with b(beta) = (beta^t - beta) / (beta^t - 1):
        m <- b(beta1) m + (1 - b(beta1)) g,   v <- b(beta2) v + (1 - b(beta2)) g^2
        rms = sqrt(mean(g^2 / max(v, eps^2)))   (the updated v; a tensor's RMS)
        lr_t = lr / max(1, rms)
        p <- p (1 - (lr_t / max_lr) weight_decay)   (fully decoupled: max_lr is the recipe's optim.lr)
        p <- p - lr_t m / (sqrt(v) + eps)
    A gradient spike (g^2 far above v's history) thus shrinks that tensor's step instead of throwing it far.
    Multi-tensor (foreach) ops for a whole group and the debiasing, clip and skip as device tensors: no .item(),
    so the host never waits (torch-optimi reads each tensor's RMS on the host). A step where `self.found_inf` is
    non-zero changes nothing: moments, step counts and weights keep their values. The RMS needs whole tensors:
    ZeRO and FSDP, which hand the optimizer shards, are refused (backends/consistency.py).
    tests/test_references.py checks it step by step against torch-optimi 0.3.3's StableAdamW."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-6, weight_decay: float = 0.0,
                 max_lr: float | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_lr=max_lr or lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                skip = None if found_inf is None else skip_flag(found_inf, params[0])
                self._group_step(group, params, skip)
        return loss

    def _group_step(self, group: dict, params: list, skip) -> None:
        beta1, beta2 = group["betas"]
        states = [_adam_state(self.state[p], p) for p in params]
        steps = [s["step"] for s in states]
        m, v = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        grads = [p.grad for p in params]
        keep = None if skip is None else skip == 0
        if keep is not None:   # a skipped step's gradients may be NaN: none of it reaches the moments (the one
            zero = torch.zeros((), dtype=grads[0].dtype, device=grads[0].device)   # per-tensor op of the step)
            grads = [torch.where(keep, g, zero) for g in grads]
        torch._foreach_add_(steps, [1.0 - skip] * len(steps) if skip is not None else 1.0)
        t = torch.stack(steps).clamp(min=1.0)
        hats = [(beta ** t - beta) / (beta ** t - 1) for beta in (beta1, beta2)]   # 0 at step 1: m = g, v = g^2
        if keep is not None:   # a skipped step keeps the moments: weight 1 on the old ones
            hats = [torch.where(keep, h, 1.0) for h in hats]
        torch._foreach_mul_(m, hats[0].unbind())
        torch._foreach_add_(m, torch._foreach_mul(grads, (1 - hats[0]).unbind()))
        torch._foreach_mul_(v, hats[1].unbind())
        torch._foreach_add_(v, torch._foreach_mul(torch._foreach_mul(grads, grads), (1 - hats[1]).unbind()))
        # rms = sqrt(mean(g^2 / max(v, eps^2))) = ||g / sqrt(max(v, eps^2))|| / sqrt(numel): one norm call a group
        ratios = torch._foreach_div(grads, torch._foreach_sqrt(torch._foreach_maximum(v, group["eps"] ** 2)))
        rms = torch.stack(torch._foreach_div(torch._foreach_norm(ratios), [math.sqrt(p.numel()) for p in params]))
        scale = group["lr"] / rms.clamp(min=1.0)
        if skip is not None:
            scale = torch.where(keep, scale, 0.0)
        if group["weight_decay"]:
            torch._foreach_mul_(params, (1 - scale * (group["weight_decay"] / group["max_lr"])).unbind())
        denominators = torch._foreach_sqrt(v)
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_addcmul_(params, torch._foreach_div(m, denominators), (-scale).unbind())


def _adam_state(state: dict, p) -> dict:
    """A parameter's step count (float32 on its device) and first and second moments, made on its first step."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    step = state["step"]
    if not torch.is_tensor(step) or step.dtype != torch.float32 or step.device != p.device:
        # a checkpoint from before: a Python number, or a float64 count (what the fused kernel cannot read)
        state["step"] = torch.as_tensor(step, dtype=torch.float32, device=p.device).clone()
    return state


def total_norm(norm):
    """clip_grad_norm_'s total norm as a plain tensor, whatever the backend: FSDP2 returns a DTensor, whose
    full_tensor() is the global norm (the same on every rank); DDP's and the rest are plain already."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def skip_update_if(optimizer, scaler, skipped) -> bool:
    """Make this step's update a no-op where `skipped` (a bool tensor on the device) is true, without
    the host reading it. -> whether to call optimizer.step() at all.

    fp16: the loss scaler skips overflowing gradients itself; a non-finite loss is added to what it
    found, so both take the same road (the scaler hands found_inf to a fused optimizer). Otherwise the
    optimizer under Accelerate's wrapper takes it as `found_inf`: torch's fused AdamW (optim.fused, the
    default), the recipe's LAMB and StableAdamW. Other kernels cannot (optim.fused=false, the foreach AdamW): there the
    host reads the flag, one wait per step."""
    inner = optimizer.optimizer   # Accelerate's AcceleratedOptimizer wraps the torch optimizer
    if scaler is not None:
        found = scaler._per_optimizer_states[id(inner)].get("found_inf_per_device", {})
        for value in found.values():   # 0 or 1: the fused kernels skip on exactly 1
            torch.maximum(value, skipped.to(value), out=value)
        return True
    if getattr(inner, "_step_supports_amp_scaling", False) or isinstance(inner, (Lamb, StableAdamW)):
        inner.found_inf = skipped.float()
        return True
    return not bool(skipped)   # a host wait: this kernel has no found_inf


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * total_steps)


def wsd_decay_start(cfg: OptimConfig, total_steps: int) -> int:
    """optim.decay=wsd: the 0-based index of the first decay step. optim.wsd_decay_start if set, else the
    last round(wsd_decay_ratio x total) steps decay (torchtitan's decay_ratio), never inside the warmup:
    e.g. 1,000 steps at ratio 0.2 -> steps 0-799 warm up then hold the peak lr, 800-999 decay."""
    if cfg.wsd_decay_start is not None:
        return cfg.wsd_decay_start
    return max(warmup_steps(cfg, total_steps), total_steps - round(cfg.wsd_decay_ratio * total_steps))


_SHAPES = {"linear": lambda progress: 1.0 - progress,
           "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
           "1-sqrt": lambda progress: 1.0 - math.sqrt(progress)}


def lr_factor(step: int, warmup: int, total: int, decay: str, min_ratio: float, poly_power: float = 1.0,
              decay_start: int | None = None, decay_shape: str = "1-sqrt") -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based). The decay runs from its first step
    (the end of the warmup; under wsd `decay_start`, the stable phase held at 1 until then) at progress 0
    to `total` at progress 1, as transformers' schedules do: the last step's progress is (n - 1) / n."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    start = warmup
    if decay == "wsd":
        if step < decay_start:
            return 1.0
        start = decay_start
    progress = min(1.0, (step - start) / max(1, total - start))
    if decay == "polynomial":
        shape = (1.0 - progress) ** poly_power
    else:
        shape = _SHAPES[decay_shape if decay == "wsd" else decay](progress)
    return min_ratio + (1.0 - min_ratio) * shape


def schedule(cfg: OptimConfig, total_steps: int):
    """step (0-based) -> the factor of the peak lr, for a run of total_steps."""
    warmup = warmup_steps(cfg, total_steps)
    start = wsd_decay_start(cfg, total_steps) if cfg.decay == "wsd" else None
    return lambda step: lr_factor(step, warmup, total_steps, cfg.decay, cfg.min_lr_ratio, cfg.poly_power, start,
                                  cfg.wsd_decay_shape)


def describe_decay(cfg: OptimConfig, total_steps: int) -> str:
    """The [schedule] line's words for the decay: under wsd, where each phase runs (1-based steps)."""
    if cfg.decay != "wsd":
        return f"{cfg.decay} decay"
    warmup, start = warmup_steps(cfg, total_steps), wsd_decay_start(cfg, total_steps)
    decay = (f"{cfg.wsd_decay_shape} decay over steps {start + 1}-{total_steps} to {cfg.min_lr_ratio:g} x lr"
             if start < total_steps else "no decay in this run")
    return f"wsd: {warmup} warmup steps, the peak lr through step {min(start, total_steps)}, {decay}"


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    """The schedule over total_steps. Its checkpointed state is the step count only (scheduler.json): a
    resume rebuilds the shape from the resumed run's config, so a longer run re-places a wsd decay."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg, total_steps))
    # for a DeepSpeed-owned schedule (backends/deepspeed.py)
    scheduler.total_steps, scheduler.warmup_steps = total_steps, warmup_steps(cfg, total_steps)
    return scheduler


def resume_schedule(scheduler) -> None:
    """After a resume: the optimizer's lr from this run's schedule at the checkpoint's step. The optimizer's
    saved lr is the checkpointed run's; with another run length it would drive one more step."""
    inner = getattr(scheduler, "scheduler", scheduler)   # Accelerate's AcceleratedScheduler wraps it
    if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR):   # a DeepSpeed-owned schedule restores itself
        return
    for group, base_lr, factor in zip(inner.optimizer.param_groups, inner.base_lrs, inner.lr_lambdas):
        group["lr"] = base_lr * factor(inner.last_epoch)
    inner._last_lr = [group["lr"] for group in inner.optimizer.param_groups]


def schedule_change(cfg: OptimConfig, step: int, was_total: int, total: int) -> str | None:
    """A resume after `step` optimizer steps whose run length changed (train.max_steps or train.epochs),
    was_total -> total: the one [resume] line saying what that does to the lr; None when it did not change."""
    if was_total == total:
        return None
    old, new, lr = schedule(cfg, was_total), schedule(cfg, total), cfg.lr
    head = f"[resume] the run's length changed, {was_total} -> {total} optimizer steps (train.max_steps / train.epochs)"
    past = next((k for k in range(step) if old(k) != new(k)), None)
    if past is None and old(step) == new(step):
        if cfg.decay != "wsd":
            return f"{head}: optim.decay={cfg.decay} gives every step the same lr as before"
        was, now = wsd_decay_start(cfg, was_total), wsd_decay_start(cfg, total)
        return (f"{head}: optim.decay=wsd holds the peak lr {lr:g} through step {now} and decays "
                f"({cfg.wsd_decay_shape}) over steps {now + 1}-{total} (was {was + 1}-{was_total}); the lr of "
                f"steps 1-{step}, up to this checkpoint, is unchanged")
    then = (f"; steps {past + 1}-{step} trained on the old one (a run of {total} steps would have given step "
            f"{past + 1} lr {new(past) * lr:.3e}, not {old(past) * lr:.3e})" if past is not None else "")
    return (f"{head}: optim.decay={cfg.decay} is shaped by the run's length, so step {step + 1} trains at lr "
            f"{new(step) * lr:.3e}, not {old(step) * lr:.3e}{then}; optim.decay=wsd with optim.warmup_steps "
            "resumes a stable-phase checkpoint with its past unchanged")
