"""Successor table (token recycling) as a device-resident retrieval source (paper Sec. 3.2, Eq. 9/12).

State: ``table int32[G, R + 2, k]``, one block of rows per isolation group (``retrieval.isolation``:
one group shared by all requests, or one per tenant, or one per request; `GraftPlanner` assigns
them). Row t of a group = the target's top-k next tokens the last time token t (t mod R when the
group has fewer rows R than the vocabulary: hashed, for per-request groups) was verified in that
group, -1 until then; row R stays all -1 (the row of an empty parent, so lookups need no masking);
row R + 1 absorbs writes that must not land anywhere (never read, reset to -1 after each update).

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

from ..kernels.successor import last_writer, successor_update, table_rows
from ..kernels.successor_part import expand_template
from ..kernels.views import SuccessorView

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
        groups: G isolation groups; rows: R rows per group (default V; fewer = hashed rows);
        device: where the table lives.
    Attributes:
        table: ``int32[G * (R + 2), k]`` (per group: rows R and R + 1, see the module docstring).
        t_parent, t_rank, t_depth: ``int64[T]`` template (parent slot -1 = root).
        slot_prior: ``float32[T]``.
    """

    name = "successor"

    def __init__(self, vocab_size: int, k: int = 8, max_depth: int = 8, size: int = 64, prior: float = 0.4,
                 decay: float = 0.5, groups: int = 1, rows: int | None = None, device: torch.device | str = "cpu"):
        if vocab_size < 2 or k < 1 or size < 1 or groups < 1:
            raise ValueError("SuccessorTable: vocab_size >= 2, k >= 1, size >= 1 and groups >= 1 required")
        self.vocab_size, self.k, self.device = vocab_size, k, torch.device(device)
        self.rows = min(rows or vocab_size, vocab_size)
        self.groups = groups
        self.table = torch.full((groups * (self.rows + 2), k), -1, dtype=torch.int32, device=self.device)
        par, rk, dep = rank_template(k, size, max_depth, prior, decay)
        self.size = len(par)
        self.t_parent = torch.tensor(par, dtype=torch.int64, device=self.device)
        self.t_rank = torch.tensor(rk, dtype=torch.int64, device=self.device)
        self.t_depth = torch.tensor(dep, dtype=torch.int64, device=self.device)
        self.slot_prior = torch.tensor(template_prior(par, rk, prior, decay), device=self.device)
        self.levels = max(dep)                      # the template's deepest level

    @property
    def view(self) -> SuccessorView:
        """The table and its template as the fused ops read them (`SuccessorView`)."""
        return SuccessorView(self.table, self.t_parent, self.t_rank, self.t_depth, self.rows, self.vocab_size,
                             self.levels)

    def memory_bytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def row_of(self, tokens: torch.Tensor, groups: torch.Tensor | int = 0) -> torch.Tensor:
        """Table row of ``tokens`` in ``groups`` (broadcast); invalid tokens and negative groups map to
        an empty row."""
        g = torch.as_tensor(groups, device=self.device).to(torch.int64) if not isinstance(groups, torch.Tensor) \
            else groups.to(torch.int64)
        return table_rows(tokens, g, self.rows, self.vocab_size)[0]

    def reset_group(self, group: int) -> None:
        """Forget everything a group learnt (a group reassigned to a new tenant / request)."""
        self.table.view(self.groups, self.rows + 2, self.k)[group].fill_(-1)

    def clear(self) -> None:
        """Forget every group's successors (SGLang's ``/flush_cache``), in place."""
        self.table.fill_(-1)

    # ------------------------------------------------------------------ proposal
    def expand(self, roots: torch.Tensor, groups: torch.Tensor | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the template under every root token, one gather per template depth.

        Args:
            roots: ``int64[B]`` root tokens; groups: ``int64[B]`` isolation group per row (or one int).
        Returns:
            ``(tokens int64[B, T], valid bool[B, T])``; a slot is invalid when its table entry (or an
            ancestor's) is empty. Parents are `t_parent` (shared by all rows).
        """
        b = roots.shape[0]
        g = groups.reshape(b, 1).to(torch.int64) if isinstance(groups, torch.Tensor) else groups
        return expand_template(roots.to(self.device), g, self.table, self.t_parent, self.t_rank, self.t_depth,
                               self.rows, self.vocab_size, self.levels)

    # ------------------------------------------------------------------ updates
    def _keep_empty_rows(self) -> None:
        self.table.view(self.groups, self.rows + 2, self.k)[:, self.rows:].fill_(-1)

    def update(self, node_tokens: torch.Tensor, topk_ids: torch.Tensor, valid: torch.Tensor,
               groups: torch.Tensor | int = 0, invalid: int = 0) -> None:
        """Overwrite the rows of verified nodes with the target's top-k (paper Eq. 12/14).

        Args:
            node_tokens: ``int64[B, N]`` tokens of the verified nodes, or ``int64[M]`` (M rows of one).
            topk_ids: ``int64[B * N, k']`` the target's top-k after each of them, best first; k' > k is
                truncated, k' < k leaves the remaining ranks at -1.
            valid: ``[B, N]`` (or ``[M]``): a node learns where ``valid != invalid`` (a ``bool`` mask of
                the nodes to learn from, or the nodes' sources with ``invalid`` = ``SOURCE_PADDING``);
                out-of-vocabulary tokens never learn.
            groups: ``int64[B]`` isolation group of each row's nodes (or one int).
            invalid: see ``valid``.
        """
        toks = node_tokens.to(self.device, torch.int64)
        if toks.dim() == 1:
            toks = toks[:, None]
        g = groups.reshape(-1).to(self.device, torch.int64) if isinstance(groups, torch.Tensor) \
            else torch.full_like(toks[:, 0], groups)
        successor_update(self.table, toks, topk_ids.reshape(toks.numel(), -1),
                         valid.reshape(toks.shape).to(self.device), g, self.rows, self.vocab_size, invalid)

    def warm_start(self, prev: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor,
                   groups: torch.Tensor | int = 0) -> None:
        """Prompt bigrams ``(prev, nxt)``: where row ``prev`` of the group is still empty, set its rank
        0 to ``nxt`` (the last bigram of a repeated ``prev`` wins). All ``[L]``."""
        a = prev.reshape(-1).to(self.device, torch.int64)
        b = nxt.reshape(-1).to(self.device, torch.int64)
        g = groups.reshape(-1).to(self.device, torch.int64) if isinstance(groups, torch.Tensor) else groups
        row, known = table_rows(a, g, self.rows, self.vocab_size)       # a negative group learns nothing
        ok = valid.reshape(-1).to(self.device) & known & (b >= 0) & (b < self.vocab_size)
        ok = ok & (self.table[row, 0] < 0)
        rows = last_writer(row, ok, self.rows + 1)          # group 0's dump row
        self.table[:, 0].index_copy_(0, rows, b.to(torch.int32))
        self._keep_empty_rows()
