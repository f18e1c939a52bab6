"""The draft's rerank in one kernel: a round's N - 1 best draft candidates under the root.

Every draft candidate gets its calibration bin (depth, cumulative draft probability, mode) and its
estimate from the table; its rank key is the minimum estimate along its path (so every prefix of
the ranking is ancestor-closed, ties to the lower index); the N - 1 best are kept in index order
under the round's root (step.py ``GraftStep._draft_part``).

Reference: `draft_part_reference` (torch). Fused: `_draft_kernel`, one Triton program per
request: `path_min` by the reference's pointer jumping through a scratch row, the top N - 1 as the
candidates whose `tree.order_key` (distinct per candidate) is at least the (N - 1)-th of a bitonic
``tl.topk``, compaction by a cumulative sum. Minima, counts and gathers are exact, so the two agree bit for
bit. The op ``graft::draft_part`` has the reference as its CPU implementation and the kernel as its
CUDA implementation; `draft_part` is registered by `registry.fused_op`.

``graft::dense_draft_part`` is the same rerank of SGLang's dense EAGLE tree (`dense_links`: the
parents from ``parent_list`` and the depths from the index, derived inside the kernel instead of
by separate ops); only the log-probabilities come in converted (``torch.log`` in both paths).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..numerics.bins import draft_bin_ids
from ..tree import order_key, path_min, pointer_rounds, top_mask
from .common import row_arg
from .dispatch import triton
from .registry import fused_op
from .views import DraftBins, DraftCandidates, DraftOptions

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _order_key(v, lanes):
        """`tree.order_key` exactly: ``torch.nan_to_num(v, nan=-inf)`` (NaN -> -inf, then +-inf ->
        the largest / lowest finite float32), larger first, ties to the lower lane."""
        big = 3.4028234663852886e38
        v = tl.where(v == float("inf"), big, tl.where(v == float("-inf"), -big, v))
        v = tl.where(v != v, float("-inf"), v)
        bits = v.to(tl.int32, bitcast=True).to(tl.int64)
        mono = tl.where(bits < 0, -2147483648 - bits, bits)
        return mono * 1048576 + (1048575 - lanes.to(tl.int64))

__all__ = ["draft_part", "draft_part_reference", "draft_part_triton", "dense_links", "dense_draft_part",
           "dense_draft_part_reference", "dense_draft_part_triton"]


_Out = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def draft_part_reference(draft: DraftCandidates, roots: torch.Tensor, sampled: torch.Tensor, layout: DraftBins,
                         opts: DraftOptions) -> _Out:
    """The rooted draft block of a round.

    Args:
        draft: the draft's candidates (`DraftCandidates` ``[B, S]``; parents -1 = child of the root, else
            an index below the node's own).
        roots: ``int64[B]``; sampled: ``bool[B]`` (the sampled mode's bins).
        layout: the calibrator's `DraftBins` (its table and the probability edges, ascending).
        opts: `DraftOptions` (``pool`` N: root + N - 1 candidates at most).
    Returns:
        ``(tokens int64, parents int64, est float32, valid bool, bins int64, logq float32)``, each
        ``[B, 1 + min(N - 1, S)]``: the root at 0 (parent -1, estimate 1, bin -1, logq 0), then the
        kept candidates in index order (parents re-pointed; invalid ones estimate 0, bin -1).
    Source: step.py ``GraftStep._draft_part``; calibration.py ``Calibrator.draft_bins``.
    """
    tokens, parents, logq, depth = draft.tokens, draft.parents, draft.logq, draft.depth
    est_table, edges, draft_depth, num_q, per_mode = layout
    pool, draft_nodes, by_logq = opts
    b, s = tokens.shape
    dev = tokens.device
    drafted = torch.isfinite(logq) & (logq > -60.0)
    if not draft_nodes:
        drafted = torch.zeros_like(drafted)
    bins = draft_bin_ids(depth, logq, sampled, edges, draft_depth, num_q, per_mode)
    est = torch.where(drafted, est_table[bins], 0.0)
    rank_key = logq if by_logq else torch.where(drafted, est, -1.0)
    full = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev),
                      torch.where(parents < 0, 0, parents + 1)], 1)
    inf = torch.full((b, 1), math.inf, device=dev)
    key = path_min(torch.cat([inf, rank_key.float()], 1), full)[:, 1:]
    k = min(pool - 1, s)
    sel = top_mask(order_key(key), k)                                           # [B, S]
    rank = torch.cumsum(sel, dim=1)                                             # 1-based tree index
    dest = torch.where(sel, rank - 1, k)
    idx = torch.zeros(b, k + 1, dtype=torch.int64, device=dev)
    idx.scatter_(1, dest, torch.arange(s, device=dev).expand(b, s))
    idx = idx[:, :k]                                                            # ascending
    pos = torch.where(sel, rank, -1)
    gp = parents.gather(1, idx)
    par = torch.where(gp < 0, 0, pos.gather(1, gp.clamp(min=0)))

    def pick(x, root_value):
        head = torch.full((b, 1), root_value, dtype=x.dtype, device=dev)
        return torch.cat([head, x.gather(1, idx)], 1)

    return (torch.cat([roots.reshape(b, 1).to(torch.int64), tokens.gather(1, idx)], 1),
            torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), par], 1),
            pick(est, 1.0), pick(drafted, True), pick(torch.where(drafted, bins, -1), -1), pick(logq.float(), 0.0))


def _check_dense(parent_list: torch.Tensor, topk: int, s: int) -> None:
    if topk < 1:
        raise ValueError(f"dense draft: topk={topk} must be >= 1")
    if 0 < parent_list.shape[1] < (s - 1) // topk + 1:
        raise ValueError(f"dense draft: parent_list has {parent_list.shape[1]} columns, the layout of "
                         f"S={s}, topk={topk} needs {(s - 1) // topk + 1}")


def dense_links(parent_list: torch.Tensor, topk: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents and depths of SGLang's dense EAGLE tree of ``S`` candidates (``select_top_k_tokens``
    layout, spec_utils.py:474; parent rule of eagle_utils.py:100 / eagle.cuh: candidate g has
    tb = g // topk, tb == 0 -> the root, else the candidate ``parent_list[tb]``).

    Args:
        parent_list: ``int[B, W]``, W >= (S - 1) // topk + 1 (or 0 columns: every candidate under
            the root); topk: the draft's top-k; s: S.
    Returns:
        ``(parents int64[B, S] (-1 = child of the root), depth int64[B, S])``: depth 1 for g < topk,
        else 2 + (g - topk) // topk**2 (one division).
    Raises:
        ValueError: ``parent_list`` narrower than the layout needs.
    """
    _check_dense(parent_list, topk, s)
    b = parent_list.shape[0]
    g = torch.arange(s, device=parent_list.device)
    if parent_list.shape[1] > 0:
        parents = parent_list.to(torch.int64).gather(1, (g // topk).expand(b, s))   # tb = g // topk < W
        parents[:, :topk].fill_(-1)                                                  # tb == 0: the root's
    else:
        parents = torch.full((b, s), -1, dtype=torch.int64, device=parent_list.device)
    depth = ((g + (2 * topk * topk - topk)) // (topk * topk)).expand(b, s)
    return parents, depth


def dense_draft_part_reference(tokens: torch.Tensor, parent_list: torch.Tensor, logq: torch.Tensor, topk: int,
                               roots: torch.Tensor, sampled: torch.Tensor, layout: DraftBins, opts: DraftOptions
                               ) -> _Out:
    """`draft_part_reference` of a dense EAGLE tree: ``tokens`` / ``logq`` ``[B, S]``, the links from
    ``parent_list`` ``int[B, W]`` and ``topk`` (`dense_links`); the other arguments and the results
    as there."""
    parents, depth = dense_links(parent_list, topk, tokens.shape[1])
    return draft_part_reference(DraftCandidates(tokens.to(torch.int64), parents, logq, depth), roots, sampled, layout,
                                opts)


if triton is not None:
    @triton.jit
    def _draft_kernel(tok_ptr, par_ptr, logq_ptr, depth_ptr, roots_ptr, sampled_ptr, table_ptr, edges_ptr,
                      o_tok, o_par, o_est, o_valid, o_bins, o_logq, scratch_ptr, iscratch_ptr,
                      s_tok, s_par, s_lq, s_dep, S: tl.constexpr, K: tl.constexpr, NE: tl.constexpr,
                      DD: tl.constexpr, NQ: tl.constexpr,
                      PER_MODE: tl.constexpr, DRAFT_NODES: tl.constexpr, BY_LOGQ: tl.constexpr,
                      ROUNDS: tl.constexpr, BS: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                      TOPK: tl.constexpr, W: tl.constexpr):
        """One request per program; candidates as lanes (``BS`` >= S + 1, lane 0 = the root).
        ``TOPK`` > 0: a dense tree, ``par_ptr`` its ``parent_list`` ``[B, W]`` (`dense_links`), no depths.
        Inputs are read through their row strides ``s_*`` (views such as a tree's columns 1:).

        Work per program: the bins O(S * NE); `path_min` O(S log S) in ``ROUNDS`` barriered rounds;
        the top K a bitonic top-``KP`` (``KP`` = K rounded up to a power of two), O(S log**2 KP), no
        barrier; the compaction one scan and one barriered gather."""
        b = tl.program_id(0)
        lane = tl.arange(0, BS)
        c = lane - 1                                        # candidate index of lane (root: -1)
        live = (lane >= 1) & (lane <= S)
        cs = tl.where(live, c, 0)
        lq = tl.load(logq_ptr + b * s_lq + cs, mask=live, other=float("-inf")).to(tl.float32)
        if TOPK > 0:
            dep = ((cs + (2 * TOPK * TOPK - TOPK)) // (TOPK * TOPK)).to(tl.int64)
            if W > 0:
                par = tl.load(par_ptr + b * s_par + cs // TOPK, mask=live & (cs >= TOPK), other=-1).to(tl.int64)
            else:
                par = tl.full([BS], -1, dtype=tl.int64)
        else:
            dep = tl.load(depth_ptr + b * s_dep + cs, mask=live, other=1)
            par = tl.load(par_ptr + b * s_par + cs, mask=live, other=-1).to(tl.int64)
        drafted = (lq == lq) & (lq != float("inf")) & (lq != float("-inf")) & (lq > -60.0) & live
        if not DRAFT_NODES:
            drafted = drafted & (lane < 0)
        x = tl.where(lq != lq, float("-inf"), lq)
        e = tl.arange(0, BE)
        edges = tl.load(edges_ptr + e, mask=e < NE, other=float("inf"))
        q = NE - tl.sum(((e[None, :] < NE) & (edges[None, :] <= x[:, None])).to(tl.int64), axis=1)
        q = tl.minimum(tl.maximum(q, 0), NE)
        d = tl.minimum(tl.maximum(dep.to(tl.int64) - 1, 0), DD - 1)
        smp = (tl.load(sampled_ptr + b) != 0).to(tl.int64)
        bins = d * NQ + q + smp * PER_MODE
        est = tl.where(drafted, tl.load(table_ptr + bins, mask=live, other=0.0), 0.0)
        rk = lq if BY_LOGQ else tl.where(drafted, est, -1.0)
        # path_min over the rooted tree (lane 0 = root, +inf), the reference's pointer jumping
        val = tl.where(live, rk, float("inf"))
        ptr = tl.where(live, tl.where(par < 0, 0, par + 1), BS)           # sentinel BS: past the root
        ptr = tl.where(lane == 0, BS, ptr)
        frow = scratch_ptr + b * (BS + 1)
        irow = iscratch_ptr + b * (BS + 1)
        tl.store(frow + BS, float("inf"))
        tl.store(irow + BS, BS)
        for _ in range(ROUNDS):
            tl.debug_barrier()
            tl.store(frow + lane, val)
            tl.store(irow + lane, ptr)
            tl.debug_barrier()
            up = tl.load(frow + ptr)
            val = tl.where((val != val) | (up != up), val + up, tl.minimum(val, up))   # NaN spreads, as torch.minimum
            ptr = tl.load(irow + ptr)
        # the K best by order_key (ties: lower candidate index): keys above the K-th of a top-KP
        okey = tl.where(live, _order_key(val, cs), -9223372036854775807)
        if K > 0:
            top = tl.topk(okey, KP)                                         # descending, live keys distinct
            kth = tl.min(tl.where(tl.arange(0, KP) < K, top, 9223372036854775807), axis=0)
            sel = live & (okey >= kth)
        else:
            sel = lane < 0
        rank = tl.cumsum(sel.to(tl.int32), axis=0)                        # 1-based output index
        pos = tl.where(sel, rank, -1)
        tl.debug_barrier()
        tl.store(irow + lane, pos.to(tl.int64))
        tl.debug_barrier()
        ppos = tl.load(irow + tl.where(par < 0, 0, par + 1), mask=sel & (par >= 0), other=0)
        out = b * (K + 1) + tl.where(sel, rank, 0)
        tok = tl.load(tok_ptr + b * s_tok + cs, mask=sel, other=0).to(tl.int64)
        root = tl.load(roots_ptr + b).to(tl.int64)
        first = lane == 0
        m = sel | first
        tl.store(o_tok + out, tl.where(first, root, tok), mask=m)
        tl.store(o_par + out, tl.where(first, -1, ppos), mask=m)
        tl.store(o_est + out, tl.where(first, 1.0, est), mask=m)
        tl.store(o_valid + out, first | drafted, mask=m)
        tl.store(o_bins + out, tl.where(first, -1, tl.where(drafted, bins, -1)), mask=m)
        tl.store(o_logq + out, tl.where(first, 0.0, lq), mask=m)


def draft_part_triton(draft: DraftCandidates, roots: torch.Tensor, sampled: torch.Tensor, layout: DraftBins,
                      opts: DraftOptions) -> _Out:
    """`draft_part_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and results.

    Raises:
        RuntimeError: Triton is not installed.
    """
    return _launch(draft.tokens, draft.parents, draft.logq, draft.depth, 0, roots, sampled, layout, opts)


def dense_draft_part_triton(tokens: torch.Tensor, parent_list: torch.Tensor, logq: torch.Tensor, topk: int,
                            roots: torch.Tensor, sampled: torch.Tensor, layout: DraftBins, opts: DraftOptions) -> _Out:
    """`dense_draft_part_reference` as one Triton launch (the links derived in the kernel). Same
    arguments and results.

    Raises:
        RuntimeError: Triton is not installed. ValueError: as `dense_links`.
    """
    _check_dense(parent_list, topk, tokens.shape[1])
    return _launch(tokens, parent_list, logq, None, topk, roots, sampled, layout, opts)


def _launch(tokens: torch.Tensor, links: torch.Tensor, logq: torch.Tensor, depth: Optional[torch.Tensor], topk: int,
            roots: torch.Tensor, sampled: torch.Tensor, layout: DraftBins, opts: DraftOptions) -> _Out:
    """One `_draft_kernel` launch: ``links`` = per-candidate parents with ``depth`` (``topk`` 0), or a
    dense tree's ``parent_list`` (``topk`` > 0, ``depth`` None)."""
    est_table, edges, draft_depth, num_q, per_mode = layout
    pool, draft_nodes, by_logq = opts
    if triton is None:
        raise RuntimeError("graft draft_part: Triton is not installed")
    b, s = tokens.shape
    dev = tokens.device
    k = min(pool - 1, s)
    bs = triton.next_power_of_2(s + 1)
    o_tok = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    o_par, o_bins = torch.empty_like(o_tok), torch.empty_like(o_tok)
    o_est = torch.empty(b, k + 1, dtype=torch.float32, device=dev)
    o_logq = torch.empty_like(o_est)
    o_valid = torch.empty(b, k + 1, dtype=torch.bool, device=dev)
    scratch = torch.empty(b, bs + 1, dtype=torch.float32, device=dev)
    iscratch = torch.empty(b, bs + 1, dtype=torch.int64, device=dev)
    depth = links if depth is None else depth   # unread in the dense form
    rows = [row_arg(x) for x in (tokens, links, logq, depth)]
    if b > 0:
        # parents < own index: a path is at most S + 1 long; the sentinel is BS
        (tokens, s_tok), (links, s_par), (logq, s_lq), (depth, s_dep) = rows
        _draft_kernel[(b,)](tokens, links, logq, depth, roots, sampled, est_table, edges,
                            o_tok, o_par, o_est, o_valid, o_bins, o_logq, scratch, iscratch, s_tok, s_par, s_lq, s_dep,
                            S=s, K=k, NE=edges.numel(), DD=draft_depth, NQ=num_q, PER_MODE=per_mode,
                            DRAFT_NODES=bool(draft_nodes), BY_LOGQ=bool(by_logq), ROUNDS=pointer_rounds(s + 2),
                            BS=bs, KP=min(bs, triton.next_power_of_2(max(k, 2))),
                            BE=triton.next_power_of_2(max(edges.numel(), 2)),
                            TOPK=int(topk), W=links.shape[1] if topk else 0)
    return o_tok, o_par, o_est, o_valid, o_bins, o_logq


def _draft_part_fake(draft: DraftCandidates, roots: torch.Tensor, sampled: torch.Tensor, layout: DraftBins,
                     opts: DraftOptions) -> _Out:
    return _fake_outputs(draft.tokens, opts.pool)


def _dense_draft_part_fake(tokens: torch.Tensor, parent_list: torch.Tensor, logq: torch.Tensor, topk: int,
                           roots: torch.Tensor, sampled: torch.Tensor, layout: DraftBins, opts: DraftOptions) -> _Out:
    return _fake_outputs(tokens, opts.pool)


def _fake_outputs(tokens: torch.Tensor, pool: int) -> _Out:
    """The results' shapes and dtypes (the ops' fake implementations)."""
    b, s = tokens.shape
    w = 1 + min(pool - 1, s)
    i = tokens.new_empty((b, w), dtype=torch.int64)
    f = tokens.new_empty((b, w), dtype=torch.float32)
    return i, i.clone(), f, tokens.new_empty((b, w), dtype=torch.bool), i.clone(), f.clone()


#: ``graft::draft_part``: `draft_part_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
draft_part = fused_op("draft_part", draft_part_reference, _draft_part_fake,
                      draft_part_triton if triton is not None else None)
#: ``graft::dense_draft_part``: `dense_draft_part_reference`'s contract, dispatched as `draft_part`.
dense_draft_part = fused_op("dense_draft_part", dense_draft_part_reference, _dense_draft_part_fake,
                            dense_draft_part_triton if triton is not None else None)
