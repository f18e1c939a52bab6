"""Merge a pruned draft tree and retrieved candidates into exactly N nodes (paper Sec. 3.3).

Algorithm (batched, no per-node Python loop), per request:

1. Stack the draft tree ``[Nd]`` and the candidates ``[M]`` into one node list; a
   candidate with parent -1 hangs under the draft root (same root, no second root).
2. **Dedupe by path.** Every node gets a 64-bit hash of its root path (pointer jumping,
   ceil(log2 U) gathers); nodes with equal hashes are the same path, so a retrieved path
   "hangs under the deepest existing node whose path is its prefix" automatically: its
   prefix merges into the existing nodes and only the new suffix is added. The lowest
   index of a group is kept (kept draft nodes come first), children are re-pointed to it,
   so sibling tokens are distinct. A (2**-64-unlikely) hash collision can only merge two
   paths, never duplicate one: the tree is still a tree of deterministic candidates with
   distinct siblings, so verification stays lossless; only efficiency would suffer.
3. **Priority.** Kept draft nodes: +inf (always in). Retrieved nodes: estimated path
   acceptance probability (product of per-edge estimates). Pruned draft nodes (when
   ``refill_with_draft``): ``logp - 1`` (below every retrieved node, ordered by draft
   score). A merged group takes its members' best priority. Priorities are made monotone
   along paths (`path_min`).
4. **Fill.** Keep the N - 1 best non-root nodes (ties: lower index). Because the expected
   number of accepted tokens equals the sum over nodes of P(node on the accepted path)
   (siblings are distinct, so these events are disjoint per depth), taking the nodes
   with the largest path-acceptance estimates maximises the estimated gain; monotone
   priorities + index tie-break keep the selection ancestor-closed.
5. **Compact** in the stacked order (topological: every parent, after re-pointing, has a
   smaller index) and **pad** the rest: padding nodes are children of the root with the
   smallest token ids not used by the root's real children (0, 1, ...), so even padding
   keeps siblings distinct; ``source = SOURCE_PADDING``, ``logp = -inf``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .config import GraftPolicy
from .retrieval.base import Candidates
from .tree import SOURCE_DRAFT, SOURCE_PADDING, SOURCE_RETRIEVED, DraftTree, path_min

__all__ = ["path_hashes", "graft"]

_MIX = -7046029254386353131        # 0x9E3779B97F4A7C15 as int64
_ADD = 0x632BE59BD9B4E019
_POW = 0x5851F42D4C957F2D         # odd 63-bit multiplier of the polynomial path hash


def _rounds(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 2))))


def path_hashes(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """64-bit polynomial hash of every node's root path (root token included).

    Pointer jumping over segment hashes: ``H(A + B) = H(A) * P**len(B) + H(B)`` (int64
    arithmetic wraps).

    Args:
        tokens, parents: ``int64[B, U]`` (parents -1 for the root, parent < child).
    Returns:
        ``int64[B, U]``; equal paths always give equal hashes.
    """
    s = tokens * _MIX + _ADD
    s = s ^ (s >> 31)
    pw = torch.full_like(tokens, _POW)
    p = parents.clone()
    for _ in range(_rounds(tokens.shape[1])):
        valid = p >= 0
        safe = p.clamp(min=0)
        s_new = torch.where(valid, s.gather(1, safe) * pw + s, s)
        pw_new = torch.where(valid, pw.gather(1, safe) * pw, pw)
        p = torch.where(valid, p.gather(1, safe), p)
        s, pw = s_new, pw_new
    return s


def _scatter_max(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(values, -math.inf)
    return out.scatter_reduce(1, index, values, reduce="amax", include_self=True)


def _rank_desc(key: torch.Tensor) -> torch.Tensor:
    """Rank of each entry when sorted by key descending, ties by lower index."""
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(key.shape[1], device=key.device).expand_as(order))
    return rank


def graft(draft: DraftTree, keep: torch.Tensor, cands: Optional[Candidates], num_nodes: int,
          policy: Optional[GraftPolicy] = None) -> DraftTree:
    """Build the hybrid tree (see module docstring).

    Args:
        draft: draft tree ``[B, Nd]`` (root = node 0; the root's token is the tree root).
        keep: ``bool[B, Nd]`` kept draft nodes (`PruneResult.keep`; ancestor-closed).
        cands: retrieved candidates ``[B, M]`` or None.
        num_nodes: output size N (>= 2), root included.
        policy: `GraftPolicy` (min_score, root_width, refill_with_draft).
    Returns:
        `DraftTree` ``[B, N]``: same root; topological; distinct siblings; sources
        draft / retrieved / padding; padding only after all real nodes.
    Raises:
        ValueError: num_nodes < 2 or mismatched batch sizes.
    """
    policy = policy or GraftPolicy()
    b, nd = draft.tokens.shape
    dev = draft.device
    if num_nodes < 2:
        raise ValueError(f"graft: num_nodes={num_nodes} must be >= 2")
    if cands is None:
        cands = Candidates.empty(b, dev)
    if cands.tokens.shape[0] != b or keep.shape != draft.tokens.shape:
        raise ValueError("graft: draft, keep and candidates must share the batch size")
    m = cands.width
    u = nd + m
    neg_inf = torch.full((), -math.inf, device=dev)
    ar = torch.arange(u, device=dev)

    # 1. stacked node list
    tok = torch.cat([draft.tokens, cands.tokens.to(dev)], dim=1)
    par = torch.cat([draft.parents, torch.where(cands.parents < 0, 0, cands.parents + nd).to(dev)], dim=1)
    dlogp = draft.logp.float()
    dvalid = (draft.source == SOURCE_DRAFT) & torch.isfinite(dlogp)
    dvalid[:, 0] = True
    valid = torch.cat([dvalid, cands.valid.to(dev)], dim=1)
    valid = path_min(valid.float(), par) > 0

    # 3a. member priorities
    score = cands.score.to(dev).float().clamp(0.0, 1.0)
    rkey = torch.where(score >= policy.min_score, score, neg_inf)
    if policy.refill_with_draft:
        dkey = torch.where(keep, math.inf, dlogp - 1.0)
    else:
        dkey = torch.where(keep, math.inf, neg_inf)
    dkey[:, 0] = math.inf
    key = torch.where(valid, torch.cat([dkey, rkey], dim=1), neg_inf)

    # 2. dedupe by path hash -> canonical member (lowest index of the group)
    h = path_hashes(tok, par)
    h = torch.where(valid, h, (-(2 ** 62)) + ar)
    hs, order = torch.sort(h, dim=1, stable=True)
    start = torch.ones_like(hs, dtype=torch.bool)
    start[:, 1:] = hs[:, 1:] != hs[:, :-1]
    first_pos = torch.cummax(torch.where(start, ar, 0), dim=1).values
    canon = torch.empty_like(order).scatter_(1, order, order.gather(1, first_pos))
    canon = torch.where(valid & valid.gather(1, canon), canon, ar)

    is_draft = (ar < nd)[None, :]
    gkey = _scatter_max(canon, key)
    gd = _scatter_max(canon, torch.where(is_draft, key, neg_inf))
    gr = _scatter_max(canon, torch.where(is_draft, neg_inf, key))
    src = torch.where(gd >= gr, SOURCE_DRAFT, SOURCE_RETRIEVED)
    all_logp = torch.cat([dlogp, torch.log(score)], dim=1)
    glogp_d = _scatter_max(canon, torch.where(is_draft & valid, all_logp, neg_inf))
    glogp_r = _scatter_max(canon, torch.where(~is_draft & valid, all_logp, neg_inf))
    glogp = torch.where(src == SOURCE_DRAFT, glogp_d, glogp_r)

    unique = valid & (canon == ar)
    cpar = canon.gather(1, par.clamp(min=0))
    cpar[:, 0] = -1
    gkey = torch.where(unique, gkey, neg_inf)
    if policy.root_width is not None:
        kids = unique & (cpar == 0) & (src == SOURCE_RETRIEVED)
        rank = _rank_desc(torch.where(kids, gkey, neg_inf))
        gkey = torch.where(kids & (rank >= policy.root_width), neg_inf, gkey)
    gkey = path_min(gkey, cpar)

    # 4. fill N - 1 slots
    rank = _rank_desc(gkey[:, 1:])
    sel = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev),
                     (rank < num_nodes - 1) & (gkey[:, 1:] > -math.inf)], dim=1)

    # 5. compact + pad
    newidx = torch.cumsum(sel, dim=1) - 1
    count = sel.sum(dim=1, keepdim=True)
    dest = torch.where(sel, newidx, num_nodes)
    npar = torch.where(ar == 0, -1, newidx.gather(1, cpar.clamp(min=0)))

    def put(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((b, num_nodes + 1), fill, dtype=values.dtype, device=dev)
        return out.scatter_(1, dest, values)[:, :num_nodes]

    out_tok = put(tok, 0)
    out_par = put(npar, 0)
    out_logp = put(glogp, -math.inf)
    out_src = put(src, SOURCE_PADDING)

    j = torch.arange(num_nodes, device=dev)[None, :]
    is_pad = j >= count
    w = num_nodes
    rootkid = (out_par == 0) & ~is_pad
    rootkid[:, 0] = False
    used = torch.zeros(b, w + 1, dtype=torch.bool, device=dev)
    used.scatter_(1, torch.where(rootkid, out_tok.clamp(max=w), w), True)
    free_ids = torch.sort(used[:, :w].to(torch.int8), dim=1, stable=True).indices
    pad_tok = free_ids.gather(1, (j - count).clamp(0, w - 1))
    out_tok = torch.where(is_pad, pad_tok, out_tok)
    out_par = torch.where(is_pad, 0, out_par)
    out_par[:, 0] = -1
    out_logp = torch.where(is_pad, neg_inf, out_logp)
    out_logp[:, 0] = 0.0
    out_src = torch.where(is_pad, SOURCE_PADDING, out_src)
    out_src[:, 0] = SOURCE_DRAFT
    return DraftTree(out_tok, out_par, out_logp, out_src)
