"""The selection of a round's tree in one kernel: dedupe, priority, sibling caps, fill, compaction.

Reference: `merge_select_reference` (the torch code of `merge.merge_select` over ``[B, U]``
candidates). Fused: `_select_kernel`, one Triton program per request that holds the
row's U candidates as vectors:

- a gather ``x[idx]`` stores ``x`` into the row's scratch, syncs the program and loads at ``idx``,
  so the path hashes and `path_min` run the reference's pointer jumping round for round;
- a scatter-reduce by group (dedupe buckets, best member, member bins) is an atomic min / max into
  the row's scratch table (initialised in the kernel), one barrier, and a load: the reference's
  ``scatter_reduce``, exact in any order;
- a rank (the reference's stable sorts and top-k) is a position in one bitonic ``tl.sort`` (or
  ``tl.topk``) of int64 order keys whose low 20 bits carry the lane (`tree.order_key`), so the keys
  are distinct and the sort is the stable order: the lane at each position is read off the sorted
  key, no ``U x U`` comparison; the sibling order sorts (parent, key) packed into one int64 and finds
  each sibling group's start by an associative scan;
- the prefix sums (`sibling_caps`' and the gain curve's) are sums of estimates in 2**-32 fixed
  point (`calibration.to_fixed`), so they are exact in any order: one ``tl.cumsum`` over the row's
  lanes, no loop over candidates, equal to the reference's ``torch.cumsum`` bit for bit on any
  device;
- the tree's ``logp`` is the log of the estimate clamped at 0, taken in the kernel (``tl.log``: equal
  to the reference's ``torch.log`` within float32 rounding; every other output is bit for bit).

The op ``graft::merge_select`` takes `merge_select`'s arguments flattened (the policy fields, the
agreement tuple, optional tensors as ``Tensor?``); its CPU implementation is the reference and its
CUDA implementation the Triton kernel (`merge_select_op`, `registry.fused_op`); `merge.merge_select`
calls it.
"""

from __future__ import annotations

from typing import Optional

import math

import torch

from ..numerics import fixed
from ..sources import NUM_MEMBERS, SOURCE_AGREE, SOURCE_DRAFT, SOURCE_PADDING, SOURCE_SUCCESSOR
from ..tree import (HASH_ADD, HASH_MIX, HASH_POW, IDX_BITS, order_key, path_min, pointer_jumps, pointer_rounds,
                    top_mask)
from .dispatch import triton
from .registry import fused_op
from .views import Agreement, Candidates, SelectOptions

if triton is not None:
    import triton.language as tl

    from .common import from_fixed, to_fixed

__all__ = ["path_hashes", "canonical_nodes", "sibling_caps", "merge_select_reference", "select_triton",
           "merge_select_op"]

_CAPS = {"never": 0, "greedy": 1, "always": 2}
#: candidates per request the fused kernel takes (parent + 1 in 11 bits of the sibling sort key)
_MAX_CANDIDATES = 2048


#: ``(tokens, parents, logp, source, member_bins, gain)`` of `merge_select_reference`
_Out = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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
    ps, es = par.gather(1, order), fixed.to_fixed(e.clamp(min=0.0)).gather(1, order)
    before = torch.cumsum(es, dim=1) - es                          # mass sorted earlier (fixed point: exact)
    ar = torch.arange(u, device=dev).expand(b, u)
    head = torch.ones_like(ps, dtype=torch.bool)
    head[:, 1:] = ps[:, 1:] != ps[:, :-1]
    start = torch.cummax(torch.where(head, ar, 0), dim=1).values   # first sorted slot of the sibling group
    above = fixed.from_fixed(torch.empty_like(before).scatter_(1, order, before - before.gather(1, start)))
    base = torch.where(parents < 0, 1.0, est.float().gather(1, parents.clamp(min=0)))
    cap = (base - above).clamp(min=0.0)
    cap[:, 0].fill_(math.inf)
    return cap


def merge_select_reference(cands: Candidates, opts: SelectOptions, sampled: Optional[torch.Tensor],
                           agreement: Optional[Agreement]) -> _Out:
    """`merge_select` in torch over its arguments flattened (the schema of the op
    ``graft::merge_select``, graft_spec/kernels/select.py, whose CPU implementation this is).

    Args:
        cands: the stacked `Candidates` ``[B, U]`` (its ``priority`` is the selection key).
        opts: `SelectOptions` (``num_nodes`` N and ``gain_nodes`` resolved, >= 1; the `GraftPolicy`
            fields).
        sampled: ``bool[B]`` or None.
        agreement: the `Agreement` pricing, or None (no agreement; its ``rows`` None: every row; else
            the rows where ``rows`` is not ``invert``).
    Returns:
        ``(tokens int64[B, N], parents int64[B, N], logp float32[B, N], source [B, N],
        member_bins int64[B, N, NUM_MEMBERS], gain float32[B, gain_nodes - 1])``.
    """
    tokens, parents, key, est, valid, member, bins = (cands.tokens, cands.parents, cands.priority, cands.est,
                                                       cands.valid, cands.member, cands.bins)
    num_nodes, gain_nodes, min_score, root_width, exclusive_siblings = opts
    agree_offset, agree_table, agree_rows, agree_invert = agreement if agreement is not None else (0, None, None, False)
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
            agree = agree & (agree_rows != agree_invert)[:, None]
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
    gain = fixed.from_fixed(torch.cumsum(fixed.to_fixed(ranked.clamp(min=0.0)), dim=1))   # exact, in any order
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


if triton is not None:
    _DRAFT = tl.constexpr(SOURCE_DRAFT)
    _AGREE = tl.constexpr(SOURCE_AGREE)
    _PADDING = tl.constexpr(SOURCE_PADDING)
    _NM = tl.constexpr(NUM_MEMBERS)
    _MIX = tl.constexpr(HASH_MIX)
    _ADD = tl.constexpr(HASH_ADD)
    _POW = tl.constexpr(HASH_POW)
    _LOW = tl.constexpr(-9223372036854775807)   # below every order key

    @triton.jit
    def _order_key(v, lanes):
        """`tree.order_key`: larger value first, ties to the lower lane (NaN as -inf)."""
        v = tl.where(v != v, -float("inf"), v)
        bits = v.to(tl.int32, bitcast=True).to(tl.int64)
        mono = tl.where(bits < 0, -2147483648 - bits, bits)
        return mono * 1048576 + (1048575 - lanes.to(tl.int64))

    @triton.jit
    def _run_start(g1, v1, g2, v2):
        """Scan combine over runs of equal ``g`` in sorted order: the value at the start of the run."""
        return g2, tl.where(g1 == g2, v1, v2)

    @triton.jit
    def _element(x, lanes, i):
        """``x[i]`` of a block of int64 keys (``i`` a scalar; `_LOW` when out of range): one reduction."""
        return tl.max(tl.where(lanes == i, x, _LOW), axis=0)

    @triton.jit
    def _select_kernel(tok_ptr, par_ptr, key_ptr, est_ptr, valid_ptr, mem_ptr, bins_ptr,
                       sampled_ptr, table_ptr, rows_ptr, agree_offset, min_score, root_width,
                       out_tok, out_par, out_est, out_src, out_mb, out_gain, iscratch, fscratch, tscratch,
                       U: tl.constexpr, N: tl.constexpr, G: tl.constexpr, KN: tl.constexpr, KP: tl.constexpr,
                       ROUNDS: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, CAPS: tl.constexpr,
                       HAS_SAMPLED: tl.constexpr, HAS_AGREE: tl.constexpr, HAS_ROWS: tl.constexpr, INVERT: tl.constexpr,
                       MIN_SCORE: tl.constexpr, HAS_RW: tl.constexpr):
        """One request per program; the candidates in ``BLOCK`` >= U lanes (see the module docstring
        for the steps, which follow `merge_select_reference` line for line).

        Work per program, U candidates: the pointer-jumping steps (path hashes, `path_min`, once more
        with the sibling caps) O(U log U) in ``ROUNDS`` = ceil(log2(U + 1)) barriered rounds each; the
        scatter-reductions (4 dedupe rounds, the best member, the member bins) O(U) atomics, one
        barrier each; the ranks (root width, the caps' sibling order, the fill) one bitonic sort
        each, O(U log**2 U) (the fill a top-``KP``, O(U log**2 KP)); the prefix sums O(U) in one scan
        each; the padding O(N). About 3 * ROUNDS + 20 barriers in all."""
        b = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        live = lanes < U
        row = b * U + lanes
        # the row's scratch: a gather x[idx] stores x, syncs the program and loads at idx
        iw0 = iscratch + b * (14 * U)
        iw1 = iw0 + U
        jw0 = iw0 + 2 * U
        jw1 = iw0 + 3 * U
        jw2 = iw0 + 4 * U
        jw3 = iw0 + 5 * U
        best_t = iw0 + 6 * U              # the group's best order key, by canonical node
        mb_t = iw0 + 7 * U                # every member's bin [U, NUM_MEMBERS], by canonical node
        fw0 = fscratch + b * (2 * U)
        fw1 = fw0 + U
        dedupe_t = tscratch + b * (1024 + 2 * BN)     # int32: 4 dedupe rounds x 256 buckets
        used_t = dedupe_t + 1024          # the root's children's tokens below N
        free_t = used_t + BN              # the free tokens below N, in order
        mlanes = tl.arange(0, 8)
        q = tl.arange(0, BN)
        # the scatter tables' identities (read after the hash rounds' barriers)
        tl.store(dedupe_t + tl.arange(0, 1024), tl.full([1024], U, tl.int32))
        tl.store(best_t + lanes, tl.full([BLOCK], -4611686018427387904, tl.int64), mask=live)
        mb_at = mb_t + lanes[:, None] * _NM + mlanes[None, :]
        mb_in = live[:, None] & (mlanes[None, :] < _NM)
        tl.store(mb_at, tl.full([BLOCK, 8], -1, tl.int64), mask=mb_in)
        tl.store(used_t + q, tl.zeros([BN], tl.int32))
        inf = float("inf")
        tok = tl.load(tok_ptr + row, mask=live, other=0)
        par = tl.load(par_ptr + row, mask=live, other=-1)
        est = tl.load(est_ptr + row, mask=live, other=0.0)
        valid = (tl.load(valid_ptr + row, mask=live, other=0) != 0) | (lanes == 0)
        valid = valid & live
        key = tl.where(valid, tl.load(key_ptr + row, mask=live, other=0.0), -inf)
        if MIN_SCORE:
            key = tl.where((est >= min_score) | (key == inf), key, -inf)
        key = tl.where(lanes == 0, inf, key)

        # 1. path hashes (pointer jumping, U = past the root) and the canonical member of each group
        s = tok * _MIX + _ADD
        s = tl.where(live, s ^ (s >> 31), 0)
        # round k joins a node's segment to the one 2**k above it; where that exists the node's own
        # segment is full, so the reference's ``pw`` is P**(2**k) there (and unused elsewhere)
        pw = tl.full([BLOCK], _POW, tl.int64)
        p = tl.where(live & (par >= 0), par, U)
        for _ in range(ROUNDS):
            tl.debug_barrier()
            tl.store(iw0 + lanes, s, mask=live)
            tl.store(iw1 + lanes, p, mask=live)
            tl.debug_barrier()
            up = p < U
            s = tl.load(iw0 + p, mask=up, other=0) * pw + s
            p = tl.load(iw1 + p, mask=up, other=U)
            pw = pw * pw
        tl.debug_barrier()
        tl.store(iw0 + lanes, s, mask=live)
        tl.debug_barrier()
        canon = lanes.to(tl.int64)
        pending = valid
        for r in tl.static_range(4):      # `canonical_nodes`: the bucket minimum by an atomic min
            bucket = ((s >> (r * 13 + 3)) & 255).to(tl.int32)
            tl.atomic_min(dedupe_t + r * 256 + bucket, lanes.to(tl.int32), mask=pending)
            tl.debug_barrier()
            cand = tl.minimum(tl.load(dedupe_t + r * 256 + bucket, mask=live, other=U, volatile=True), U - 1)
            ok = pending & (tl.load(iw0 + cand) == s)
            canon = tl.where(ok, cand.to(tl.int64), canon)
            pending = pending & ~ok
        valid = valid & ~pending

        # 2. the group's best member, every member's bin (atomic maxima by canonical node), agreement
        okey = _order_key(key, lanes)
        member = tl.minimum(tl.maximum(tl.load(mem_ptr + row, mask=live, other=0), 0), _NM - 1)
        bins = tl.load(bins_ptr + row, mask=live, other=-1).to(tl.int64)
        tl.atomic_max(best_t + canon, okey, mask=valid)
        tl.atomic_max(mb_t + canon * _NM + member, bins, mask=valid & (bins >= 0))
        tl.debug_barrier()
        best = tl.load(best_t + lanes, mask=live, other=-4611686018427387904, volatile=True)
        mb = tl.load(mb_at, mask=mb_in, other=-1, volatile=True)
        best_idx = tl.minimum(tl.maximum(1048575 - (best & 1048575), 0), U - 1)
        tl.store(fw0 + lanes, key, mask=live)
        tl.store(iw1 + lanes, canon, mask=live)
        tl.debug_barrier()
        gkey = tl.load(fw0 + best_idx)
        cpar = tl.where(lanes == 0, -1, tl.load(iw1 + tl.maximum(par, 0), mask=live, other=0))
        gest = tl.load(est_ptr + b * U + best_idx)
        src = tl.load(mem_ptr + b * U + best_idx).to(tl.int64)
        retrieved_best = src != _DRAFT
        if HAS_AGREE:
            drafted = tl.max(tl.where(mlanes[None, :] == _DRAFT, mb, -1), axis=1)
            retr = tl.max(tl.where((mlanes[None, :] > _DRAFT) & (mlanes[None, :] < _AGREE), mb, -1),
                          axis=1) >= 0
            agree = (drafted >= 0) & retr
            if HAS_ROWS:
                agree = agree & ((tl.load(rows_ptr + b) != 0) != INVERT)
            agree_bin = tl.where(agree, drafted + agree_offset, -1)
            agree_est = tl.load(table_ptr + tl.maximum(agree_bin, 0), mask=agree, other=0.0)
            gest = tl.where(agree, tl.maximum(gest, agree_est), gest)
            gkey = tl.where(agree & (gkey < inf), tl.maximum(gkey, agree_est), gkey)
            mb = tl.where((mlanes[None, :] == _DRAFT) & agree[:, None], -1, mb)
            mb = tl.where(mlanes[None, :] == _AGREE, agree_bin[:, None], mb)
            src = tl.where(agree, _AGREE, src)

        unique = valid & (canon == lanes)
        cp = tl.where(live & (cpar >= 0), cpar, U)                                 # sentinel parents
        gkey = tl.where(unique, gkey, -inf)
        if HAS_RW:   # the root's retrieved children below the root_width-th by key are cut
            kids = unique & (cpar == 0) & retrieved_best
            k2 = tl.where(live, _order_key(tl.where(kids, gkey, -inf), lanes), _LOW)
            cut = _element(tl.sort(k2, descending=True), lanes, root_width - 1)    # live keys are distinct
            gkey = tl.where(kids & ((root_width <= 0) | (k2 < cut)), -inf, gkey)
        p = cp
        for _ in range(ROUNDS):       # `path_min`
            tl.debug_barrier()
            tl.store(fw0 + lanes, gkey, mask=live)
            tl.store(iw1 + lanes, p, mask=live)
            tl.debug_barrier()
            up = p < U
            gkey = tl.minimum(gkey, tl.load(fw0 + p, mask=up, other=inf))
            p = tl.load(iw1 + p, mask=up, other=U)

        if CAPS != 0:   # `sibling_caps`: sort by (parent, key desc), a fixed-point prefix sum in that order
            e = tl.where(gkey > -inf, gest, 0.0)
            # (parent + 1) in the top 11 bits, the order key reversed below (its low 20 bits the lane)
            sib = tl.where(live, (cpar + 1) * 4503599627370496 + (2251799813685247 - _order_key(gkey, lanes)),
                           9223372036854775807)
            sib = tl.sort(sib)                                                   # position k < U: live
            at = sib & 1048575                                                   # the lane at position k
            tl.debug_barrier()
            tl.store(jw0 + lanes, to_fixed(tl.maximum(e, 0.0)), mask=live)
            tl.store(fw0 + lanes, gest, mask=live)
            tl.debug_barrier()
            sv = tl.load(jw0 + at, mask=live, other=0)                           # sorted, fixed point
            before = tl.cumsum(sv, axis=0) - sv                                  # mass sorted earlier
            _, start = tl.associative_scan((sib >> 52, before), 0, _run_start)   # ... at the group's start
            tl.store(jw1 + at, before - start, mask=live)
            tl.debug_barrier()
            above = from_fixed(tl.load(jw1 + lanes, mask=live, other=0))
            base = tl.where(cpar < 0, 1.0, tl.load(fw0 + tl.maximum(cpar, 0), mask=live, other=0.0))
            cap = tl.where(lanes == 0, inf, tl.maximum(base - above, 0.0))
            capped_est = tl.minimum(gest, cap)
            capped_key = tl.where(gkey == inf, gkey, tl.minimum(gkey, cap))
            p = cp
            for _ in range(ROUNDS):   # `path_min` of both
                tl.debug_barrier()
                tl.store(fw0 + lanes, capped_est, mask=live)
                tl.store(fw1 + lanes, capped_key, mask=live)
                tl.store(iw1 + lanes, p, mask=live)
                tl.debug_barrier()
                up = p < U
                capped_est = tl.minimum(capped_est, tl.load(fw0 + p, mask=up, other=inf))
                capped_key = tl.minimum(capped_key, tl.load(fw1 + p, mask=up, other=inf))
                p = tl.load(iw1 + p, mask=up, other=U)
            apply = lanes >= 0
            if CAPS == 1 and HAS_SAMPLED:   # greedy: sampled rows keep their estimates
                apply = apply & (tl.load(sampled_ptr + b) == 0)
            gest = tl.where(apply, capped_est, gest)
            gkey = tl.where(apply, capped_key, gkey)

        # 3. fill: the non-root nodes' top KP by key, the gain curve in that order, the N - 1 best
        rest = live & (lanes > 0)
        ok3 = _order_key(gkey, lanes)
        top = tl.topk(tl.where(rest, ok3, _LOW), KP)                             # descending, distinct
        k = tl.arange(0, KP)
        ranked = k < U - 1
        tl.debug_barrier()
        tl.store(jw2 + lanes, to_fixed(tl.maximum(tl.where(gkey > -inf, gest, 0.0), 0.0)), mask=live)
        tl.debug_barrier()
        gv = tl.load(jw2 + (1048575 - (top & 1048575)), mask=ranked, other=0)
        tl.store(jw3 + k, tl.cumsum(gv, axis=0), mask=ranked)                    # gain[k]: the k + 1 best
        tl.debug_barrier()
        for g0 in range(0, G, BLOCK):       # widths past the candidates repeat the last value (padding)
            gi = g0 + lanes
            if U > 1:
                gcum = tl.load(jw3 + tl.minimum(gi, U - 2), mask=gi < G, other=0)
            else:
                gcum = tl.zeros([BLOCK], dtype=tl.int64)
            tl.store(out_gain + b * G + gi, from_fixed(gcum), mask=gi < G)
        if KN > 0:
            sel = (lanes == 0) | (rest & (ok3 >= _element(top, k, KN - 1)) & (gkey > -inf))
        else:
            sel = lanes == 0

        # 4. compact the selected nodes (positions 1 .. count-1); the root and padding go by position
        newidx = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        count = tl.sum(sel.to(tl.int32), axis=0)
        tl.store(iw0 + lanes, newidx.to(tl.int64), mask=live)
        tl.debug_barrier()
        npar = tl.where(lanes == 0, -1, tl.load(iw0 + tl.maximum(cpar, 0), mask=live, other=0))
        put = sel & (lanes > 0)
        dst = b * N + newidx
        tl.store(out_tok + dst, tok, mask=put)
        tl.store(out_par + dst, npar, mask=put)
        tl.store(out_est + dst, tl.log(tl.maximum(gest, 0.0)), mask=put)          # the tree's logp
        tl.store(out_src + dst, src, mask=put)
        tl.store(out_mb + dst[:, None] * _NM + mlanes[None, :], mb, mask=put[:, None] & (mlanes[None, :] < _NM))
        # padding: the free tokens below N (not a child of the root), in order
        tl.store(used_t + tok, tl.full([BLOCK], 1, tl.int32), mask=put & (npar == 0) & (tok >= 0) & (tok < N))
        tl.debug_barrier()
        free = (tl.load(used_t + q) == 0) & (q < N)
        tl.store(free_t + tl.cumsum(free.to(tl.int32), axis=0) - 1, q.to(tl.int32), mask=free)
        tl.debug_barrier()
        pad_tok = tl.load(free_t + tl.minimum(tl.maximum(q - count, 0), N - 1))
        is_pad = q >= count
        spot = (q < N) & (is_pad | (q == 0))
        root_tok = tl.load(tok_ptr + b * U)
        dq = b * N + q
        tl.store(out_tok + dq, tl.where(q == 0, root_tok, pad_tok.to(tl.int64)), mask=spot)
        tl.store(out_par + dq, tl.where(q == 0, -1, 0).to(tl.int64), mask=spot)
        tl.store(out_est + dq, tl.where(q == 0, 0.0, float("-inf")), mask=spot)   # log 1, log 0
        tl.store(out_src + dq, tl.where(q == 0, _DRAFT, _PADDING).to(tl.int64), mask=spot)
        tl.store(out_mb + dq[:, None] * _NM + mlanes[None, :], tl.full([BN, 8], -1, tl.int64),
                 mask=spot[:, None] & (mlanes[None, :] < _NM))


def select_triton(cands: Candidates, opts: SelectOptions, sampled: Optional[torch.Tensor],
                  agreement: Optional[Agreement]) -> _Out:
    """`merge_select_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``), the log of the estimates taken in the kernel. Same arguments and
    results: bit for bit except ``logp``, whose ``log`` is the device's (equal to the reference's
    within float32 rounding).

    Raises:
        RuntimeError: Triton is not installed. ValueError: U >= 2048 candidates per request (the
            sibling order packs the parent into 11 bits of its sort key).
    """
    tokens, parents, key, est, valid, member, bins = (cands.tokens, cands.parents, cands.priority, cands.est,
                                                       cands.valid, cands.member, cands.bins)
    num_nodes, gain_nodes, min_score, root_width, exclusive_siblings = opts
    agree_offset, agree_table, agree_rows, agree_invert = agreement if agreement is not None else (0, None, None, False)
    if triton is None:
        raise RuntimeError("graft merge_select: Triton is not installed")
    b, u = tokens.shape
    if u >= _MAX_CANDIDATES:
        raise ValueError(f"graft merge_select: {u} candidates per request, the kernel takes at most "
                         f"{_MAX_CANDIDATES - 1}")
    n, g = num_nodes, gain_nodes - 1
    dev = tokens.device
    block = triton.next_power_of_2(max(u, 2))
    i64 = lambda t: t.contiguous().to(torch.int64)  # noqa: E731
    out_tok = torch.empty(b, n, dtype=torch.int64, device=dev)
    out_par = torch.empty_like(out_tok)
    out_est = torch.empty(b, n, dtype=torch.float32, device=dev)
    out_src = torch.empty(b, n, dtype=member.dtype, device=dev)
    out_mb = torch.empty(b, n, NUM_MEMBERS, dtype=torch.int64, device=dev)
    gain = torch.empty(b, g, dtype=torch.float32, device=dev)
    if b > 0:
        bn = triton.next_power_of_2(max(n, 2))
        iscratch = torch.empty(b, 14 * u, dtype=torch.int64, device=dev)
        fscratch = torch.empty(b, 2 * u, dtype=torch.float32, device=dev)
        tscratch = torch.empty(b, 1024 + 2 * bn, dtype=torch.int32, device=dev)
        flags = lambda t: t.contiguous() if t is not None else out_tok  # noqa: E731  (bool, or unused)
        table = agree_table.contiguous().float() if agree_table is not None else out_est
        kn = min(n - 1, u - 1)
        _select_kernel[(b,)](
            i64(tokens), i64(parents), key.contiguous().float(), est.contiguous().float(), flags(valid),
            i64(member), i64(bins), flags(sampled), table, flags(agree_rows), int(agree_offset),
            float(min_score), int(root_width or 0), out_tok, out_par, out_est, out_src, out_mb, gain,
            iscratch, fscratch, tscratch,
            U=u, N=n, G=g, KN=kn, KP=min(block, triton.next_power_of_2(max(2, kn, min(g, u - 1)))),
            ROUNDS=pointer_rounds(u + 1), BLOCK=block, BN=bn,
            CAPS=_CAPS[exclusive_siblings], HAS_SAMPLED=sampled is not None, HAS_AGREE=agree_table is not None,
            HAS_ROWS=agree_rows is not None, INVERT=bool(agree_invert), MIN_SCORE=min_score > 0,
            HAS_RW=root_width is not None,
            num_warps=8 if u > 64 else 4)
    return out_tok, out_par, out_est, out_src, out_mb, gain


def _select_fake(cands: Candidates, opts: SelectOptions, sampled: Optional[torch.Tensor],
                 agreement: Optional[Agreement]) -> _Out:
    b, n = cands.tokens.shape[0], opts.num_nodes
    tok = cands.tokens.new_empty((b, n), dtype=torch.int64)
    return (tok, tok.clone(), cands.est.new_empty((b, n), dtype=torch.float32),
            cands.member.new_empty((b, n)), tok.new_empty((b, n, NUM_MEMBERS)),
            cands.est.new_empty((b, opts.gain_nodes - 1), dtype=torch.float32))


#: ``graft::merge_select``: `merge_select_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
merge_select_op = fused_op("merge_select", merge_select_reference, _select_fake,
                           select_triton if triton is not None else None, approximate=(2,))   # logp: the kernel's log
