"""Successor matrix (token recycling) as a retrieval source (paper Sec. 3.2, Eq. 9/12).

State: ``table int32[V, k]`` with ``table[t]`` = the target's top-k next tokens the last
time token t was verified, -1 until then. After every verify step the engine passes the
target's top-k at *every* verified node, accepted or rejected (`SuccessorMatrix.update`);
one batched index_put, no Python loop.

Proposal: from the root token, a fixed rank template is expanded one depth at a time
(one gather per depth): template node u with parent slot p and rank r gets token
``table[token(p), r]``. The template is the best-first enumeration of the k-ary tree under
the prior edge weights ``prior * decay**r``, so the rank-0 chain runs deepest and the
shape is unbalanced like Token Recycling's static template (Luowaterbi/TokenRecycling).

Scores: per-rank hit rates are tracked online (did the target's top-1 at a verified node
equal the old ``table[token, r]``?) and a node's score is the product of the estimated
hit rates along its template path, i.e. an estimate of its path acceptance probability.
The ranking the graft uses therefore adapts; the template only bounds the candidates.
"""

from __future__ import annotations

import heapq
import math
from typing import Hashable, Sequence

import torch

from .base import Candidates, RetrievalSource

__all__ = ["SuccessorMatrix", "rank_template"]

_PSEUDO = 16.0  # pseudo-count weight of the prior in the online hit-rate estimate


def rank_template(k: int, size: int, max_depth: int, prior: float, decay: float
                  ) -> tuple[list[int], list[int], list[int]]:
    """Best-first rank template.

    Args:
        k: successor width; size: number of template nodes; max_depth: deepest level.
        prior, decay: edge weight of rank r is ``prior * decay**r``.
    Returns:
        ``(parent_slot, rank, depth)`` lists of length <= size in best-first order
        (topological: a parent slot precedes its children); parent_slot -1 = root.
    """
    logw = [math.log(prior) + r * math.log(decay) for r in range(k)]
    parent, rank, depth = [], [], []
    # heap entries: (-log score, tie, parent_slot, rank, depth, parent_logscore)
    heap = [(-logw[0], 0, -1, 0, 1, 0.0)]
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


class SuccessorMatrix(RetrievalSource):
    """Shared ``[V, k]`` successor table; see module docstring.

    Args:
        vocab_size: V; k: successor width; max_depth: template depth cap;
        prior, decay: template prior (also the hit-rate prior);
        template_size: template nodes (candidates per request, before dedupe);
        device: where the table lives (the engine's device).
    """

    name = "successor"

    def __init__(self, vocab_size: int, k: int = 8, max_depth: int = 8, prior: float = 0.4,
                 decay: float = 0.5, template_size: int = 64, device: torch.device | str = "cpu"):
        if vocab_size < 2 or k < 1 or template_size < 1:
            raise ValueError("SuccessorMatrix: vocab_size >= 2, k >= 1, template_size >= 1 required")
        self.vocab_size, self.k, self.device = vocab_size, k, torch.device(device)
        # one extra all -1 row (index V) so lookups from an empty parent need no masking
        self._table = torch.full((vocab_size + 1, k), -1, dtype=torch.int32, device=self.device)
        self.table = self._table[:vocab_size]  #: ``int32[V, k]`` view, -1 = empty
        self.prior_rates = torch.tensor([prior * decay ** r for r in range(k)], device=self.device)
        self.hits = torch.zeros(k, device=self.device)
        self.trials = torch.zeros(k, device=self.device)
        par, rk, dep = rank_template(k, template_size, max_depth, prior, decay)
        self.t_parent = torch.tensor(par, dtype=torch.int64, device=self.device)
        self.t_rank = torch.tensor(rk, dtype=torch.int64, device=self.device)
        self.t_depth = torch.tensor(dep, dtype=torch.int64, device=self.device)
        t = len(par)
        counts = torch.zeros(t, k, device=self.device)  # rank-r edges on each template path
        for u in range(t):
            if par[u] >= 0:
                counts[u] = counts[par[u]]
            counts[u, rk[u]] += 1
        self.t_counts = counts
        self._levels: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._live: set[Hashable] = set()

    # ------------------------------------------------------------------ state
    def rates(self) -> torch.Tensor:
        """``float32[k]`` estimated P(target top-1 == table[t, r]) per rank r."""
        return (self.hits + self.prior_rates * _PSEUDO) / (self.trials + _PSEUDO)

    def update(self, node_tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Overwrite rows of the verified nodes with the target's top-k (Eq. 12/14).

        Args:
            node_tokens: ``int64[M]`` tokens of verified nodes (negative ids are skipped).
            topk_ids: ``int64[M, k']`` target top-k token ids at those nodes, best first;
                k' > k is truncated, k' < k leaves the remaining ranks at -1.
        """
        node_tokens = node_tokens.reshape(-1).to(self.device)
        topk_ids = topk_ids.reshape(node_tokens.shape[0], -1).to(self.device)
        ok = (node_tokens >= 0) & (node_tokens < self.vocab_size)
        rows = node_tokens[ok]
        new = torch.full((rows.shape[0], self.k), -1, dtype=torch.int32, device=self.device)
        kk = min(self.k, topk_ids.shape[1])
        new[:, :kk] = topk_ids[ok][:, :kk].to(torch.int32)
        old = self.table[rows]
        had = old >= 0
        self.hits += ((old == new[:, :1]) & had).sum(dim=0).float()
        self.trials += had.sum(dim=0).float()
        self.table[rows] = new

    def start(self, req_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """Warm start: for prompt bigrams (a, b) whose row a is still empty, set rank 0 to b."""
        self._live.add(req_id)
        if len(prompt_ids) < 2:
            return
        p = torch.as_tensor(list(prompt_ids), dtype=torch.int64, device=self.device)
        a, nxt = p[:-1], p[1:]
        ok = (a >= 0) & (a < self.vocab_size) & (nxt >= 0)
        a, nxt = a[ok], nxt[ok]
        empty = self.table[a, 0] < 0
        self.table[a[empty], 0] = nxt[empty].to(torch.int32)

    def stop(self, req_id: Hashable) -> None:
        self._live.discard(req_id)

    def live_requests(self) -> int:
        return len(self._live)

    def memory_bytes(self) -> int:
        return self._table.numel() * self._table.element_size() + self.t_counts.numel() * 4

    # ------------------------------------------------------------------ proposal
    def _level_plan(self, size: int):
        plan = self._levels.get(size)
        if plan is None:
            plan = []
            dep = self.t_depth[:size]
            for d in range(1, int(dep.max().item()) + 1):
                idx = torch.nonzero(dep == d).flatten()
                plan.append((idx, self.t_parent[idx], self.t_rank[idx]))
            self._levels[size] = plan
        return plan

    def propose(self, req_ids: Sequence[Hashable], root_tokens: torch.Tensor, budget: int) -> Candidates:
        """Expand the template from every root token; one gather per template depth.

        Returns `Candidates` ``[B, min(budget, template size)]``; nodes whose table entry
        (or an ancestor's) is empty are invalid.
        """
        b = root_tokens.shape[0]
        size = min(budget, self.t_parent.shape[0])
        if size <= 0:
            return Candidates.empty(b, self.device)
        v, k = self.vocab_size, self.k
        root = root_tokens.to(self.device, torch.int64).reshape(b, 1)
        root = torch.where((root < 0) | (root >= v), v, root)
        flat = self._table.view(-1)
        toks = torch.full((b, size), -1, dtype=torch.int64, device=self.device)
        for d, (idx, par, rk) in enumerate(self._level_plan(size)):
            ptok = root if d == 0 else torch.where(toks[:, par] < 0, v, toks[:, par])
            toks[:, idx] = flat[ptok * k + rk].to(torch.int64)   # rows of empty parents are -1
        valid = toks >= 0
        score = torch.exp(self.t_counts[:size] @ torch.log(self.rates()))
        return Candidates(tokens=toks.clamp(min=0), parents=self.t_parent[:size].expand(b, size),
                          score=score.expand(b, size), valid=valid)
