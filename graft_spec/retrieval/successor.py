"""Successor table (token recycling) as a device-resident retrieval source (paper Sec. 3.2, Eq. 9/12).

State: ``table int32[V + 2, k]``; row t (t < V) = the target's top-k next tokens the last time token
t was verified, -1 until then; row V stays all -1 (the row of an empty parent, so lookups need no
masking); row V + 1 absorbs writes that must not land anywhere (never read).

Proposal (`SuccessorTable.expand`): a fixed rank template rooted at the root token is filled one
depth at a time (one gather per depth): template slot u with parent slot p and rank r gets token
``table[token(p), r]``. The template is the best-first enumeration of the k-ary tree under prior
edge weights ``prior * decay**r``, so the rank-0 chain runs deepest and the shape is unbalanced like
Token Recycling's static template (Luowaterbi/TokenRecycling). Its slots are priced by the
calibrator (one bin per slot, calibration.py); the template only bounds the candidates.

Update (`SuccessorTable.update`): after every verify, rows of all verified non-padding nodes are
overwritten with the target's top-k (Eq. 12/14). When a token occurs at several nodes of a round,
the node with the largest flat index wins, so the result does not depend on the order in which a
device applies duplicate writes (ranks that see the same tree keep identical tables).

All methods are static-shape torch code: no host reads.
"""

from __future__ import annotations

import heapq
import math

import torch

__all__ = ["SuccessorTable", "rank_template", "template_prior"]


def rank_template(k: int, size: int, max_depth: int, prior: float, decay: float
                  ) -> tuple[list[int], list[int], list[int]]:
    """Best-first rank template (computed once, on the host, at start-up).

    Args:
        k: successor width; size: number of template slots; max_depth: deepest level.
        prior, decay: edge weight of rank r is ``prior * decay**r``.
    Returns:
        ``(parent_slot, rank, depth)`` lists of length <= size in best-first order
        (topological: a parent slot precedes its children); parent_slot -1 = root.
    """
    logw = [math.log(prior) + r * math.log(decay) for r in range(k)]
    parent, rank, depth = [], [], []
    heap = [(-logw[0], 0, -1, 0, 1, 0.0)]  # (-log score, tie, parent_slot, rank, depth, parent_log)
    tie = 1
    while heap and len(parent) < size:
        neg, _, p, r, d, plog = heapq.heappop(heap)
        slot = len(parent)
        parent.append(p)
        rank.append(r)
        depth.append(d)
        if r + 1 < k:  # next sibling (same parent, next rank)
            heapq.heappush(heap, (-(plog + logw[r + 1]), tie, p, r + 1, d, plog))
            tie += 1
        if d < max_depth:  # first child
            heapq.heappush(heap, (neg - logw[0], tie, slot, 0, d + 1, -neg))
            tie += 1
    return parent, rank, depth


def template_prior(parent: list[int], rank: list[int], prior: float, decay: float) -> list[float]:
    """Prior path acceptance of every template slot: product of ``prior * decay**rank`` on its path."""
    out: list[float] = []
    for p, r in zip(parent, rank):
        out.append((out[p] if p >= 0 else 1.0) * prior * decay ** r)
    return out


class SuccessorTable:
    """Shared ``[V, k]`` successor table on the engine's device.

    Args:
        vocab_size: V; k: successor width; max_depth: template depth cap; size: template slots T;
        prior, decay: template prior (the calibrator's prior for the slots, too);
        device: where the table lives.
    Attributes:
        table: ``int32[V + 2, k]`` (rows V and V + 1: see the module docstring).
        t_parent, t_rank, t_depth: ``int64[T]`` template (parent slot -1 = root).
        slot_prior: ``float32[T]``.
    """

    name = "successor"

    def __init__(self, vocab_size: int, k: int = 8, max_depth: int = 8, size: int = 64, prior: float = 0.4,
                 decay: float = 0.5, device: torch.device | str = "cpu"):
        if vocab_size < 2 or k < 1 or size < 1:
            raise ValueError("SuccessorTable: vocab_size >= 2, k >= 1 and size >= 1 required")
        self.vocab_size, self.k, self.device = vocab_size, k, torch.device(device)
        self.table = torch.full((vocab_size + 2, k), -1, dtype=torch.int32, device=self.device)
        par, rk, dep = rank_template(k, size, max_depth, prior, decay)
        self.size = len(par)
        self.t_parent = torch.tensor(par, dtype=torch.int64, device=self.device)
        self.t_rank = torch.tensor(rk, dtype=torch.int64, device=self.device)
        self.t_depth = torch.tensor(dep, dtype=torch.int64, device=self.device)
        self.slot_prior = torch.tensor(template_prior(par, rk, prior, decay), device=self.device)
        # one (slots, their parent slots, ranks) triple per template depth, built once
        self._levels = []
        for d in range(1, max(dep) + 1):
            idx = [u for u in range(len(par)) if dep[u] == d]
            self._levels.append((torch.tensor(idx, dtype=torch.int64, device=self.device),
                                 torch.tensor([par[u] for u in idx], dtype=torch.int64, device=self.device),
                                 torch.tensor([rk[u] for u in idx], dtype=torch.int64, device=self.device)))

    def memory_bytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    # ------------------------------------------------------------------ proposal
    def expand(self, roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the template under every root token, one gather per template depth.

        Args:
            roots: ``int64[B]`` root tokens.
        Returns:
            ``(tokens int64[B, T], valid bool[B, T])``; a slot is invalid when its table entry (or an
            ancestor's) is empty. Parents are `t_parent` (shared by all rows).
        """
        b = roots.shape[0]
        v, k = self.vocab_size, self.k
        root = roots.to(self.device, torch.int64).reshape(b, 1)
        root = torch.where((root < 0) | (root >= v), v, root)
        flat = self.table.view(-1)
        toks = torch.full((b, self.size), -1, dtype=torch.int64, device=self.device)
        for d, (idx, par, rk) in enumerate(self._levels):
            if d == 0:
                ptok = root.expand(b, idx.numel())
            else:
                pt = toks[:, par]
                ptok = torch.where(pt < 0, v, pt)
            toks[:, idx] = flat[ptok * k + rk].to(torch.int64)   # rows of empty parents are -1
        return toks.clamp(min=0), toks >= 0

    # ------------------------------------------------------------------ updates
    def _last_writer(self, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``rows`` with every entry but the last occurrence of each row (and invalid entries)
        redirected to the dump row V + 1 (a stable sort; no host read)."""
        m = rows.shape[0]
        dump = self.vocab_size + 1
        key = torch.where(valid, rows, dump) * (m + 1) + torch.arange(m, device=rows.device)
        order = torch.argsort(key)
        srt = torch.where(valid, rows, dump)[order]
        last = torch.cat([srt[1:] != srt[:-1], torch.ones(1, dtype=torch.bool, device=rows.device)])
        out = torch.full_like(rows, dump)
        return out.scatter_(0, order, torch.where(last, srt, dump))

    def update(self, node_tokens: torch.Tensor, topk_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Overwrite the rows of verified nodes with the target's top-k (paper Eq. 12/14).

        Args:
            node_tokens: ``int64[M]`` tokens of the verified nodes.
            topk_ids: ``int64[M, k']`` the target's top-k after each of them, best first; k' > k is
                truncated, k' < k leaves the remaining ranks at -1.
            valid: ``bool[M]`` nodes to learn from (non-padding, in-vocabulary).
        """
        toks = node_tokens.reshape(-1).to(self.device, torch.int64)
        ok = valid.reshape(-1).to(self.device) & (toks >= 0) & (toks < self.vocab_size)
        rows = self._last_writer(toks.clamp(0, self.vocab_size), ok)
        new = torch.full((toks.shape[0], self.k), -1, dtype=torch.int32, device=self.device)
        kk = min(self.k, topk_ids.shape[-1])
        new[:, :kk] = topk_ids.reshape(toks.shape[0], -1)[:, :kk].to(torch.int32)
        self.table.index_copy_(0, rows, new)
        self.table[self.vocab_size].fill_(-1)  # the empty-parent row stays empty

    def warm_start(self, prev: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor) -> None:
        """Prompt bigrams ``(prev, nxt)``: where row ``prev`` is still empty, set its rank 0 to ``nxt``
        (the last bigram of a repeated ``prev`` wins). All ``[L]``."""
        a = prev.reshape(-1).to(self.device, torch.int64)
        b = nxt.reshape(-1).to(self.device, torch.int64)
        ok = valid.reshape(-1).to(self.device) & (a >= 0) & (a < self.vocab_size) & (b >= 0) & (b < self.vocab_size)
        a_safe = a.clamp(0, self.vocab_size - 1)
        ok = ok & (self.table[a_safe, 0] < 0)
        rows = self._last_writer(a_safe, ok)
        self.table[:, 0].index_copy_(0, rows, b.to(torch.int32))
        self.table[self.vocab_size].fill_(-1)
