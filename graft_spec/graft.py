"""Merge a pruned draft tree and retrieved candidates into exactly N nodes (paper Sec. 3.3).

Algorithm (batched, no per-node Python loop), per request:

1. Stack the draft tree ``[Nd]`` and the candidates ``[M]`` into one node list; a
   candidate with parent -1 hangs under the draft root (same root, no second root).
2. **Dedupe by path.** Every node gets a 64-bit hash of its root path (pointer jumping,
   ceil(log2 depth) gathers); nodes with equal hashes are the same path (groups found by
   bucket scatter, `canonical_nodes`, no sort), so a retrieved path
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
from .tree import (IDX_BITS, SOURCE_DRAFT, SOURCE_PADDING, SOURCE_RETRIEVED, DraftTree, jump_finished,
                   order_key, path_min, sentinel_parents, top_mask)

__all__ = ["path_hashes", "canonical_nodes", "graft"]

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
    b, u = tokens.shape
    p = sentinel_parents(parents)                                        # [B, U+1]
    s = tokens * _MIX + _ADD
    s = torch.cat([s ^ (s >> 31), torch.zeros(b, 1, dtype=s.dtype, device=s.device)], dim=1)
    pw = torch.full_like(s, _POW)
    pw[:, u] = 1                                                         # sentinel: empty segment
    for _ in range(_rounds(u + 1)):
        if jump_finished(p, u):
            break
        s = s.gather(1, p) * pw + s
        pw = pw.gather(1, p) * pw
        p = p.gather(1, p)
    return s[:, :u]


_BUCKET_BITS = 8
_DEDUPE_ROUNDS = 4


def canonical_nodes(h: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest index with the same hash, for every valid node (sort-free).

    Each round scatters the pending node indices into 2**8 buckets per row (a different
    slice of the hash bits per round) with ``amin``; a node whose bucket minimum has its
    own hash is resolved (that minimum is the lowest index of its hash group, since equal
    hashes always share a bucket, so a group resolves all at once or not at all). At
    U = 133 about a quarter of the nodes collide in round 1, ~7% of those in round 2 and
    so on; nodes still pending after 4 rounds (essentially never) are reported so the
    caller can drop them, which is always safe (fewer candidates). The bucket table is
    kept small (int32, 256 per row) on purpose: large fresh buffers cost page faults on
    CPU (a [64, 2048] int64 table took ~0.5 ms to fill).

    Args:
        h: ``int64[B, U]`` hashes; valid: ``bool[B, U]``.
    Returns:
        ``(canon int64[B, U], unresolved bool[B, U])``; invalid nodes map to themselves.
    """
    b, u = h.shape
    ar = torch.arange(u, device=h.device, dtype=torch.int32).expand(b, u)
    canon = ar.to(torch.int64)
    pending = valid.clone()
    nb = 1 << _BUCKET_BITS
    table = torch.full((b, nb), u, dtype=torch.int32, device=h.device)
    for r in range(_DEDUPE_ROUNDS):
        bucket = (h >> (r * 13 + 3)) & (nb - 1)
        idx = torch.where(pending, ar, u)
        table.scatter_reduce_(1, bucket, idx, reduce="amin", include_self=True)
        cand = table.gather(1, bucket).to(torch.int64).clamp(max=u - 1)
        ok = pending & (h.gather(1, cand) == h)
        canon = torch.where(ok, cand, canon)
        pending = pending & ~ok
        if r + 1 == _DEDUPE_ROUNDS or (h.device.type == "cpu" and not bool(pending.any())):
            break
        table.scatter_(1, bucket, u)  # reset only the touched buckets
    return canon, pending


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
    canon, unresolved = canonical_nodes(path_hashes(tok, par), valid)
    valid = valid & ~unresolved

    # the group's best member (highest priority, then lowest index) gives its priority,
    # source and logp: one scatter of the unique order key, decoded back to an index
    okey = order_key(key)
    best = torch.full_like(okey, torch.iinfo(torch.int64).min).scatter_reduce(
        1, canon, okey, reduce="amax", include_self=True)
    best_idx = ((1 << IDX_BITS) - 1 - (best & ((1 << IDX_BITS) - 1))).clamp(0, u - 1)
    gkey = key.gather(1, best_idx)
    src = torch.where(best_idx < nd, SOURCE_DRAFT, SOURCE_RETRIEVED)
    glogp = torch.cat([dlogp, torch.log(score)], dim=1).gather(1, best_idx)

    unique = valid & (canon == ar)
    cpar = canon.gather(1, par.clamp(min=0))
    cpar[:, 0] = -1
    gkey = torch.where(unique, gkey, neg_inf)
    if policy.root_width is not None:
        kids = unique & (cpar == 0) & (src == SOURCE_RETRIEVED)
        kk = torch.where(kids, gkey, neg_inf)
        allowed = top_mask(order_key(kk), policy.root_width)
        gkey = torch.where(kids & ~allowed, neg_inf, gkey)
    # monotone along paths: drops subtrees of invalid / capped / non-unique parents and
    # makes "top N-1 with ties to the lower index" ancestor-closed
    gkey = path_min(gkey, cpar)

    # 4. fill N - 1 slots
    rest = gkey[:, 1:]
    sel = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev),
                     top_mask(order_key(rest), num_nodes - 1) & (rest > -math.inf)], dim=1)

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
    free = ~used[:, :w]
    slot = torch.where(free, torch.cumsum(free, dim=1) - 1, w)               # k-th free id -> slot k
    free_ids = torch.zeros(b, w + 1, dtype=torch.int64, device=dev)
    free_ids.scatter_(1, slot, torch.arange(w, device=dev).expand(b, w))
    pad_tok = free_ids.gather(1, (j - count).clamp(0, w - 1))
    out_tok = torch.where(is_pad, pad_tok, out_tok)
    out_par = torch.where(is_pad, 0, out_par)
    out_par[:, 0] = -1
    out_logp = torch.where(is_pad, neg_inf, out_logp)
    out_logp[:, 0] = 0.0
    out_src = torch.where(is_pad, SOURCE_PADDING, out_src)
    out_src[:, 0] = SOURCE_DRAFT
    return DraftTree(out_tok, out_par, out_logp, out_src)
