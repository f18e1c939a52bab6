"""The calibrator's estimate table recomputed in one kernel (calibration.py `Calibrator.refresh`).

After the counts of a round are in (observe.py), the refresh halves the counts of bins past their
memory and of the source window past its width, recomputes every bin's posterior mean, scales the
agreement bins' prior by their block's record, chains the retrieval bins' priors along depth, and
writes the bin estimates and the source-corrected table into their persistent buffers.

Reference: `refresh_reference` (torch). Fused: `_refresh_kernel`, one launch of many programs, each
owning a disjoint group of bins (a retrieval chain row, an agreement mode's block, a block of the
other bins), so they need no barrier between them; the chained prior's log-depth scan runs through
the program's scratch rows with the same operations in the same order, and the agreement
block's sums are int64 fixed-point sums (calibration.py `FIXED_ONE`), so the two agree bit for bit
(the kernel is compiled without fused multiply-add). The op ``graft::refresh_table`` has the
reference as its CPU implementation and the kernel as its CUDA implementation; `refresh_table`
is registered by `registry.fused_op`.
"""

from __future__ import annotations

import torch

from ..numerics import correction, fixed
from ..numerics.fixed import FIXED_ONE
from .dispatch import triton
from .registry import fused_op
from .views import CalibrationState, RefreshIndex, RefreshOptions

if triton is not None:
    import triton.language as tl
    from .common import apply_correction, from_fixed, linear_correction, to_fixed

__all__ = ["refresh_table", "refresh_reference", "refresh_triton"]


def refresh_reference(cal: CalibrationState, index: RefreshIndex, opts: RefreshOptions) -> None:
    """Halve and re-estimate, in place.

    Args:
        cal: the calibrator's tables (`CalibrationState`): ``hits``, ``trials`` halved where trials
            > ``halve_at``; ``src_recent`` rows halved where their trials exceed ``source_window``
            (0 = no source correction); ``base`` and ``table`` written: the bin estimates and the
            source-corrected table.
        index: the bin groups (`RefreshIndex`).
        opts: `RefreshOptions`: ``w`` the prior's pseudo-trials; ``pseudo_trials`` the source
            correction's.
    Source: calibration.py (`Calibrator.refresh`, module docstring).
    """
    hits, trials, prior, src_recent, group, base, table = cal
    agree_idx, retr_idx, chain_weight = index.agree_idx, index.retr_idx, index.chain_weight
    w, halve_at, source_window, pseudo_trials = opts
    half = torch.where(trials > halve_at, 0.5, 1.0)
    trials.mul_(half)
    hits.mul_(half)
    if source_window > 0:
        src_recent.copy_(torch.where(src_recent[:, :1] > int(source_window * FIXED_ONE), src_recent >> 1, src_recent))
    est = (hits + w * prior) / (trials + w)
    # agreement bins: the prior scaled by the block's observed / expected hits (per mode)
    ah, at, ap = hits[agree_idx], trials[agree_idx], prior[agree_idx]
    ratio = ((fixed.from_fixed(fixed.to_fixed(ah).sum(1, keepdim=True)) + 1.0)
             / (fixed.from_fixed(fixed.to_fixed(at * ap).sum(1, keepdim=True)) + 1.0))
    est = est.index_copy(0, agree_idx.reshape(-1), ((ah + w * (ap * ratio).clamp(max=0.99)) / (at + w)).reshape(-1))
    # retrieval bins: depth bin d's estimate is a_d + b_d * (bin d-1's), composed by a log-depth scan
    den = trials[retr_idx] + w
    a = torch.cat([est[retr_idx[:, :, :1]], hits[retr_idx[:, :, 1:]] / den[:, :, 1:]], 2)
    b = chain_weight / den
    d = a.shape[2]
    shift = 1
    while shift < d:                                   # fixed count: ceil(log2 D) rounds
        a = a + b * torch.nn.functional.pad(a, (0, 0, shift, 0))[:, :, :d]
        if shift * 2 < d:
            b = b * torch.nn.functional.pad(b, (0, 0, shift, 0), value=1.0)[:, :, :d]
        shift *= 2
    est = est.index_copy(0, retr_idx.reshape(-1), a.reshape(-1))
    est = torch.where(torch.arange(est.numel(), device=est.device) == est.numel() - 1, 0.0, est)
    base.copy_(est)
    if source_window > 0:
        scale, under = correction.linear_correction(*fixed.from_fixed(src_recent).unbind(1), pseudo_trials)
        est = correction.apply_correction(est, scale[group], under[group])
    table.copy_(est)


if triton is not None:
    @triton.jit
    def _fx_sum(x):
        return tl.sum(to_fixed(x), axis=0)

    @triton.jit
    def _halve(hits_ptr, trials_ptr, i, live, halve_at):
        """A block of bins' counts halved past ``halve_at``, written back: ``(hits, trials)``."""
        t = tl.load(trials_ptr + i, mask=live, other=0.0)
        h = tl.load(hits_ptr + i, mask=live, other=0.0)
        half = tl.where(t > halve_at, 0.5, 1.0)
        t = t * half
        h = h * half
        tl.store(trials_ptr + i, t, mask=live)
        tl.store(hits_ptr + i, h, mask=live)
        return h, t

    @triton.jit
    def _write(base_ptr, table_ptr, src_ptr, group_ptr, i, live, est, window_fx, pseudo, S1: tl.constexpr,
               WINDOW_ON: tl.constexpr):
        """Bin estimates into ``base`` (the dump bin: 0) and, source-corrected by the halved source
        windows (computed here from the rows as they were before this launch), into ``table``."""
        est = tl.where(i == S1 - 1, 0.0, est)
        tl.store(base_ptr + i, est, mask=live)
        if WINDOW_ON:
            g = tl.load(group_ptr + i, mask=live, other=0)
            tr = tl.load(src_ptr + g * 3, mask=live, other=0)
            ev = tl.load(src_ptr + g * 3 + 1, mask=live, other=0)
            hv = tl.load(src_ptr + g * 3 + 2, mask=live, other=0)
            over = tr > window_fx
            sc, under = linear_correction(from_fixed(tl.where(over, tr >> 1, tr)),
                                          from_fixed(tl.where(over, ev >> 1, ev)),
                                          from_fixed(tl.where(over, hv >> 1, hv)), pseudo)
            est = apply_correction(est, sc, under)
        tl.store(table_ptr + i, est, mask=live)

    @triton.jit
    def _chain(hits_ptr, trials_ptr, prior_ptr, src_ptr, group_ptr, retr_ptr, cw_ptr, base_ptr, table_ptr,
               scratch_ptr, row, w, halve_at, window_fx, pseudo, S1: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
               WINDOW_ON: tl.constexpr, BDD: tl.constexpr, BP: tl.constexpr):
        """A retrieval chain row: depth bin d's estimate is a_d + b_d * (bin d-1's), composed by a
        log-depth scan through the row's scratch."""
        dd = tl.arange(0, BDD)
        pp = tl.arange(0, BP)
        live = (dd[:, None] < D) & (pp[None, :] < P)
        idx = tl.load(retr_ptr + row * D * P + dd[:, None] * P + pp[None, :], mask=live, other=0)
        h, t = _halve(hits_ptr, trials_ptr, idx, live, halve_at)
        den = t + w
        pr = tl.load(prior_ptr + idx, mask=live, other=0.0)
        first = tl.where(idx == S1 - 1, 0.0, tl.div_rn(h + w * pr, den))
        a = tl.where(dd[:, None] == 0, first, tl.div_rn(h, den))
        cw = tl.load(cw_ptr + dd, mask=dd < D, other=0.0)
        bb = tl.div_rn(cw[:, None], den)
        sa = scratch_ptr + row * (2 * D * P) + dd[:, None] * P + pp[None, :]
        sb = sa + D * P
        shift = 1
        while shift < D:
            tl.debug_barrier()
            tl.store(sa, a, mask=live)
            tl.store(sb, bb, mask=live)
            tl.debug_barrier()
            up = live & (dd[:, None] >= shift)
            a_up = tl.load(sa - shift * P, mask=up, other=0.0)
            b_up = tl.load(sb - shift * P, mask=up, other=1.0)
            a = a + bb * a_up
            if shift * 2 < D:
                bb = bb * b_up
            shift *= 2
        _write(base_ptr, table_ptr, src_ptr, group_ptr, idx, live, a, window_fx, pseudo, S1, WINDOW_ON)

    @triton.jit
    def _agreement(hits_ptr, trials_ptr, prior_ptr, src_ptr, group_ptr, agree_ptr, base_ptr, table_ptr, mode, w,
                   halve_at, window_fx, pseudo, S1: tl.constexpr, A: tl.constexpr, WINDOW_ON: tl.constexpr,
                   BA: tl.constexpr):
        """The agreement bins of one mode: the prior scaled by the block's observed / expected hits."""
        q = tl.arange(0, BA)
        live = q < A
        ai = tl.load(agree_ptr + mode * A + q, mask=live, other=0)
        ah, at = _halve(hits_ptr, trials_ptr, ai, live, halve_at)
        ap = tl.load(prior_ptr + ai, mask=live, other=0.0)
        ratio = tl.div_rn(from_fixed(_fx_sum(ah)) + 1.0, from_fixed(_fx_sum(at * ap)) + 1.0)
        val = tl.div_rn(ah + w * tl.minimum(ap * ratio, 0.99), at + w)
        _write(base_ptr, table_ptr, src_ptr, group_ptr, ai, live, val, window_fx, pseudo, S1, WINDOW_ON)

    @triton.jit
    def _plain(hits_ptr, trials_ptr, prior_ptr, src_ptr, group_ptr, plain_ptr, base_ptr, table_ptr, block, w,
               halve_at, window_fx, pseudo, S1: tl.constexpr, NP: tl.constexpr, WINDOW_ON: tl.constexpr,
               BLOCK: tl.constexpr):
        """A block of the other bins: the posterior mean."""
        j = block * BLOCK + tl.arange(0, BLOCK)
        live = j < NP
        i = tl.load(plain_ptr + j, mask=live, other=0)
        h, t = _halve(hits_ptr, trials_ptr, i, live, halve_at)
        pr = tl.load(prior_ptr + i, mask=live, other=0.0)
        _write(base_ptr, table_ptr, src_ptr, group_ptr, i, live, tl.div_rn(h + w * pr, t + w), window_fx, pseudo, S1,
               WINDOW_ON)

    @triton.jit
    def _refresh_kernel(hits_ptr, trials_ptr, prior_ptr, src_ptr, group_ptr, agree_ptr, retr_ptr, cw_ptr,
                        plain_ptr, arrivals_ptr, base_ptr, table_ptr, scratch_ptr, w, halve_at, window_fx, pseudo,
                        S1: tl.constexpr, NR: tl.constexpr, A: tl.constexpr, RM: tl.constexpr,
                        D: tl.constexpr, P: tl.constexpr, NP: tl.constexpr, WINDOW_ON: tl.constexpr,
                        BLOCK: tl.constexpr, BR: tl.constexpr, BA: tl.constexpr, BDD: tl.constexpr,
                        BP: tl.constexpr):
        """One program per retrieval chain row (programs ``0 .. RM - 1``, `_chain`), per agreement
        mode (``RM``, ``RM + 1``, `_agreement`) and per ``BLOCK`` of the other bins (the rest,
        `_plain`); each halves, estimates and writes its own bins, so no program reads another's.
        The source windows are halved by the last program to arrive (an atomic count of the programs
        that have read them, which that program resets to 0).

        Work per program: a chain row O(D * P) in ceil(log2 D) barriered scan rounds; an agreement
        mode O(A) and two reductions; a plain block O(BLOCK); each O(its bins) gathers of the
        source windows."""
        pid = tl.program_id(0)
        if pid < RM:
            _chain(hits_ptr, trials_ptr, prior_ptr, src_ptr, group_ptr, retr_ptr, cw_ptr, base_ptr, table_ptr,
                   scratch_ptr, pid, w, halve_at, window_fx, pseudo, S1, D, P, WINDOW_ON, BDD, BP)
        elif pid < RM + 2:
            _agreement(hits_ptr, trials_ptr, prior_ptr, src_ptr, group_ptr, agree_ptr, base_ptr, table_ptr, pid - RM,
                       w, halve_at, window_fx, pseudo, S1, A, WINDOW_ON, BA)
        else:
            _plain(hits_ptr, trials_ptr, prior_ptr, src_ptr, group_ptr, plain_ptr, base_ptr, table_ptr,
                   pid - RM - 2, w, halve_at, window_fx, pseudo, S1, NP, WINDOW_ON, BLOCK)
        if WINDOW_ON:   # every program has read the windows: the last one halves them
            tl.debug_barrier()                      # (this program's reads are done)
            last = tl.atomic_add(arrivals_ptr, 1) == tl.num_programs(0) - 1
            r = tl.arange(0, BR)
            rows = (r < NR) & last
            tr = tl.load(src_ptr + r * 3, mask=rows, other=0, volatile=True)
            ev = tl.load(src_ptr + r * 3 + 1, mask=rows, other=0, volatile=True)
            hv = tl.load(src_ptr + r * 3 + 2, mask=rows, other=0, volatile=True)
            over = tr > window_fx
            tl.store(src_ptr + r * 3, tl.where(over, tr >> 1, tr), mask=rows)
            tl.store(src_ptr + r * 3 + 1, tl.where(over, ev >> 1, ev), mask=rows)
            tl.store(src_ptr + r * 3 + 2, tl.where(over, hv >> 1, hv), mask=rows)
            tl.atomic_xchg(arrivals_ptr, 0, mask=last)


def refresh_triton(cal: CalibrationState, index: RefreshIndex, opts: RefreshOptions) -> None:
    """`refresh_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``) of ``2 R + 2 + ceil(K / 256)`` programs (`_refresh_kernel`). Same
    arguments and effects; ``index.arrivals`` is 0 again after the launch.

    Raises:
        RuntimeError: Triton is not installed.
    """
    hits, trials, prior, src_recent, group, base, table = cal
    agree_idx, retr_idx, chain_weight, plain_idx, arrivals = index
    w, halve_at, source_window, pseudo_trials = opts
    if triton is None:
        raise RuntimeError("graft refresh_table: Triton is not installed")
    _, rm, d, p = retr_idx.shape
    scratch = torch.empty(2 * rm, 2 * d * p, dtype=torch.float32, device=hits.device)
    p2 = triton.next_power_of_2
    block = 256
    np_ = plain_idx.numel()
    _refresh_kernel[(2 * rm + 2 + triton.cdiv(np_, block),)](
        hits, trials, prior, src_recent, group, agree_idx, retr_idx, chain_weight, plain_idx, arrivals, base, table,
        scratch, float(w), float(halve_at), int(source_window * FIXED_ONE), float(pseudo_trials), S1=hits.numel(),
        NR=src_recent.shape[0], A=agree_idx.shape[1], RM=2 * rm, D=d, P=p, NP=np_, WINDOW_ON=source_window > 0,
        BLOCK=block, BR=p2(src_recent.shape[0]), BA=p2(max(agree_idx.shape[1], 2)), BDD=p2(max(d, 2)),
        BP=p2(max(p, 2)), enable_fp_fusion=False)


def _refresh_fake(cal: CalibrationState, index: RefreshIndex, opts: RefreshOptions) -> None:
    return None


#: ``graft::refresh_table``: `refresh_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
refresh_table = fused_op("refresh_table", refresh_reference, _refresh_fake,
                         refresh_triton if triton is not None else None,
                         mutates=("cal_hits", "cal_trials", "cal_src_recent", "cal_base", "cal_table",
                                  "index_arrivals"))
