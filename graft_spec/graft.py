"""Merge draft and retrieved candidates into exactly N nodes (paper Sec. 3.3, Algorithm 2).

`merge_select` works on one stacked candidate list per request (draft nodes first, root at index 0,
then the successor template, then the host proposals), batched, with fixed iteration counts:

1. **Dedupe by path.** Every node gets a 64-bit hash of its root path (pointer jumping,
   ceil(log2 U) gathers); nodes with equal hashes are the same path (groups found by bucket
   scatter, `canonical_nodes`, no sort), so a retrieved path "hangs under the deepest existing node
   whose path is its prefix" automatically: its prefix merges into the existing nodes and only the
   new suffix is added. The lowest index of a group is kept (draft nodes come first), children are
   re-pointed to it, so sibling tokens are distinct. A (2**-64-unlikely) hash collision can only
   merge two paths, never duplicate one: the tree stays a tree of deterministic candidates with
   distinct siblings, so verification stays lossless; only efficiency would suffer.
2. **Priority.** A merged group takes its members' best key (and, for reporting, the source and
   estimate of that member); every member's calibration bin is kept per member source, so each
   source that proposed a verified node is credited (calibration.py). A group with a draft member
   and a retrieval member is an *agreement* node: with ``agreement`` given, its estimate and key are
   raised to its agreement bin's estimate (the draft bin's axes, member ``agree``), which is
   credited instead of the draft bin. Keys are made non-increasing along paths (`path_min`).
3. **Fill.** Keep the N - 1 best non-root nodes (ties: lower index). With keys = estimated path
   acceptance this maximises the expected accepted length (calibration.py); monotone keys plus the
   index tie-break keep the selection ancestor-closed.
4. **Compact** in stacked order (topological: every parent, after re-pointing, has a smaller
   index) and **pad** the rest: padding nodes are children of the root with the smallest token ids
   not used by the root's real children (0, 1, ...), so even padding keeps siblings distinct;
   ``source = SOURCE_PADDING``, ``logp = -inf``. A real node's source is its best member's, or
   ``SOURCE_AGREE`` for an agreement node (graft_spec/sources.py).

No host reads and no data-dependent shapes: the same code runs eagerly on CPU, on an accelerator,
on ``meta`` tensors and under ``torch.compile(fullgraph=True)`` (tests/test_core_step.py).
On a CUDA device (and inside `kernels.fused_ops_everywhere`) `merge_select` is one fused op,
``graft::merge_select`` (graft_spec/kernels/select.py); this torch code, `merge_select_reference`,
is its CPU implementation and the reference it equals bit for bit.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .calibration import from_fixed, to_fixed
from .candidates import Candidates
from .config import GraftPolicy
from .kernels.select import select_fused
from .sources import NUM_MEMBERS, SOURCE_AGREE, SOURCE_DRAFT, SOURCE_PADDING, SOURCE_SUCCESSOR
from .tree import HASH_ADD, HASH_MIX, HASH_POW, IDX_BITS, DraftTree, pointer_jumps, order_key, path_min, top_mask

__all__ = ["path_hashes", "canonical_nodes", "sibling_caps", "merge_select", "merge_select_reference"]



def path_hashes(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """64-bit polynomial hash of every node's root path (root token included).

    Pointer jumping over segment hashes: ``H(A + B) = H(A) * P**len(B) + H(B)`` (int64
    arithmetic wraps), ceil(log2(U + 1)) rounds.

    Args:
        tokens, parents: ``int64[B, U]`` (parents -1 for the root, parent < child).
    Returns:
        ``int64[B, U]``; equal paths always give equal hashes.
    """
    b, u = tokens.shape
    s = tokens * HASH_MIX + HASH_ADD
    s = torch.cat([s ^ (s >> 31), torch.zeros(b, 1, dtype=s.dtype, device=s.device)], dim=1)
    pw = torch.full_like(s, HASH_POW)
    pw[:, u].fill_(1)                                                         # sentinel: empty segment
    for p in pointer_jumps(parents):
        s = s.gather(1, p) * pw + s
        pw = pw.gather(1, p) * pw
    return s[:, :u]


_BUCKET_BITS = 8
_DEDUPE_ROUNDS = 4


def canonical_nodes(h: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest index with the same hash, for every valid node (sort-free, 4 fixed rounds).

    Each round scatters the pending node indices into 2**8 buckets per row (a different slice of
    the hash bits per round) with ``amin``; a node whose bucket minimum has its own hash is resolved
    (that minimum is the lowest index of its hash group, since equal hashes always share a bucket,
    so a group resolves all at once or not at all). At U = 183 about a fifth of the nodes collide in
    round 1, a few percent of those in round 2 and so on; nodes still pending after 4 rounds
    (essentially never) are reported so the caller can drop them, which is always safe (fewer
    candidates). The bucket table is kept small (int32, 256 per row) on purpose: large fresh
    buffers cost page faults on CPU.

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
    for r in range(_DEDUPE_ROUNDS):
        bucket = (h >> (r * 13 + 3)) & (nb - 1)
        idx = torch.where(pending, ar, u)
        table = torch.full((b, nb), u, dtype=torch.int32, device=h.device)
        table.scatter_reduce_(1, bucket, idx, reduce="amin", include_self=True)
        cand = table.gather(1, bucket).to(torch.int64).clamp(max=u - 1)
        ok = pending & (h.gather(1, cand) == h)
        canon = torch.where(ok, cand, canon)
        pending = pending & ~ok
    return canon, pending


def sibling_caps(est: torch.Tensor, key: torch.Tensor, parents: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Upper bound on each node's path acceptance from its higher-ranked siblings.

    Siblings are mutually exclusive (at most one child of a node lies on the accepted path), so
    ``P(i) <= P(parent) - sum of P(j)`` over the siblings ``j`` ranked above ``i``. The estimates of
    different sources are calibrated one source at a time, each blind to the others' proposals: where
    the draft and a retrieval source disagree under one parent, their marginal estimates can sum to
    more than the parent's, and without this bound the selection would spend slots on both instead
    of going deeper on the likelier one. Sort-based (two stable sorts and a segmented prefix sum,
    O(U log U), static shapes); the prefix sum is taken in 2**-32 fixed point (`to_fixed`), exact in
    any order, so a parallel scan (the fused kernel's) gives the same caps bit for bit.

    Args:
        est: ``float32[B, U]`` estimated path acceptance (the parent's is the bound's base; the
            root's parent is the root itself, estimate 1).
        key: ``float32[B, U]`` selection priority: the rank among siblings (ties: lower index first).
        parents: ``int64[B, U]`` parent index (< own index), -1 for the root.
        live: ``bool[B, U]`` nodes that count (dead ones neither take nor leave mass).
    Returns:
        ``float32[B, U]`` the cap, >= 0; +inf for the root.
    """
    b, u = est.shape
    dev = est.device
    e = torch.where(live, est.float(), 0.0)
    par = parents.clamp(min=0)
    par = torch.where(torch.arange(u, device=dev) == 0, -1, par)       # the root sorts first
    by_key = torch.argsort(order_key(key), dim=1, descending=True, stable=True)
    order = by_key.gather(1, torch.argsort(par.gather(1, by_key), dim=1, stable=True))
    ps, es = par.gather(1, order), to_fixed(e.clamp(min=0.0)).gather(1, order)
    before = torch.cumsum(es, dim=1) - es                          # mass sorted earlier (fixed point: exact)
    ar = torch.arange(u, device=dev).expand(b, u)
    head = torch.ones_like(ps, dtype=torch.bool)
    head[:, 1:] = ps[:, 1:] != ps[:, :-1]
    start = torch.cummax(torch.where(head, ar, 0), dim=1).values   # first sorted slot of the sibling group
    above = from_fixed(torch.empty_like(before).scatter_(1, order, before - before.gather(1, start)))
    base = torch.where(parents < 0, 1.0, est.float().gather(1, parents.clamp(min=0)))
    cap = (base - above).clamp(min=0.0)
    cap[:, 0].fill_(math.inf)
    return cap


def merge_select(cands: Candidates, num_nodes: int, policy: Optional[GraftPolicy] = None,
                 gain_nodes: Optional[int] = None, sampled: Optional[torch.Tensor] = None,
                 agreement: Optional[tuple] = None) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
    """Build the hybrid tree from a stacked candidate list (see module docstring).

    Args:
        cands: the stacked `Candidates` ``[B, U]`` (`Candidates.stack`): index 0 is the root (the
            last verified token, parent -1), every other parent is an index below the node's own;
            ``priority`` (``key`` or ``est``) is the selection key (+inf = always keep), ``est`` the
            estimated path acceptance reported as the node's ``logp``; a node whose parent is not
            ``valid`` is dropped with it (the root is always valid); ``member`` and ``bins`` are
            each candidate's member source and calibration bin (the root's are ignored).
        num_nodes: N >= 2, root included.
        policy: ``min_score`` (drop nodes whose estimate is below it, unless their key is +inf) and
            ``root_width`` (at most this many new retrieved children of the root).
        gain_nodes: length + 1 of the gain curve (default ``num_nodes``): the curve prices trees of
            every width up to ``gain_nodes`` from the same candidates (the batch budget, budget.py).
        sampled: ``bool[B]`` rows verified by sampling (None: all greedy); with
            ``policy.exclusive_siblings == "greedy"`` only the other rows get `sibling_caps`.
        agreement: ``(offset, estimates[, rows])``: the agreement bin of a node is its draft bin +
            ``offset`` (``BinLayout.offset(SOURCE_AGREE)``), priced from the ``float32`` table
            ``estimates`` (`Calibrator.table`), on the rows of ``bool[B]`` ``rows`` (None or
            absent: every row); None and the other rows: agreement nodes are priced by their best
            member and credit the draft bin (calibration.py).
    Returns:
        ``(tree, member_bins, gain)``: ``gain`` ``float32[B, gain_nodes - 1]``, ``gain[:, k]`` = sum
        of the estimates of the k + 1 best non-root nodes (the selection order; every prefix of it is
        ancestor-closed), so a tree of w nodes is expected to accept ``1 + gain[:, w - 2]`` tokens; `DraftTree` ``[B, N]`` (topological, distinct siblings, padding only
        after the real nodes, ``logp`` = log of the estimate, source: the best member's, ``SOURCE_AGREE`` for an
        agreement node, ``SOURCE_PADDING`` for padding) and ``int64[B, N, NUM_MEMBERS]`` the bin of every member of every node (-1 none;
        the root and padding have none).
    Raises:
        ValueError: ``num_nodes < 2``.
    """
    if num_nodes < 2:
        raise ValueError(f"merge_select: num_nodes={num_nodes} must be >= 2")
    policy = policy if policy is not None else GraftPolicy()
    offset, table, rows = 0, None, None
    if agreement is not None:
        offset, table, *rest = agreement
        rows = rest[0] if rest else None
    args = (cands.tokens, cands.parents, cands.priority, cands.est, cands.valid, cands.member, cands.bins,
            num_nodes, gain_nodes or num_nodes, float(policy.min_score), policy.root_width,
            policy.exclusive_siblings, sampled, int(offset), table, rows)
    run = torch.ops.graft.merge_select if select_fused(cands.tokens) else merge_select_reference
    tokens, parents, logp, source, member_bins, gain = run(*args)
    return DraftTree(tokens, parents, logp, source), member_bins, gain


def merge_select_reference(tokens: torch.Tensor, parents: torch.Tensor, key: torch.Tensor, est: torch.Tensor,
                           valid: torch.Tensor, member: torch.Tensor, bins: torch.Tensor, num_nodes: int,
                           gain_nodes: int, min_score: float, root_width: Optional[int], exclusive_siblings: str,
                           sampled: Optional[torch.Tensor], agree_offset: int, agree_table: Optional[torch.Tensor],
                           agree_rows: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, ...]:
    """`merge_select` in torch over its arguments flattened (the schema of the op
    ``graft::merge_select``, graft_spec/kernels/select.py, whose CPU implementation this is).

    Args:
        tokens, parents, key, est, valid, member, bins: the `Candidates` fields ``[B, U]`` (``key`` =
            ``priority``).
        num_nodes, gain_nodes: N and the gain curve's length + 1 (resolved, >= 1).
        min_score, root_width, exclusive_siblings: the `GraftPolicy` fields.
        sampled: ``bool[B]`` or None.
        agree_offset, agree_table, agree_rows: the ``agreement`` tuple (``agree_table`` None: no
            agreement; ``agree_rows`` None: every row).
    Returns:
        ``(tokens int64[B, N], parents int64[B, N], logp float32[B, N], source [B, N],
        member_bins int64[B, N, NUM_MEMBERS], gain float32[B, gain_nodes - 1])``.
    """
    b, u = tokens.shape
    dev = tokens.device
    neg_inf = torch.full((), -math.inf, device=dev)
    ar = torch.arange(u, device=dev)
    valid = valid.clone()
    valid[:, 0].fill_(True)
    key = torch.where(valid, key.float(), neg_inf)
    if min_score > 0:  # nodes that are always kept (key +inf) are exempt
        key = torch.where((est >= min_score) | (key == math.inf), key, neg_inf)
    key[:, 0].fill_(math.inf)

    # 1. dedupe by path hash -> canonical member (lowest index of the group)
    canon, unresolved = canonical_nodes(path_hashes(tokens, parents), valid)
    valid = valid & ~unresolved

    # 2. the group's best member (highest key, then lowest index) gives its key, estimate and source
    okey = order_key(key)
    best = torch.full_like(okey, torch.iinfo(torch.int64).min).scatter_reduce(
        1, canon, torch.where(valid, okey, torch.iinfo(torch.int64).min), reduce="amax", include_self=True)
    best_idx = ((1 << IDX_BITS) - 1 - (best & ((1 << IDX_BITS) - 1))).clamp(0, u - 1)
    gkey = key.gather(1, best_idx)
    gest = est.float().gather(1, best_idx)
    src = member.gather(1, best_idx)                       # the best member's source (graft_spec/sources.py)
    retrieved_best = src != SOURCE_DRAFT
    # every member's bin, per member source, on its canonical node
    slot = canon * NUM_MEMBERS + member.clamp(0, NUM_MEMBERS - 1)
    mb = torch.full((b, u * NUM_MEMBERS), -1, dtype=torch.int64, device=dev).scatter_reduce_(
        1, slot, torch.where(valid & (bins >= 0), bins, -1), reduce="amax", include_self=True
    ).view(b, u, NUM_MEMBERS)
    if agree_table is not None:   # draft + retrieval on one node: its own bin, credited instead of the draft's
        drafted = mb[:, :, SOURCE_DRAFT]
        retrieved = (mb[:, :, SOURCE_SUCCESSOR:SOURCE_AGREE] >= 0).any(dim=2)   # any member but draft / agree
        agree = (drafted >= 0) & retrieved
        if agree_rows is not None:
            agree = agree & agree_rows[:, None]
        agree_bin = torch.where(agree, drafted + agree_offset, -1)
        agree_est = torch.where(agree, agree_table.gather(0, agree_bin.clamp(min=0).reshape(-1)).view(b, u), 0.0)
        gest = torch.where(agree, torch.maximum(gest, agree_est), gest)
        gkey = torch.where(agree & (gkey < math.inf), torch.maximum(gkey, agree_est), gkey)
        drafted.copy_(torch.where(agree, -1, drafted))
        mb[:, :, SOURCE_AGREE].copy_(agree_bin)
        src = torch.where(agree, SOURCE_AGREE, src)

    unique = valid & (canon == ar)
    cpar = canon.gather(1, parents.clamp(min=0))
    cpar[:, 0].fill_(-1)
    gkey = torch.where(unique, gkey, neg_inf)
    if root_width is not None:
        kids = unique & (cpar == 0) & retrieved_best
        allowed = top_mask(order_key(torch.where(kids, gkey, neg_inf)), root_width)
        gkey = torch.where(kids & ~allowed, neg_inf, gkey)
    # monotone along paths: drops subtrees of invalid / capped / non-unique parents and makes
    # "top N-1 with ties to the lower index" ancestor-closed
    cjumps = pointer_jumps(cpar)   # shared by both reductions over the canonical tree
    gkey = path_min(gkey, cpar, cjumps)
    if exclusive_siblings != "never":  # siblings share their parent's mass (`sibling_caps`)
        cap = sibling_caps(gest, gkey, cpar, gkey > -math.inf)
        capped_est, capped_key = path_min(torch.stack([torch.minimum(gest.float(), cap),
                                                       torch.where(gkey == math.inf, gkey, torch.minimum(gkey, cap))]),
                                          cpar, cjumps).unbind(0)
        if exclusive_siblings == "greedy" and sampled is not None:  # sampled rows keep theirs
            capped_est = torch.where(sampled.reshape(b, 1), gest.float(), capped_est)
            capped_key = torch.where(sampled.reshape(b, 1), gkey, capped_key)
        gest, gkey = capped_est, capped_key

    # 3. fill N - 1 slots; the gain curve prices every width from the same order
    rest = gkey[:, 1:]
    g = gain_nodes - 1
    k = min(g, u - 1)
    rkey = order_key(rest)
    top_idx = torch.topk(rkey, k, dim=1).indices                               # sorted: best first
    ranked = torch.where(rest.gather(1, top_idx) > -math.inf, gest[:, 1:].gather(1, top_idx), 0.0)
    gain = from_fixed(torch.cumsum(to_fixed(ranked.clamp(min=0.0)), dim=1))   # exact, in any order
    if k < g:  # fewer candidates than widths: wider trees add padding only
        last = gain[:, -1:] if k > 0 else torch.zeros(b, 1, device=dev)
        gain = torch.cat([gain, last.expand(b, g - k)], dim=1)
    kn = min(num_nodes - 1, u - 1)
    if kn <= k:   # the tree's N - 1 are the first of the ranked candidates: no second top-k
        chosen = torch.zeros_like(rest, dtype=torch.bool).scatter_(1, top_idx[:, :kn], True)
    else:
        chosen = top_mask(rkey, num_nodes - 1)
    sel = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), chosen & (rest > -math.inf)], dim=1)

    # 4. compact + pad
    newidx = torch.cumsum(sel, dim=1) - 1
    count = sel.sum(dim=1, keepdim=True)
    dest = torch.where(sel, newidx, num_nodes)
    npar = torch.where(ar == 0, -1, newidx.gather(1, cpar.clamp(min=0)))

    def put(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((b, num_nodes + 1), fill, dtype=values.dtype, device=dev)
        return out.scatter_(1, dest, values)[:, :num_nodes]

    out_tok = put(tokens, 0)
    out_par = put(npar, 0)
    out_logp = put(torch.log(gest.clamp(min=0.0)), -math.inf)
    out_src = put(src, SOURCE_PADDING)
    # the bins by whole rows (a [B, U, 7] scatter with an expanded index is slow on CPU)
    rows = (dest + torch.arange(0, b * (num_nodes + 1), num_nodes + 1, device=dev)[:, None]).reshape(-1)
    out_bins = torch.full((b * (num_nodes + 1), NUM_MEMBERS), -1, dtype=torch.int64, device=dev).index_copy_(
        0, rows, mb.reshape(b * u, NUM_MEMBERS)).view(b, num_nodes + 1, NUM_MEMBERS)[:, :num_nodes]

    j = torch.arange(num_nodes, device=dev)[None, :]
    is_pad = j >= count
    w = num_nodes
    rootkid = (out_par == 0) & ~is_pad
    rootkid[:, 0].fill_(False)
    used = torch.zeros(b, w + 1, dtype=torch.bool, device=dev)
    used.scatter_(1, torch.where(rootkid, out_tok.clamp(max=w), w), True)
    free = ~used[:, :w]
    fslot = torch.where(free, torch.cumsum(free, dim=1) - 1, w)              # k-th free id -> slot k
    free_ids = torch.zeros(b, w + 1, dtype=torch.int64, device=dev)
    free_ids.scatter_(1, fslot, torch.arange(w, device=dev).expand(b, w))
    pad_tok = free_ids.gather(1, (j - count).clamp(0, w - 1))
    out_tok = torch.where(is_pad, pad_tok, out_tok)
    out_par = torch.where(is_pad, 0, out_par)
    out_par[:, 0].fill_(-1)
    out_logp = torch.where(is_pad, neg_inf, out_logp)
    out_logp[:, 0].fill_(0.0)
    out_src = torch.where(is_pad, SOURCE_PADDING, out_src)
    out_src[:, 0].fill_(SOURCE_DRAFT)
    out_bins = torch.where(is_pad[:, :, None], -1, out_bins)
    out_bins[:, 0].fill_(-1)
    return out_tok, out_par, out_logp, out_src, out_bins, gain
