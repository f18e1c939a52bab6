"""A verified round's device bookkeeping in one kernel per request.

`observe_rows` credits one round: the calibrator's counts per bin, the source correction's window
per (mode, member), the round metrics per row, the slots' per-request correction windows, the slots'
token history, the accepted nodes' sources and the expected accept lengths of the batch budget's
widths. Everything but the counts is row-local; the counts are sums of identical increments (1 per
trial or hit: every order of addition gives the same float) or int64 fixed-point sums
(calibration.py `FIXED_ONE`: exact in every order), so the kernel's atomics and the reference's
sequential scatters agree bit for bit, and so do the ranks of a tensor-parallel group.

Reference: `observe_rows_reference` (torch). Fused: `_observe_kernel`, one Triton
program per request. The op ``graft::observe_rows`` has the reference as its CPU implementation and
the kernel as its CUDA implementation; `observe_rows` is registered by `registry.fused_op`.
Halving of the counts belongs to the table refresh (refresh.py), which runs after every observe.
"""

from __future__ import annotations

import torch

from ..numerics.correction import window_update
from ..numerics.credit import credit_counts, round_metrics
from ..numerics.rows import append_rows
from .common import int8_arg, row_arg
from .dispatch import triton
from .registry import fused_op
from .views import CalibrationState, Commit, ObserveOptions, Prices, RoundOutcome, Windows

if triton is not None:
    import triton.language as tl
    from .common import apply_correction, from_fixed, to_fixed

__all__ = ["observe_rows", "observe_rows_reference", "observe_rows_triton", "gain_columns", "expected_lengths",
           "accepted_sources"]


def gain_columns(widths: "tuple[int, ...]", gain_len: int, device) -> torch.Tensor:
    """``int64[len(widths)]``: the gain curve column that prices a tree of each width (width w:
    column ``min(w - 2, gain_len - 1)``: widths beyond the curve take its last value; -1 = width <= 1
    or no curve, expected accept length 1). Built on the host: call it once per shape."""
    return torch.tensor([-1 if w <= 1 or gain_len == 0 else min(w - 2, gain_len - 1) for w in widths],
                        dtype=torch.int64, device=device)


def expected_lengths(gain: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``float32[B, K]``: expected accept length (bonus included) ``1 + gain[:, col]`` of a tree at
    each of `gain_columns`' ``cols`` ``int64[K]`` (1 where the column is -1) from the gain curve
    ``gain`` ``float32[B, G]`` (`merge_select`)."""
    b = gain.shape[0]
    if gain.shape[1] == 0:
        return torch.ones(b, cols.numel(), device=gain.device)
    return 1.0 + torch.where(cols >= 0, gain.float().gather(1, cols.clamp(min=0).expand(b, -1)), 0.0)


def observe_rows_reference(outcome: RoundOutcome, prices: Prices, cal: CalibrationState, gain: torch.Tensor,
                           gain_cols: torch.Tensor, commit: Commit, rc_recent: torch.Tensor, history: Windows,
                           opts: ObserveOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Credit one verified round (in place) and return what the host reads of it.

    Args:
        outcome: the verified tree (`RoundOutcome`).
        prices: the `Prices` the round was priced with (``table`` the estimates; only the metrics
            read the correction).
        cal: the calibrator's tables (`CalibrationState`): ``trials``, ``hits`` updated (the dump
            bin S stays 0); ``src_recent`` updated when ``opts.source_window``; ``base`` and
            ``group`` read.
        gain: ``float32[B, G]`` the round's gain curve; gain_cols: ``int64[K]`` (`gain_columns`).
        commit: the round's committed tokens (`Commit`).
        rc_recent: ``float32[slots, M, 3]`` the request windows (updated when ``opts.rc_window > 0``).
        history: the token history of every slot (`TokenHistory.windows`; updated).
        opts: `ObserveOptions`.
    Returns:
        ``(sources int64[B, N - 1], row_members float64[B, M, 3], row_depths float64[B, max_depth + 1, 2],
        expected float32[B, K])``: accepted non-root nodes' sources in path order (-1 after the path);
        per row and member (trials, sum of the estimates as priced, hits); per row and depth
        (verified, accepted) nodes (row 0 is 0); 1 + the gain at each column.
    """
    o = outcome
    credit_counts(cal.trials, cal.hits, cal.src_recent if opts.source_window else None, cal.group, cal.base, o.bins,
                  o.on_path)
    row_members, row_depths = round_metrics(o.bins, o.on_path, o.depth, *prices, opts.max_depth)
    if opts.rc_window > 0:
        window_update(rc_recent, commit.slot_ids, o.bins, o.on_path, prices.table, opts.rc_window)
    append_rows(history.hist, history.count, *commit)
    return accepted_sources(o.on_path, o.source), row_members, row_depths, expected_lengths(gain, gain_cols)


def accepted_sources(on_path: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``int64[B, N - 1]``: the sources of the accepted non-root nodes (``on_path`` ``bool[B, N]``,
    ``source`` ``int64[B, N]``) in path order, which is index order (a path's nodes have increasing
    indices); -1 after the path."""
    n = on_path.shape[1]
    idx = torch.arange(n, device=on_path.device)
    order = torch.where(on_path & (idx > 0), idx, n).sort(dim=1).values[:, : n - 1]
    return torch.where(order < n, source.gather(1, order.clamp(max=n - 1)), -1)


if triton is not None:
    @triton.jit
    def _observe_kernel(bins_ptr, on_ptr, depth_ptr, source_ptr, est_ptr, base_ptr, group_ptr, scale_ptr, under_ptr,
                        gain_ptr, cols_ptr, slot_ptr, comm_ptr, alen_ptr,
                        trials_ptr, hits_ptr, src_ptr, rc_ptr, htok_ptr, hcnt_ptr,
                        sources_ptr, members_ptr, depths_ptr, expected_ptr,
                        rc_window, on_stride, N: tl.constexpr, M: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                        W: tl.constexpr, L: tl.constexpr, MAXD: tl.constexpr, HAS_GAIN: tl.constexpr,
                        SOURCE_WINDOW: tl.constexpr,
                        RC_ON: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                        BK: tl.constexpr, BL: tl.constexpr):
        """One request per program: nodes as rows (``BN`` >= N), members as columns (``BM`` >= M).

        Work per program: O(N * M) for the counts and the per-member sums (reductions over the
        node axis), O(L) for the history window's shift by the committed tokens, O(N**2) for the
        accepted nodes' source columns; one barrier."""
        b = tl.program_id(0)
        ONE: tl.constexpr = 4294967296
        i = tl.arange(0, BN)
        c = tl.arange(0, BM)
        live = (i[:, None] < N) & (c[None, :] < M)
        bins = tl.load(bins_ptr + b * N * M + i[:, None] * M + c[None, :], mask=live, other=-1)
        on = tl.load(on_ptr + b * on_stride + i, mask=i < N, other=0) != 0
        valid = bins >= 0
        hit = valid & on[:, None]
        safe = tl.where(valid, bins, 0)
        one = tl.full([BN, BM], 1.0, tl.float32)
        tl.atomic_add(trials_ptr + safe, one, mask=valid)
        tl.atomic_add(hits_ptr + safe, one, mask=hit)
        if SOURCE_WINDOW:
            grp = tl.load(group_ptr + safe, mask=valid, other=0)
            bfx = to_fixed(tl.load(base_ptr + safe, mask=valid, other=0.0))
            tl.atomic_add(src_ptr + grp * 3, tl.full([BN, BM], ONE, tl.int64), mask=valid)
            tl.atomic_add(src_ptr + grp * 3 + 1, bfx, mask=valid)
            tl.atomic_add(src_ptr + grp * 3 + 2, tl.full([BN, BM], ONE, tl.int64), mask=hit)
        est = tl.load(est_ptr + safe, mask=valid, other=0.0)
        sc = tl.load(scale_ptr + b * M + c, mask=c < M, other=1.0)
        un = tl.load(under_ptr + b * M + c, mask=c < M, other=0) != 0
        priced = apply_correction(est, sc[None, :], un[None, :])
        priced = tl.where(valid, priced, 0.0)
        count = tl.sum(valid.to(tl.int64), axis=0)                                  # [BM]
        hcount = tl.sum(hit.to(tl.int64), axis=0)
        pfx = tl.sum(to_fixed(priced), axis=0)
        mrow = members_ptr + b * M * 3 + c * 3
        tl.store(mrow, count.to(tl.float64), mask=c < M)
        tl.store(mrow + 1, pfx.to(tl.float64) * (1.0 / 4294967296.0), mask=c < M)
        tl.store(mrow + 2, hcount.to(tl.float64), mask=c < M)
        # depth metrics: a node with any member bin, at its depth (clamped), row 0 zero
        node = tl.max(valid.to(tl.int32), axis=1) > 0                                # [BN]
        dep = tl.load(depth_ptr + b * N + i, mask=i < N, other=0)
        dep = tl.minimum(tl.maximum(dep, 0), MAXD)
        dd = tl.arange(0, BD)
        at = (dep[None, :] == dd[:, None]) & node[None, :]                          # [BD, BN]
        nv = tl.sum(at.to(tl.float64), axis=1)
        na = tl.sum((at & on[None, :]).to(tl.float64), axis=1)
        drow = depths_ptr + b * (MAXD + 1) * 2 + dd * 2
        tl.store(drow, tl.where(dd == 0, 0.0, nv), mask=dd <= MAXD)
        tl.store(drow + 1, tl.where(dd == 0, 0.0, na), mask=dd <= MAXD)
        slot = tl.load(slot_ptr + b)
        if RC_ON:
            efx = tl.sum(to_fixed(est), axis=0)
            cf = count.to(tl.float32)
            den = tl.maximum(cf, 1.0)
            rrow = rc_ptr + slot * M * 3 + c * 3
            t = tl.load(rrow, mask=c < M, other=0.0) + tl.div_rn(cf, den)
            e = tl.load(rrow + 1, mask=c < M, other=0.0) + tl.div_rn(from_fixed(efx), den)
            h = tl.load(rrow + 2, mask=c < M, other=0.0) + tl.div_rn(hcount.to(tl.float32), den)
            half = tl.where(t > rc_window, 0.5, 1.0)
            tl.store(rrow, t * half, mask=c < M)
            tl.store(rrow + 1, e * half, mask=c < M)
            tl.store(rrow + 2, h * half, mask=c < M)
        # history: position p of the new window holds old[p + len] or committed[p + len - L]
        p = tl.arange(0, BL)
        lens = tl.load(alen_ptr + b)
        src = p + lens
        old = tl.load(htok_ptr + slot * L + src, mask=(p < L) & (src < L), other=0)
        new = tl.load(comm_ptr + b * W + (src - L), mask=(p < L) & (src >= L), other=0)
        tl.debug_barrier()
        tl.store(htok_ptr + slot * L + p, tl.where(src < L, old, new), mask=p < L)
        cnt = tl.load(hcnt_ptr + slot)
        tl.store(hcnt_ptr + slot, tl.minimum(cnt + lens, L))
        # sources: the k-th accepted non-root node's source at column k
        acc = on & (i > 0) & (i < N)
        rank = tl.cumsum(acc.to(tl.int32), axis=0) - 1
        src_tok = tl.load(source_ptr + b * N + i, mask=i < N, other=0)
        k = tl.arange(0, BN)
        hitk = (rank[None, :] == k[:, None]) & acc[None, :]                          # [k, i]
        found = tl.sum(hitk.to(tl.int32), axis=1) > 0
        val = tl.sum(tl.where(hitk, src_tok[None, :], 0), axis=1)
        tl.store(sources_ptr + b * (N - 1) + k, tl.where(found, val, -1), mask=k < N - 1)
        # expected accept length of every budget width
        q = tl.arange(0, BK)
        if HAS_GAIN:
            col = tl.load(cols_ptr + q, mask=q < K, other=-1).to(tl.int64)
        else:                                                                        # no gain curve
            col = tl.full([BK], -1, tl.int64)
        g = tl.load(gain_ptr + b * G + tl.maximum(col, 0), mask=(q < K) & (col >= 0), other=0.0)
        tl.store(expected_ptr + b * K + q, 1.0 + tl.where(col >= 0, g, 0.0), mask=q < K)


def observe_rows_triton(outcome: RoundOutcome, prices: Prices, cal: CalibrationState, gain: torch.Tensor,
                        gain_cols: torch.Tensor, commit: Commit, rc_recent: torch.Tensor, history: Windows,
                        opts: ObserveOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`observe_rows_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments, effects and results.

    Raises:
        RuntimeError: Triton is not installed.
    """
    bins, on_path, depth, source = outcome
    estimates, scale, under = prices
    trials, hits, src_recent, group, base = cal.trials, cal.hits, cal.src_recent, cal.group, cal.base
    slot_ids, committed, accept_len = commit
    hist_tokens, hist_count = history
    source_window, rc_window, max_depth = opts
    if triton is None:
        raise RuntimeError("graft observe_rows: Triton is not installed")
    b, n, m = bins.shape
    dev = bins.device
    k = gain_cols.numel()
    sources = torch.empty(b, max(n - 1, 0), dtype=torch.int64, device=dev)
    members = torch.empty(b, m, 3, dtype=torch.float64, device=dev)
    depths = torch.empty(b, max_depth + 1, 2, dtype=torch.float64, device=dev)
    expected = torch.empty(b, k, dtype=torch.float32, device=dev)
    g = gain.shape[1]
    if b > 0:
        p2 = triton.next_power_of_2
        on, on_stride = row_arg(int8_arg(on_path))   # a [B, N + 1] buffer's first N columns, in place
        _observe_kernel[(b,)](
            bins.contiguous(), on, depth.contiguous(), source.contiguous(),
            estimates, base, group, scale.contiguous().float(), int8_arg(under),
            gain.contiguous().float() if g > 0 else expected, gain_cols.contiguous(),
            slot_ids.contiguous().to(torch.int64),
            committed.contiguous().to(torch.int64), accept_len.contiguous().to(torch.int64),
            trials, hits, src_recent, rc_recent, hist_tokens, hist_count, sources, members, depths, expected,
            float(rc_window), on_stride, N=n, M=m, G=max(g, 1), K=k, W=committed.shape[1], L=hist_tokens.shape[1],
            MAXD=max_depth, HAS_GAIN=g > 0, SOURCE_WINDOW=bool(source_window), RC_ON=rc_window > 0, BN=p2(max(n, 2)),
            BM=p2(max(m, 2)), BD=p2(max_depth + 1), BK=p2(max(k, 2)), BL=p2(max(hist_tokens.shape[1], 2)),
            enable_fp_fusion=False)
    return sources, members, depths, expected


def _observe_fake(outcome: RoundOutcome, prices: Prices, cal: CalibrationState, gain: torch.Tensor,
                  gain_cols: torch.Tensor, commit: Commit, rc_recent: torch.Tensor, history: Windows,
                  opts: ObserveOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, m = outcome.bins.shape
    bins = outcome.bins
    return (bins.new_empty((b, max(n - 1, 0))), bins.new_empty((b, m, 3), dtype=torch.float64),
            bins.new_empty((b, opts.max_depth + 1, 2), dtype=torch.float64),
            bins.new_empty((b, gain_cols.numel()), dtype=torch.float32))


#: ``graft::observe_rows``: `observe_rows_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
observe_rows = fused_op("observe_rows", observe_rows_reference, _observe_fake,
                        observe_rows_triton if triton is not None else None,
                        mutates=("cal_trials", "cal_hits", "cal_src_recent", "rc_recent", "history_hist",
                                 "history_count"))
