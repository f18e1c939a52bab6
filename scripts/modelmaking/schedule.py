"""Learning-rate schedule and optimiser shared by the target and draft trainers."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, total: int, peak: float, warmup_frac: float, floor_frac: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup_frac * total`` steps, then cosine to ``floor_frac * peak``."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95); 2-D weights decay, norms and vectors do not. Fused on CPU if available."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def maybe_compile(fn, enabled: bool):
    """``torch.compile(fn)`` when enabled, else ``fn``. Compilation errors surface on first call."""
    if not enabled:
        return fn
    return torch.compile(fn)
