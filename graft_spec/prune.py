"""Confidence gating: how many draft nodes each request keeps (paper Sec. 3.1).

At each checkpoint depth d the confidence is c_d = exp(max_j S_{d,j}), the best
cumulative draft probability among draft nodes at depth d (the same signal as ECHO's
sparse gating). Checkpoints are visited in increasing depth; the first whose c_d is
below its threshold fires and sets the request's draft budget K_s = ``keep``. When
none fires the request keeps ``num_nodes - 1`` draft nodes (plain EAGLE). A depth
with no draft node has c_d = 0 and therefore always fires.

The kept nodes are the K best by cumulative log-prob (ties: lower index first), after
making scores monotone along paths, so the kept set is always ancestor-closed. Different
requests keep different counts; the result is a validity mask, not a ragged tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .config import PruneStage
from .sources import SOURCE_DRAFT
from .tree import DraftTree, node_depths, order_key, path_min, pointer_jumps, top_mask

__all__ = ["PruneResult", "PruneStages", "checkpoint_confidence", "select_stage", "prune", "DraftStopGate"]


@dataclass
class PruneResult:
    """Outcome of `prune` for a batch.

    Attributes:
        keep: ``bool[B, N]`` kept nodes (root always kept), ancestor-closed.
        stage: ``int64[B]`` index of the checkpoint that fired, -1 if none fired.
        budget: ``int64[B]`` draft-node budget K (root excluded) for the request.
        num_kept: ``int64[B]`` draft nodes actually kept (root excluded), <= budget.
        confidence: ``float32[B, S]`` c_d at each checkpoint (S = number of checkpoints).
    """

    keep: torch.Tensor
    stage: torch.Tensor
    budget: torch.Tensor
    num_kept: torch.Tensor
    confidence: torch.Tensor


@dataclass(frozen=True)
class PruneStages:
    """The checkpoints as device tensors, built once (so `prune` reads no host list per round).

    Attributes:
        depths: ``int64[S]``; thresholds: ``float32[S]``; keeps: ``int64[S]``; max_keep: largest keep.
    """

    depths: torch.Tensor
    thresholds: torch.Tensor
    keeps: torch.Tensor
    max_keep: int

    @staticmethod
    def build(checkpoints: Sequence[PruneStage], device: torch.device | str = "cpu") -> "PruneStages":
        return PruneStages(
            depths=torch.tensor([c.depth for c in checkpoints], dtype=torch.int64, device=device),
            thresholds=torch.tensor([c.threshold for c in checkpoints], dtype=torch.float32, device=device),
            keeps=torch.tensor([c.keep for c in checkpoints], dtype=torch.int64, device=device),
            max_keep=max((c.keep for c in checkpoints), default=0))


def checkpoint_confidence(logp: torch.Tensor, depths: torch.Tensor, eligible: torch.Tensor,
                          checkpoint_depths: torch.Tensor) -> torch.Tensor:
    """c_d = exp(max cumulative log-prob at depth d) per request and checkpoint.

    Args:
        logp: ``float[B, N]`` cumulative draft log-prob per node.
        depths: ``int64[B, N]`` node depths.
        eligible: ``bool[B, N]`` nodes that count (draft, finite score).
        checkpoint_depths: ``int64[S]``.
    Returns:
        ``float32[B, S]`` in [0, 1]; 0 where no eligible node sits at that depth.
    """
    at = (depths[:, None, :] == checkpoint_depths[None, :, None]) & eligible[:, None, :]     # [B, S, N]
    best = torch.where(at, logp[:, None, :].float(), torch.full((), -math.inf, device=logp.device))
    return best.amax(dim=2).exp()


def select_stage(confidence: torch.Tensor, thresholds: torch.Tensor, keeps: torch.Tensor,
                 full_budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First fired checkpoint and the resulting draft budget.

    Args:
        confidence: ``float[B, S]``; thresholds: ``float[S]``; keeps: ``int64[S]``.
        full_budget: budget when nothing fires (N - 1).
    Returns:
        ``(stage int64[B] (-1 = none), budget int64[B])``.
    """
    b = confidence.shape[0]
    if confidence.shape[1] == 0:
        return (torch.full((b,), -1, dtype=torch.int64, device=confidence.device),
                torch.full((b,), full_budget, dtype=torch.int64, device=confidence.device))
    fired = confidence < thresholds[None, :]
    any_fired = fired.any(dim=1)
    first = fired.to(torch.int8).argmax(dim=1)
    stage = torch.where(any_fired, first, -1)
    budget = torch.where(any_fired, keeps[first], full_budget)
    return stage, budget


def prune(tree: DraftTree, checkpoints: "Sequence[PruneStage] | PruneStages", num_nodes: int) -> PruneResult:
    """Choose a stage per request and keep its best K draft nodes.

    Args:
        tree: draft tree ``[B, Nd]`` (e.g. from `eagle_rerank`); only SOURCE_DRAFT nodes
            with finite ``logp`` are candidates for keeping.
        checkpoints: validated stages (GraftConfig.checkpoints, increasing depth), or their
            `PruneStages` tensors (no host-to-device copy per call).
        num_nodes: output budget N of the hybrid tree; K never exceeds N - 1.
    Returns:
        `PruneResult`.
    """
    b, nd = tree.tokens.shape
    device = tree.device
    st = checkpoints if isinstance(checkpoints, PruneStages) else PruneStages.build(checkpoints, device)
    jumps = pointer_jumps(tree.parents)
    depths = node_depths(tree.parents, jumps)
    eligible = (tree.source == SOURCE_DRAFT) & torch.isfinite(tree.logp)
    eligible[:, 0].fill_(False)
    conf = checkpoint_confidence(tree.logp, depths, eligible, st.depths)
    stage, budget = select_stage(conf, st.thresholds, st.keeps, num_nodes - 1)
    budget = budget.clamp(max=num_nodes - 1)

    key = torch.where(eligible, tree.logp.float(), torch.full((), -math.inf, device=device))
    key[:, 0].fill_(math.inf)
    key = path_min(key, tree.parents, jumps)[:, 1:]
    keep_rest = top_mask(order_key(key), budget, kmax=num_nodes - 1) & (key > -math.inf)
    keep = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=device), keep_rest], dim=1)
    return PruneResult(keep=keep, stage=stage, budget=budget,
                       num_kept=keep_rest.sum(dim=1), confidence=conf)


class DraftStopGate:
    """Stops drafting early: the depth after which no request of a batch needs deeper draft nodes.

    Paper Sec. 3.1 ("a low c_d stops the tree early"): once a request's checkpoint at depth d fires,
    its budget is that stage's ``keep`` and the tree stops growing. A batched drafter (one forward
    per depth for the whole batch, as SGLang's ``EagleDraftWorker.draft_forward``) can skip its
    remaining forwards only when *every* request has fired; `observe` is called once per depth
    with the best cumulative draft probability at that depth and says when that happens.

    Consistency with `prune`: a request's first fired checkpoint depth is <= the stop depth, and
    `prune` reads c_d only at checkpoint depths, so it selects the same stage from the truncated
    tree as the gate did; the kept nodes are then the best ``keep`` among nodes of depth <= the
    stop depth (nodes the drafter never produced must be given ``-inf`` log-prob by the caller).

    Args:
        checkpoints: validated stages (``GraftConfig.checkpoints``), increasing depth.
        batch_size: B.
        device: where the ``best`` tensors live.
    """

    def __init__(self, checkpoints: Sequence[PruneStage], batch_size: int, device=None):
        self._thresholds = {c.depth: c.threshold for c in checkpoints}
        self.fired = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.stop_depth: int | None = None
        #: applied to the local decision before it is read (see `gate.ExpectedGainGate.agree`)
        self.agree = lambda decision: decision

    def observe(self, depth: int, best: torch.Tensor) -> bool:
        """Record depth ``depth``'s confidence; True when drafting can stop after this depth.

        Args:
            depth: node depth of ``best`` (first draft tokens = 1), visited in increasing order.
            best: ``float[B]`` best cumulative draft probability among depth-``depth`` nodes
                (c_d, in [0, 1]).
        Returns:
            True once every request has fired a checkpoint at a depth <= ``depth`` (then
            ``stop_depth`` = ``depth``); later calls keep returning True.
        """
        if self.stop_depth is not None:
            return True
        threshold = self._thresholds.get(depth)
        if threshold is None:
            return False
        self.fired |= best.float() < threshold
        if bool(self.agree(self.fired.all())):
            self.stop_depth = depth
            return True
        return False
