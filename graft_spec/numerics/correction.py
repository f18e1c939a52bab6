"""The linear recalibration of estimates by a window of verified nodes (calibration.py, "Source
correction"; request_correction.py): fitting it, applying it, pricing nodes through it, and adding a
round to a request's windows.
"""

from __future__ import annotations

import torch

from .fixed import from_fixed, to_fixed

__all__ = ["linear_correction", "apply_correction", "price", "window_update"]


def linear_correction(trials: torch.Tensor, estimated: torch.Tensor, hits: torch.Tensor,
                      pseudo_trials: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear recalibration of a window of verified nodes (module docstring, "Source
    correction"): ``(scale, under)``, both shaped like the inputs.

    Args:
        trials, estimated, hits: float windows (any equal shapes): trials ``T``, sum of the estimates
            the nodes were priced with ``E``, hits ``H``.
        pseudo_trials: ``a``, pseudo-trials of calibrated data at the window's mean estimate
            (a window with few trials stays near the identity).
    Returns:
        ``scale`` float in (0, 1] and ``under`` bool (the window was under-estimated, ``H > E``);
        `apply_correction` maps an estimate ``b`` to ``1 - (1 - b) * scale`` where ``under`` (misses
        scaled) and ``b * scale`` elsewhere (hits scaled). A window with under one trial: identity.
    """
    a = pseudo_trials
    t, e, h = trials, estimated, hits
    pe = a * e / t.clamp(min=1e-6)
    pm = a - pe
    seen = t >= 1.0
    hits_scale = torch.where(seen, (h + pe) / (e + pe).clamp(min=1e-6), 1.0).clamp(max=1.0)
    miss_scale = torch.where(seen, (t - h + pm) / (t - e + pm).clamp(min=1e-6), 1.0).clamp(max=1.0)
    under = h > e
    return torch.where(under, miss_scale, hits_scale), under


def apply_correction(base: torch.Tensor, scale: torch.Tensor, under: torch.Tensor) -> torch.Tensor:
    """Estimates ``base`` through `linear_correction`'s ``(scale, under)`` (broadcast): monotone in
    ``base`` and in [0, 1] for ``base`` in [0, 1]."""
    return torch.where(under, 1.0 - (1.0 - base) * scale, base * scale)


def price(est: torch.Tensor, member: "int | torch.Tensor", factors: tuple[torch.Tensor, torch.Tensor]
          ) -> torch.Tensor:
    """Estimates ``est`` ``float32[B, M]`` of nodes of member sources ``member`` (one member for
    every node, an int, or int64 broadcastable to ``[B, M]``) through their rows' per-request
    correction ``factors`` ``(scale float32[B, NUM_MEMBERS], under bool[B, NUM_MEMBERS])``
    (`RequestCorrection.factors`)."""
    scale, under = factors
    if isinstance(member, int):
        return apply_correction(est, scale[:, member, None], under[:, member, None])
    m = member.to(torch.int64).expand_as(est)
    return apply_correction(est, scale.gather(1, m), under.gather(1, m))


def window_update(recent: torch.Tensor, slot_ids: torch.Tensor, bins: torch.Tensor, on_path: torch.Tensor,
                  estimates: torch.Tensor, window: float) -> None:
    """Add one verified round to the windows ``recent`` ``float32[slots, NUM_MEMBERS, 3]`` of the rows'
    slots, in place (arguments as for `RequestCorrection.update`; ``window`` > 0). Each member that
    proposed verified nodes adds one trial, its nodes' mean estimate (an int64 fixed-point sum,
    calibration.py `FIXED_ONE`) and hit rate; rows past ``window`` trials are halved."""
    ids = slot_ids.to(torch.int64)
    valid = bins >= 0
    est = torch.where(valid, estimates.gather(0, bins.clamp(min=0).reshape(-1)).view_as(bins), 0.0)
    stats = torch.stack([valid.sum(1).float(), from_fixed(to_fixed(est).sum(1)),
                         (on_path[:, :, None] & valid).sum(1).float()], dim=2)
    # one round is one trial of weight 1 per member: its nodes' outcomes are chained (a rejected
    # node rejects its whole subtree), so twenty nodes of one chain are not twenty samples
    stats = stats / stats[..., :1].clamp(min=1.0)
    rows = recent.index_select(0, ids) + stats                                  # [B, NUM_MEMBERS, 3]
    rows = rows * torch.where(rows[..., :1] > window, 0.5, 1.0)
    recent.index_copy_(0, ids, rows)
