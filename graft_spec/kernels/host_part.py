"""The host proposals' candidates of a round in one kernel: re-anchoring, calibration bins, price.

Reference: `host_part_reference`, the torch code of ``HostProposalSource`` (graft_spec/device_sources.py;
step.py `reanchor`, ``Calibrator.retrieval_bins`` and `numerics.correction.price` over ``[B, M]``
candidates) as a function of tensors and views. Fused: `_host_part_kernel`, one Triton
program per request holding the row's M candidates as vectors:

- the reference's pointer jumping visits positions 0 .. 2**R - 1 of every root path (R =
  ``pointer_rounds(M + 2)``, 2**R >= M + 2); the kernel walks positions 0 .. M, which reach the
  anchor on every acyclic path and visit every node of a cyclic one (a buffer row nothing was written
  to keeps parent 0 at column 0), so the depth (the number of real nodes, 2**R - 1 on a cycle) and the
  path minima (order-free: only ``min`` and NaN propagation) are the reference's;
- each node's own consumed flag, match and consumed log-probability go to a scratch row, the program
  syncs, and the second walk reduces them along the path;
- the bins bucket by counting edges (``torch.bucketize`` on sorted edges), the estimate is read at
  the bin and priced with the reference's three float32 roundings (launched without FMA contraction).

Every output is an integer, a boolean or the same float32 operations in the same order, so the two
agree bit for bit. The op ``graft::host_part`` returns the reference's six tensors, the tokens and
members as contiguous copies the kernel writes (an op may not return its inputs; the stack that
reads them next then gets contiguous rows); the kernel reads the candidate fields in place through
their row strides (views of the packed host block). Its CPU implementation is the reference and its
CUDA implementation the kernel. `host_part` is registered by `registry.fused_op`.
"""

from __future__ import annotations

import math

import torch

from ..numerics.bins import retrieval_bin_ids
from ..numerics.correction import price
from ..sources import SOURCE_OUTPUTS, SOURCE_SUFFIX
from ..tree import node_depths, path_min, pointer_jumps, pointer_rounds
from .common import int8_arg, row_arg
from .dispatch import triton
from .registry import fused_op
from .views import HostBlock, Prices, RetrievalBins, Windows

if triton is not None:
    import triton.language as tl
    from .common import apply_correction

__all__ = ["host_part", "host_part_reference", "host_part_triton"]


#: a `Candidates` block's fields ``(tokens, parents, est, valid, bins, member)``
_Out = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def reanchor_arrays(tokens: torch.Tensor, parents: torch.Tensor, logp: torch.Tensor, match: torch.Tensor,
                    member: torch.Tensor, anchor_len: torch.Tensor, hist: torch.Tensor, count: torch.Tensor,
                    seq_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host proposals moved from the host's anchor to the device's root (step.py `reanchor`, which
    documents the rule), on the `HostCandidates` fields ``[B, M]`` and the slots' windows.

    Returns:
        ``(parents, depth, logp, match, valid)`` all ``[B, M]``: parents -1 = child of the root.
    """
    b, m = tokens.shape
    dev = tokens.device
    length = hist.shape[1]
    par = parents
    full = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), torch.where(par < 0, 0, par + 1)], 1)
    jumps = pointer_jumps(full)
    depth = node_depths(full, jumps)[:, 1:]                                    # 1-based below the anchor
    gap = seq_lens.to(torch.int64) + 1 - anchor_len
    ok_gap = (gap >= 0) & (gap <= count) & (gap <= length)
    src = (length - gap)[:, None] + depth - 1                                  # history index of depth d
    want = hist.gather(1, src.clamp(0, length - 1))
    consumed = depth <= gap[:, None]
    match_here = torch.where(consumed, tokens == want, True)
    inf = torch.full((), math.inf, device=dev)
    # one pointer jumping for both: is every consumed token on the path matched, and the consumed
    # prefix's path log-probability (the root column: 1 and +inf, neutral for the minimum)
    lead = torch.stack([torch.ones(b, 1, device=dev), inf.expand(b, 1)])
    ok_base = path_min(torch.cat([lead, torch.stack([match_here.float(),
                                                     torch.where(consumed, logp.float(), inf)])], 2), full, jumps)
    path_ok, base = ok_base[0, :, 1:] > 0.5, ok_base[1, :, 1:]
    valid = (member >= 0) & path_ok & ~consumed & ok_gap[:, None]
    par_depth = depth.gather(1, par.clamp(min=0))
    new_par = torch.where((par >= 0) & (par_depth > gap[:, None]), par, -1)
    lp = (logp - torch.where(torch.isinf(base), 0.0, base)).clamp(max=0.0)
    return new_par, depth - gap[:, None], lp, match + gap[:, None], valid


def host_part_reference(host: HostBlock, win: Windows, seq_lens: torch.Tensor, sampled: torch.Tensor, prices: Prices,
                        layout: RetrievalBins) -> _Out:
    """The host proposals re-anchored at the device's root and priced: ``HostProposalSource.propose``
    (graft_spec/device_sources.py; step.py: `reanchor`, then ``Calibrator.retrieval_bins`` and
    `numerics.correction.price`).

    Args:
        host: the `HostCandidates` fields (`HostBlock`, ``[B, M]``): parents < 0 = child of the
            anchor, else an index < M (parent < own index in a written row); members -1 = empty;
            ``anchor_len`` context tokens the host had seen.
        win: the slots' right-aligned token windows ending with the root (`Windows`, L >= 1).
        seq_lens: ``int64[B]`` committed tokens before the root.
        sampled: ``bool[B]`` rows verified by sampling.
        prices: the round's `Prices`; ones / False give exactly the estimates of no correction
            (``x * 1.0 == x``).
        layout: the calibrator's `RetrievalBins`.
    Returns:
        ``(tokens, parents, est, valid, bins, member)`` all ``[B, M]``: the input tokens; ``int64``
        parents under the new root (-1 = child of the root); ``float32`` estimates (0 where invalid);
        ``bool`` valid; ``int64`` calibration bins (-1 where invalid); the input members.
    """
    tokens, parents, logp, match, member, anchor_len = host
    est_table, scale, under = prices
    new_par, rel_depth, lp, rel_match, valid = reanchor_arrays(tokens, parents, logp, match, member, anchor_len,
                                                               win.hist, win.count, seq_lens)
    bins = retrieval_bin_ids(member, rel_depth.clamp(min=1), lp, rel_match, sampled, *layout)
    # the per-request correction
    mc = member.clamp(0, scale.shape[1] - 1)
    est = torch.where(valid, price(est_table[bins], mc, (scale, under)), 0.0)
    return tokens, new_par, est, valid, torch.where(valid, bins, -1), member


if triton is not None:
    _LO = tl.constexpr(SOURCE_SUFFIX)
    _HI = tl.constexpr(SOURCE_OUTPUTS)

    @triton.jit
    def _edge_count(x, edges_ptr, n: tl.constexpr, BE: tl.constexpr, OR_EQUAL: tl.constexpr):
        """Per lane of ``x``: the edges < x (``<=`` with ``OR_EQUAL``) among the first ``n``."""
        e = tl.arange(0, BE)
        edge = tl.load(edges_ptr + e, mask=e < n)
        if OR_EQUAL:
            below = edge[None, :] <= x[:, None]
        else:
            below = edge[None, :] < x[:, None]
        return tl.sum((below & (e[None, :] < n)).to(tl.int64), axis=1)

    @triton.jit
    def _host_part_kernel(tok_ptr, par_ptr, logp_ptr, match_ptr, member_ptr, anchor_ptr, hist_ptr, count_ptr,
                          seq_ptr, sampled_ptr, table_ptr, scale_ptr, under_ptr, rbase_ptr, qedge_ptr, dedge_ptr,
                          medge_ptr, depth_ptr, flag_ptr, clogp_ptr, tok_out, par_out, est_out, valid_out, bins_out,
                          member_out, per_mode, s_tok, s_par, s_lp, s_match, s_member, s_anchor,
                          M: tl.constexpr, L: tl.constexpr, NM: tl.constexpr, NQE: tl.constexpr,
                          NDE: tl.constexpr, NME: tl.constexpr, CYCLE_DEPTH: tl.constexpr, BM: tl.constexpr,
                          BE: tl.constexpr):
        """One request per program: its ``BM`` >= M candidates as lanes. The inputs are read
        through their row strides (``s_*``: views of the packed host block), the outputs and
        scratch rows are contiguous (``row``).

        Work per program: two M-step walks up the parents, O(M**2); the bins O(M * NE)."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BM)
        live = i < M
        row = b * M
        prow = par_ptr + b * s_par
        par = tl.load(prow + i, mask=live, other=-1)
        # walk 1: real nodes at positions 0 .. M of every path (M + 1 of them: a cycle)
        cnt = live.to(tl.int64)
        cur = par
        for _ in range(M):
            up = cur >= 0
            cnt += up.to(tl.int64)
            cur = tl.load(prow + tl.where(up, cur, 0), mask=up, other=-1)
        depth = tl.where(cnt > M, CYCLE_DEPTH, cnt)
        gap = tl.load(seq_ptr + b) + 1 - tl.load(anchor_ptr + b * s_anchor)
        ok_gap = (gap >= 0) & (gap <= tl.load(count_ptr + b)) & (gap <= L)
        consumed = depth <= gap
        src = tl.minimum(tl.maximum(L - gap + depth - 1, 0), L - 1)
        want = tl.load(hist_ptr + b * L + src, mask=live & consumed, other=0)
        tok = tl.load(tok_ptr + b * s_tok + i, mask=live, other=0)
        own = tl.where(consumed, tok == want, True)
        lp_own = tl.load(logp_ptr + b * s_lp + i, mask=live, other=0.0).to(tl.float32)
        clogp = tl.where(consumed, lp_own, float("inf"))
        tl.store(depth_ptr + row + i, depth, mask=live)
        tl.store(flag_ptr + row + i, own.to(tl.int8), mask=live)
        tl.store(clogp_ptr + row + i, clogp, mask=live)
        tl.debug_barrier()
        # walk 2: every consumed node on the path matched; the minimum consumed log-probability
        ok = own
        base = clogp
        cur = par
        for _ in range(M):
            up = cur >= 0
            safe = tl.where(up, cur, 0)
            ok = ok & (tl.load(flag_ptr + row + safe, mask=up, other=1) != 0)
            v = tl.load(clogp_ptr + row + safe, mask=up, other=float("inf"))
            base = tl.where((v != v) | (v < base), v, base)                 # torch.minimum: NaN wins
            cur = tl.load(prow + safe, mask=up, other=-1)
        member = tl.load(member_ptr + b * s_member + i, mask=live, other=-1)
        valid = (member >= 0) & ok & (~consumed) & ok_gap & live
        par_depth = tl.load(depth_ptr + row + tl.maximum(par, 0), mask=live, other=0)
        new_par = tl.where((par >= 0) & (par_depth > gap), par, -1)
        base = tl.where((base == float("inf")) | (base == -float("inf")), 0.0, base)
        lp = lp_own - base
        lp = tl.where(lp > 0.0, 0.0, lp)                                     # clamp(max=0), NaN kept
        # bins: ((depth bin * Q + q bin) * K + match bin) + member block + mode
        q_bin = NQE - _edge_count(lp, qedge_ptr, NQE, BE, True)             # NaN: no edge <= it, last bin
        q_bin = tl.minimum(tl.maximum(q_bin, 0), NQE)
        d_bin = tl.minimum(_edge_count(tl.maximum(depth - gap, 1), dedge_ptr, NDE, BE, False), NDE)
        m_bin = tl.minimum(_edge_count(tl.maximum(tl.load(match_ptr + b * s_match + i, mask=live, other=0) + gap, 1),
                                       medge_ptr, NME, BE, False), NME)
        within = (d_bin * (NQE + 1) + q_bin) * (NME + 1) + m_bin
        rbase = tl.load(rbase_ptr + tl.minimum(tl.maximum(member, _LO), _HI))
        mode = tl.load(sampled_ptr + b).to(tl.int64) * per_mode
        bins = rbase + within + mode
        # price: est * scale, or 1 - (1 - est) * scale where under
        e = tl.load(table_ptr + bins, mask=valid, other=0.0)
        mc = tl.minimum(tl.maximum(member, 0), NM - 1)
        sc = tl.load(scale_ptr + b * NM + mc, mask=live, other=1.0)
        un = tl.load(under_ptr + b * NM + mc, mask=live, other=0) != 0
        priced = apply_correction(e, sc, un)
        tl.store(tok_out + row + i, tok, mask=live)
        tl.store(member_out + row + i, member, mask=live)
        tl.store(par_out + row + i, new_par, mask=live)
        tl.store(est_out + row + i, tl.where(valid, priced, 0.0), mask=live)
        tl.store(valid_out + row + i, valid.to(tl.int8), mask=live)
        tl.store(bins_out + row + i, tl.where(valid, bins, -1), mask=live)


def host_part_triton(host: HostBlock, win: Windows, seq_lens: torch.Tensor, sampled: torch.Tensor, prices: Prices,
                     layout: RetrievalBins) -> _Out:
    """`host_part_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``): ``(tokens, parents, est, valid, bins, member)``, the tokens and members
    copied out by the kernel (an op may not return its inputs). The candidate fields are read in
    place through their row strides (views of the packed host block, `HostCandidates.unpack`; the
    last axis contiguous), so the launch is the only kernel.

    Raises:
        RuntimeError: Triton is not installed.
    """
    tokens, parents, logp, match, member, anchor_len = host
    hist, count = win
    est_table, scale, under = prices
    retrieval_base, logp_edges, depth_edges, match_edges, per_mode = layout
    if triton is None:
        raise RuntimeError("graft host_part: Triton is not installed")
    b, m = tokens.shape
    dev = tokens.device
    out_tok = torch.empty(b, m, dtype=torch.int64, device=dev)
    new_par = torch.empty(b, m, dtype=torch.int64, device=dev)
    est = torch.empty(b, m, dtype=torch.float32, device=dev)
    valid = torch.empty(b, m, dtype=torch.bool, device=dev)
    bins = torch.empty(b, m, dtype=torch.int64, device=dev)
    out_member = torch.empty(b, m, dtype=torch.int64, device=dev)
    if b > 0 and m > 0:
        depth = torch.empty(b, m, dtype=torch.int64, device=dev)
        flag = torch.empty(b, m, dtype=torch.int8, device=dev)
        clogp = torch.empty(b, m, dtype=torch.float32, device=dev)
        length = hist.shape[1]
        ne = max(logp_edges.numel(), depth_edges.numel(), match_edges.numel(), 2)
        rows = [row_arg(x) for x in (tokens, parents, logp, match, member)]
        _host_part_kernel[(b,)](
            *(x for x, _ in rows), anchor_len, hist.contiguous(), count, seq_lens, int8_arg(sampled),
            est_table, scale, int8_arg(under), retrieval_base, logp_edges, depth_edges, match_edges,
            depth, flag, clogp, out_tok, new_par, est, valid.view(torch.int8), bins, out_member,
            int(per_mode), *(stride for _, stride in rows), anchor_len.stride(0),
            M=m, L=length, NM=scale.shape[1], NQE=logp_edges.numel(), NDE=depth_edges.numel(),
            NME=match_edges.numel(), CYCLE_DEPTH=2 ** pointer_rounds(m + 2) - 1,
            BM=triton.next_power_of_2(max(m, 2)), BE=triton.next_power_of_2(ne), enable_fp_fusion=False)
    return out_tok, new_par, est, valid, bins, out_member


def _host_part_cpu(host: HostBlock, win: Windows, seq_lens: torch.Tensor, sampled: torch.Tensor, prices: Prices,
                   layout: RetrievalBins) -> _Out:
    out = host_part_reference(host, win, seq_lens, sampled, prices, layout)
    return out[0].clone(), out[1], out[2], out[3], out[4], out[5].clone()   # an op returns no input


def _host_part_fake(host: HostBlock, win: Windows, seq_lens: torch.Tensor, sampled: torch.Tensor, prices: Prices,
                    layout: RetrievalBins) -> _Out:
    b, m = host.tokens.shape
    i64 = lambda: host.tokens.new_empty((b, m), dtype=torch.int64)  # noqa: E731
    return (i64(), i64(), host.tokens.new_empty((b, m), dtype=torch.float32),
            host.tokens.new_empty((b, m), dtype=torch.bool), i64(), i64())


#: ``graft::host_part``: `host_part_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
host_part = fused_op("host_part", host_part_reference, _host_part_fake,
                     host_part_triton if triton is not None else None, cpu=_host_part_cpu)
