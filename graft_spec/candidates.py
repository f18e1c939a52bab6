"""`Candidates`: the one structure every candidate node of a round travels in.

Each source of a round (the draft's rerank, the successor table, the device chains of lookup and the
output index, the host proposals) returns its candidates as one `Candidates` block of ``[B, C]``
tensors, priced in the calibrated currency (calibration.py). `Candidates.stack` puts the rooted
draft block first and the retrieved blocks after it, re-pointing their parents, and
`graft.merge_select` turns the stacked block into the tree. A new source is one function that
returns a block; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .kernels.stack import stack_candidates

__all__ = ["Candidates"]


@dataclass
class Candidates:
    """Candidate nodes, ``[B, C]`` per field.

    Attributes:
        tokens: ``int64[B, C]``.
        parents: ``int64[B, C]``: the parent's index within the same block; -1 = a child of the
            round's root (a retrieved block), or the root itself (a rooted block: the root at index
            0, its children point to 0).
        est: ``float32[B, C]`` estimated probability of lying on the accepted path (0 where not
            valid).
        valid: ``bool[B, C]`` candidates that may be selected.
        bins: ``int64[B, C]`` calibration bin of each candidate (-1: none).
        member: ``int64[B, C]`` member source (``calibration.MEMBER_*``).
        key: ``float32[B, C]`` selection priority when it differs from ``est`` (the paper's
            checkpoints keep pruned-in draft nodes at +inf), else None.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    est: torch.Tensor
    valid: torch.Tensor
    bins: torch.Tensor
    member: torch.Tensor
    key: Optional[torch.Tensor] = None

    @property
    def width(self) -> int:
        """C, candidates per row."""
        return self.tokens.shape[1]

    @property
    def priority(self) -> torch.Tensor:
        """``float32[B, C]`` the selection key (``key``, else ``est``)."""
        return self.est if self.key is None else self.key

    def where(self, keep: torch.Tensor) -> "Candidates":
        """The block with the candidates outside ``keep`` (``bool``, broadcastable to ``[B, C]``)
        made invalid: ``valid`` False, ``est`` 0, ``bins`` -1 (a key of +inf stays: it is the
        paper mode's always-keep, not a price)."""
        zero = torch.zeros((), dtype=self.est.dtype, device=self.est.device)
        return Candidates(self.tokens, self.parents, torch.where(keep, self.est, zero), self.valid & keep,
                          torch.where(keep, self.bins, -1), self.member, self.key)

    def fields(self) -> list[torch.Tensor]:
        """The block as `kernels.stack.FIELDS` tensors: tokens, parents, est, valid, bins, member,
        priority."""
        return [self.tokens, self.parents, self.est, self.valid, self.bins, self.member, self.priority]

    @staticmethod
    def stack(rooted: "Candidates", parts: Sequence["Candidates"], speculate: Optional[torch.Tensor] = None
              ) -> "Candidates":
        """One block ``[B, C0 + sum C_i]``: ``rooted`` (root at index 0) first, then every part with
        its parents re-pointed into the stack (-1, a child of the root, becomes 0); the rows where
        ``speculate`` ``bool[B]`` is False (default: none) lose every candidate. One fused op
        (kernels/stack.py)."""
        if speculate is None:
            speculate = torch.ones(rooted.tokens.shape[0], dtype=torch.bool,
                                   device=rooted.tokens.device)
        blocks = [x for block in (rooted, *parts) for x in block.fields()]
        return Candidates(*stack_candidates(blocks, speculate))
