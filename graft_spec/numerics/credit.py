"""One verified round as calibration counts: credit to the bins and the source window, and the
round's metrics per row (calibration.py; the computation of the ``graft::observe_rows`` op).
"""

from __future__ import annotations

import torch

from .correction import apply_correction
from .fixed import FIXED_ONE, to_fixed

__all__ = ["credit_counts", "round_metrics"]


def credit_counts(trials: torch.Tensor, hits: torch.Tensor, src_recent, group: torch.Tensor, base: torch.Tensor,
                  bins: torch.Tensor, on_path: torch.Tensor) -> None:
    """Add one round's trials and hits to the bins and (``src_recent`` not None) to the source window,
    in place (halving is `Calibrator.refresh`'s).

    Args:
        trials, hits: ``float32[S + 1]`` (the dump bin S stays 0); src_recent: ``int64[2M + 1, 3]``
            fixed-point (trials, sum of the bins' estimates ``base``, hits) per (mode, member), or None.
        group: ``int64[S + 1]`` each bin's row of ``src_recent``; base: ``float32[S + 1]``.
        bins: ``int64[B, N, M]`` member bins (-1: none); on_path: ``bool[B, N]``.
    """
    dump = trials.numel() - 1
    valid = bins >= 0
    flat = torch.where(valid, bins, dump).reshape(-1)
    v = valid.reshape(-1)
    hit = (on_path[:, :, None] & valid).reshape(-1)
    trials.index_add_(0, flat, v.float())
    hits.index_add_(0, flat, hit.float())
    trials[dump].fill_(0.0)
    hits[dump].fill_(0.0)
    if src_recent is not None:
        inc = torch.stack([v.long() * FIXED_ONE, to_fixed(base.gather(0, flat)) * v, hit.long() * FIXED_ONE], dim=1)
        src_recent.index_add_(0, group.gather(0, flat), inc)


def round_metrics(bins: torch.Tensor, on_path: torch.Tensor, depth: torch.Tensor, estimates: torch.Tensor,
                  scale: torch.Tensor, under: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One round's calibration metrics per row.

    Args:
        bins: ``int64[B, N, M]``; on_path: ``bool[B, N]``; depth: ``int64[B, N]``.
        estimates: ``float32[S + 1]`` the table the round was priced with; scale, under:
            ``float32[B, M]`` / ``bool[B, M]`` the per-request correction it was priced with.
        max_depth: the last depth row (deeper nodes count there).
    Returns:
        ``(float64[B, M, 3], float64[B, max_depth + 1, 2])``: per row and member (trials, sum of the
        estimates as priced, hits); per row and depth (verified, accepted) nodes, row 0 zero.
    """
    b, n, m = bins.shape
    valid = bins >= 0
    hit = on_path[:, :, None] & valid
    est = estimates.gather(0, torch.where(valid, bins, estimates.numel() - 1).reshape(-1)).view(b, n, m)
    priced = torch.where(valid, apply_correction(est, scale[:, None, :], under[:, None, :]), 0.0)
    members = torch.stack([valid.sum(1).double(), to_fixed(priced).sum(1).double() * (1.0 / FIXED_ONE),
                           hit.sum(1).double()], dim=2)
    node = valid.any(dim=2)
    d = torch.where(node, depth.clamp(0, max_depth), 0)
    depths = torch.zeros(b, max_depth + 1, 2, dtype=torch.float64, device=bins.device).scatter_add_(
        1, d[:, :, None].expand(b, n, 2), torch.stack([node, node & on_path], dim=2).double())
    depths[:, 0].fill_(0.0)
    return members, depths
