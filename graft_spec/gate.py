"""Stop drafting early when no deeper draft node can win a slot (eager execution only).

A batched drafter runs one forward per depth for the whole batch (SGLang's
``EagleDraftWorker.draft_forward``). After depth d every deeper draft node descends from a depth-d
frontier node, so its cumulative draft probability is at most ``q*_d`` (the best at depth d) and,
because estimates never increase as q falls (calibration.py), its estimate is at most

    bound_d = max over depths d' > d of est(draft, d', bin(q*_d))

The retrieved candidates alone already fill the round's n - 1 slots (n its verify width: N, or a
narrower width of the batch budget) down to their (n-1)-th best estimate; per source those are
distinct paths, so ``floor = max over sources of the (n-1)-th best estimate of that source`` never
exceeds the final selection threshold (`retrieval_floor`). When
``bound_d < floor`` for every request of the batch, no further draft node could be selected: the
remaining forwards are skipped (paper Sec. 3.1, "draft less"), and the never-drafted nodes get
probability 0, so the step selects exactly what it would have selected from the full tree.

The decision needs one host read per depth, so it exists only in eager execution; a CUDA-graph
replay always drafts the full depth (the graph has no host control flow) and the step prices the
full tree. The inputs (estimates, retrieval candidates) are the step's own, computed once for the
gate and the build (`GraftPlanner.stop_gate`), so every rank that builds the same step inputs takes
the same decision.
"""

from __future__ import annotations

import torch

from .calibration import Calibrator

__all__ = ["ExpectedGainGate", "draft_bounds", "kth_best"]


def draft_bounds(calibrator: Calibrator, est_table: torch.Tensor) -> torch.Tensor:
    """``float32[2, D + 1, Q]``: per mode, depth d (0..D) and q-bin, the best estimate any draft node
    deeper than d with that q-bin or a lower one can have (0 past the last depth)."""
    lay = calibrator.layout
    per_mode = est_table[:-1].view(2, lay.per_mode)
    draft = per_mode[:, : lay.draft_bins].view(2, lay.draft_depth, lay.num_q)         # depths 1..D
    draft = draft.flip(2).cummax(2).values.flip(2)                                     # max over q' <= q
    deeper = draft.flip(1).cummax(1).values.flip(1)                                    # max over d' >= d
    zero = torch.zeros(2, 1, lay.num_q, device=est_table.device)
    return torch.cat([deeper, zero], dim=1)                                            # index d -> d' > d


def kth_best(est: torch.Tensor, valid: torch.Tensor, group: torch.Tensor, groups: int, k: int) -> torch.Tensor:
    """``float32[B]``: max over groups of the k-th largest valid estimate within the group (0 if a
    group has fewer than k).

    Args:
        est, valid, group: ``[B, M]`` estimates, validity, group id (0..groups-1) per candidate.
    """
    b, m = est.shape
    best = torch.zeros(b, device=est.device)
    if m < k:
        return best
    for g in range(groups):
        x = torch.where(valid & (group == g), est, torch.zeros((), device=est.device))
        best = torch.maximum(best, x.topk(k, dim=1).values[:, k - 1])
    return best


class ExpectedGainGate:
    """Per-call state of the stop decision (see module docstring).

    Args:
        calibrator: the planner's `Calibrator` (q bins).
        bounds: `draft_bounds` of this round's estimates.
        floor: ``float32[B]`` `retrieval_floor` of this round.
        sampled: ``bool[B]`` rows in sampled mode.
    Attributes:
        stop_depth: depth after which drafting stopped (None while drafting goes on).
        retrieved: what the floor was computed from (`GraftPlanner.stop_gate` sets a
            `RoundRetrieval`; the round's build reuses it), or None.
    """

    def __init__(self, calibrator: Calibrator, bounds: torch.Tensor, floor: torch.Tensor, sampled: torch.Tensor):
        self.calibrator, self.bounds, self.floor = calibrator, bounds, floor
        self.mode = sampled.to(torch.int64)
        self.stop_depth: int | None = None
        self.retrieved = None
        #: applied to the local decision (0-dim bool tensor) before it is read: an engine with
        #: several ranks replaces it by a broadcast from its first rank, so that every rank runs the
        #: same number of draft forwards (their collectives must match)
        self.agree = lambda decision: decision

    def observe(self, depth: int, best: torch.Tensor) -> bool:
        """Record the best cumulative draft probability ``float[B]`` at ``depth`` (1, 2, ...);
        True when the drafter can stop after it (one host read)."""
        if self.stop_depth is not None:
            return True
        d = min(depth, self.bounds.shape[1] - 1)
        q = self.calibrator.q_bin(torch.log(best.float().clamp(min=1e-30)))
        bound = self.bounds[self.mode, d, q]
        if bool(self.agree((bound < self.floor).all())):
            self.stop_depth = depth
            return True
        return False
