"""The device chain sources' priced candidates of a round in one kernel: lookup and the output index.

Lookup (numerics/lookup.py): the slot history's tail is matched at every earlier position, the
longest match (latest first) continues as a chain, wrapping around with its period when it runs
into the present. Output index (retrieval/output_ring.py): the tail of every length in
``match_lengths`` is hashed, its latest position in the ring read and verified; the longest verified
match and the longest one whose next token differs continue as two chains. Every chain node is
priced by member, depth and match length (`Calibrator.retrieval_bins`) through the row's
per-request correction.

Reference: `chain_part_reference`, the computation of ``ChainSource.propose`` (device_sources.py:
`lookup_propose`, `OutputRing.propose` as `outputs_propose_reference`, `Calibrator.retrieval_bins`,
`numerics.correction.price`) as a function of tensors and ints. Fused: `_chain_part_kernel`, one Triton program
per request: the lookup scans the window in blocks of positions, keeping for every match length the
latest position that matches at least that long; the output index verifies every tail length at
once. Everything is integer arithmetic (hashes wrap in int64 in both) except the estimate, one table
read through the same float32 expression, so the two agree exactly. The ring's write position
``total`` is a device tensor (`OutputRing.total`), read by the kernel, so a captured graph sees
inserts made after capture. The op ``graft::chain_part`` has the reference as its CPU
implementation and the kernel as its CUDA implementation; `chain_part` is registered by `registry.fused_op`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..numerics.lookup import lookup_propose
from ..numerics.bins import retrieval_bin_ids
from ..numerics.correction import price
from ..numerics.hashing import tail_hashes
from ..numerics.rows import mode_rows
from ..sources import SOURCE_LOOKUP, SOURCE_OUTPUTS
from ..tree import HASH_ADD, HASH_MIX
from .common import int8_arg
from .dispatch import triton
from .registry import fused_op
from .views import ChainOptions, Prices, RetrievalBins, RingView, Windows

if triton is not None:
    import triton.language as tl
    from .common import apply_correction

__all__ = ["chain_part", "chain_part_reference", "chain_part_triton", "outputs_propose_reference"]

#: Chains the output index proposes per row (`OutputRing.propose`): the longest verified match and
#: the longest one whose next token differs.
CHAINS = 2

_Out = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def outputs_propose_reference(win: Windows, groups: torch.Tensor, index: RingView, depth: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`OutputRing.propose` (retrieval/output_ring.py) as a function of the ring's tensors.

    Args:
        win: the rows' token windows (`Windows`, ending with the root); groups: ``int64[B]``
            isolation groups.
        index: the output index (`OutputRing.view`); depth: D, chain length (its ``depth``).
    Returns:
        ``(tokens int64[B, CHAINS, D], valid bool[B, CHAINS, D], match int64[B, CHAINS])``.
    """
    hist, count = win
    ring, tag, table, total, lengths, pow_r, pow_m, match_lengths = index
    b, length = hist.shape
    dev = hist.device
    cap = ring.shape[0]
    slots = table.shape[1]
    groups = groups.to(torch.int64)
    oldest = total - cap                                                        # positions after it are held
    kk = sum(1 for m in match_lengths if m <= length)                          # static: tails the window holds
    mm = match_lengths[kk - 1]
    lens = lengths[:kk]
    tail_rev = hist[:, length - mm:].flip(1)                                    # [B, mm], root first
    slot = tail_hashes(tail_rev, groups, lens, pow_r[:mm], pow_m[:kk]) & (slots - 1)
    ps = table[:kk].gather(1, slot.t()).t()                                     # [B, K] latest positions
    back = torch.arange(mm, device=dev)
    at = (ps[:, :, None] - back).clamp(min=0) % cap                             # [B, K, mm]
    same = (ring[at] == tail_rev[:, None, :]) | (back >= lens[:, None])       # only the first m count
    oks = ((ps >= 0) & (ps - lens + 1 > oldest) & (count[:, None] >= lens) & same.all(dim=2)
           & (tag[ps.clamp(min=0) % cap] == groups[:, None]))
    nxt = ring.gather(0, ((ps + 1).clamp(min=0) % cap).reshape(-1)).view(b, kk)
    oks = oks & (nxt >= 0) & (ps + 1 < total)                                   # a continuation exists
    ar = torch.arange(kk, device=dev)
    first = torch.where(oks, ar, -1).amax(dim=1)                                # longest verified
    first_tok = nxt.gather(1, first.clamp(min=0)[:, None])
    second = torch.where(oks & (nxt != first_tok), ar, -1).amax(dim=1)
    pick = torch.stack([first, second], 1)                                      # [B, CHAINS]
    p_sel = ps.gather(1, pick.clamp(min=0))
    match = torch.where(pick >= 0, lens[pick.clamp(min=0)], 0)
    idx = p_sel[:, :, None] + 1 + torch.arange(depth, device=dev)
    tokens = ring.gather(0, (idx.clamp(min=0) % cap).reshape(-1)).view(b, CHAINS, depth)
    live = (tokens >= 0) & (idx < total) & (match > 0)[:, :, None]
    valid = torch.cumprod(live.to(torch.int64), dim=2).bool()
    return torch.where(valid, tokens, 0), valid, match


def chain_part_reference(win: Windows, groups: torch.Tensor, sampled: torch.Tensor, prices: Prices,
                         layout: RetrievalBins, index: Optional[RingView], opts: ChainOptions) -> _Out:
    """The device chains priced (``ChainSource.propose``, device_sources.py, with `lookup_propose` of
    numerics/lookup.py, `OutputRing.propose` of retrieval/output_ring.py, `Calibrator.retrieval_bins`
    of calibration.py and `numerics.correction.price`): the lookup's chain, then the output index's
    `CHAINS`, each ``D = depth`` deep, node t of a chain at depth t + 1.

    Args:
        win: the slots' right-aligned token windows ending with the root (`Windows`, L >= 2);
            groups: ``int64[B]`` isolation groups; sampled: ``bool[B]``.
        prices: the round's `Prices` (the identity correction ``(1, False)`` prices as none).
        layout: the calibrator's `RetrievalBins`.
        index: the output index (`OutputRing.view`), or None when it is off.
        opts: `ChainOptions`: ``depth`` D, chain length (the step's ``pool - 1``; the ring's
            ``depth`` must equal it); ``lookup_max_match`` `LOOKUP_MAX_MATCH` when lookup is on, 0
            when off; the rows the output index proposes to (``retrieval.outputs_modes``).
    Returns:
        ``(tokens int64[B, C], parents int64[B, C], est float32[B, C], valid bool[B, C],
        bins int64[B, C], member int64[B, C])``, ``C = (lookup on + CHAINS * outputs on) * D``, a
        `Candidates` block (kernels/views.py); est 0 and bins -1 where not valid.
    Raises:
        ValueError: both sources off (the step has no chain part then).
    """
    est_table, scale, under = prices
    depth, lookup_max_match, outputs_greedy, outputs_sampled = opts
    chains = []                                                  # (tokens, valid, match [B, C(, D)], member)
    if lookup_max_match > 0:
        tok, valid, match = lookup_propose(win.hist, win.count, lookup_max_match, depth)
        chains.append((tok[:, None], valid[:, None], match[:, None], SOURCE_LOOKUP))
    if index is not None:
        tok, valid, match = outputs_propose_reference(win, groups, index, depth)
        rows = mode_rows((outputs_greedy, outputs_sampled), sampled)
        if rows is not None:
            valid = valid & rows[:, None, None]
        chains.append((tok, valid, match, SOURCE_OUTPUTS))
    if not chains:
        raise ValueError("graft chain_part: lookup and the output index are both off")
    tokens = torch.cat([ch[0] for ch in chains], 1)
    b, c, d = tokens.shape
    dev = tokens.device
    members = torch.cat([torch.full((b, t.shape[1] * d), m, dtype=torch.int64, device=dev)
                         for t, _, _, m in chains], 1)
    node_depth = torch.arange(1, d + 1, device=dev).repeat(c).expand(b, c * d)
    match = torch.cat([ch[2] for ch in chains], 1).repeat_interleave(d, dim=1)
    bins = retrieval_bin_ids(members, node_depth, torch.zeros(b, c * d, device=dev), match, sampled, *layout)
    valid = torch.cat([ch[1] for ch in chains], 1).reshape(b, c * d)
    est = torch.where(valid, price(est_table[bins], members, (scale, under)), 0.0)
    chain = torch.arange(-1, d - 1, device=dev)
    parents = torch.cat([torch.where(chain < 0, -1, chain + i * d) for i in range(c)]).expand(b, c * d).clone()
    return tokens.reshape(b, c * d), parents, est, valid, torch.where(valid, bins, -1), members


if triton is not None:
    @triton.jit
    def _emit_chain(tok, valid, match, c, b, s, member: tl.constexpr, t, td, est_table_ptr, scale_ptr,
                    under_ptr, rbase_ptr, logp_edges_ptr, depth_edges_ptr, match_edges_ptr,
                    tok_ptr, par_ptr, est_ptr, valid_ptr, bins_ptr, member_ptr, per_mode,
                    D: tl.constexpr, C: tl.constexpr, M: tl.constexpr, NQE: tl.constexpr, NDE: tl.constexpr,
                    NME: tl.constexpr, BE: tl.constexpr):
        """Price chain ``c`` (nodes ``t`` < D as lanes, at depth t + 1) and write it."""
        e = tl.arange(0, BE)
        qe = tl.load(logp_edges_ptr + e, mask=e < NQE, other=1.0)
        q_bin = NQE - tl.sum(((qe <= 0.0) & (e < NQE)).to(tl.int64), axis=0)              # log p = 0
        q_bin = tl.minimum(tl.maximum(q_bin, 0), NQE)
        de = tl.load(depth_edges_ptr + e, mask=e < NDE, other=0)
        dep = (t + 1).to(tl.int64)
        d_bin = tl.sum(((de[None, :] < dep[:, None]) & (e[None, :] < NDE)).to(tl.int64), axis=1)
        d_bin = tl.minimum(d_bin, NDE)
        me = tl.load(match_edges_ptr + e, mask=e < NME, other=0)
        m_bin = tl.sum(((me < tl.maximum(match, 1)) & (e < NME)).to(tl.int64), axis=0)
        m_bin = tl.minimum(m_bin, NME)
        within = (d_bin * (NQE + 1) + q_bin) * (NME + 1) + m_bin
        bins = tl.load(rbase_ptr + member) + within + s * per_mode
        base = tl.load(est_table_ptr + bins, mask=td, other=0.0)
        sc = tl.load(scale_ptr + b * M + member)
        un = tl.load(under_ptr + b * M + member) != 0
        priced = apply_correction(base, sc, un)
        out = b * C * D + c * D + t
        tl.store(tok_ptr + out, tok, mask=td)
        tl.store(par_ptr + out, tl.where(t == 0, -1, c * D + t - 1).to(tl.int64), mask=td)
        tl.store(est_ptr + out, tl.where(valid, priced, 0.0), mask=td)
        tl.store(valid_ptr + out, valid.to(tl.int8), mask=td)
        tl.store(bins_ptr + out, tl.where(valid, bins, -1), mask=td)
        tl.store(member_ptr + out, tl.zeros_like(t).to(tl.int64) + member, mask=td)

    @triton.jit
    def _chain_part_kernel(hist_ptr, count_ptr, groups_ptr, sampled_ptr, est_table_ptr, scale_ptr, under_ptr,
                           rbase_ptr, logp_edges_ptr, depth_edges_ptr, match_edges_ptr,
                           ring_ptr, tag_ptr, table_ptr, total_ptr, lengths_ptr, pow_r_ptr, pow_m_ptr,
                           tok_ptr, par_ptr, est_ptr, valid_ptr, bins_ptr, member_ptr,
                           L, cap, per_mode, hash_mix, hash_add,
                           D: tl.constexpr, C: tl.constexpr, M: tl.constexpr,
                           LOOKUP: tl.constexpr, MAXM: tl.constexpr, OUTPUTS: tl.constexpr, KK: tl.constexpr,
                           MM: tl.constexpr, SLOTS: tl.constexpr, OUT_GREEDY: tl.constexpr,
                           OUT_SAMPLED: tl.constexpr, NQE: tl.constexpr, NDE: tl.constexpr, NME: tl.constexpr,
                           BD: tl.constexpr, BJ: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                           BMM: tl.constexpr, BE: tl.constexpr, LOOKUP_MEMBER: tl.constexpr,
                           OUTPUTS_MEMBER: tl.constexpr):
        """One request per program; chain nodes as lanes (``BD`` >= D).

        Work per program: the prompt lookup's match scan O(L * MAXM) over the history row of L
        tokens in ``L / BJ`` steps; each chain O(D) nodes priced against O(edges) bin edges; no
        barrier."""
        b = tl.program_id(0)
        row = hist_ptr + b * L
        cnt = tl.load(count_ptr + b).to(tl.int64)
        grp = tl.load(groups_ptr + b).to(tl.int64)
        smp = tl.load(sampled_ptr + b) != 0
        s = smp.to(tl.int64)
        t = tl.arange(0, BD)
        td = t < D
        end = L - 1
        c = 0
        if LOOKUP:
            start = L - cnt                                          # first valid index
            r = tl.arange(0, BM)
            last = tl.full([BM], -1, tl.int64)                       # latest j with a run >= r + 1
            for lo in range(0, end, BJ):
                j = lo + tl.arange(0, BJ).to(tl.int64)
                jl = j < end
                alive = jl
                run = tl.zeros([BJ], dtype=tl.int64)
                for q in tl.static_range(MAXM):
                    w = tl.load(row + j - q, mask=jl & (j - q >= 0), other=-1)
                    tq = tl.load(row + end - q, mask=end - q >= 0, other=-1)
                    alive = alive & (w == tq) & (j - q >= start)
                    run += alive.to(tl.int64)
                hit = (run[:, None] >= (r[None, :] + 1)) & jl[:, None]
                last = tl.maximum(last, tl.max(tl.where(hit, j[:, None], -1), axis=0))
            longest = tl.max(tl.where((last >= 0) & (r < MAXM), r + 1, 0), axis=0).to(tl.int64)
            best_m = tl.minimum(longest, tl.maximum(cnt, 0))
            best_j = tl.max(tl.where(r.to(tl.int64) == best_m - 1, last, -1), axis=0)
            best_j = tl.where(best_m > 0, best_j, -1)
            period = tl.maximum(end - best_j, 1)
            idx = tl.minimum(tl.maximum(best_j + 1 + t % period, 0), end)
            ltok = tl.load(row + idx, mask=td, other=0)
            lvalid = td & (best_m > 0)
            _emit_chain(ltok, lvalid, best_m, c, b, s, LOOKUP_MEMBER, t, td, est_table_ptr, scale_ptr, under_ptr,
                        rbase_ptr, logp_edges_ptr, depth_edges_ptr, match_edges_ptr, tok_ptr, par_ptr, est_ptr,
                        valid_ptr, bins_ptr, member_ptr, per_mode, D, C, M, NQE, NDE, NME, BE)
            c = 1
        if OUTPUTS:
            total = tl.load(total_ptr)
            oldest = total - cap
            q = tl.arange(0, BK)
            qk = q < KK
            lens = tl.load(lengths_ptr + q, mask=qk, other=1)
            r2 = tl.arange(0, BMM)
            rm = r2 < MM
            tail = tl.load(row + end - r2, mask=rm, other=0)         # newest first
            prod = tail * tl.load(pow_r_ptr + r2, mask=rm, other=0)
            sums = tl.sum(tl.where((r2[None, :] < lens[:, None]) & rm[None, :], prod[None, :], 0), axis=1)
            h = (grp * hash_mix + hash_add) * tl.load(pow_m_ptr + q, mask=qk, other=0) + sums
            h = h ^ (h >> 29)
            slot = h & (SLOTS - 1)
            ps = tl.load(table_ptr + q * SLOTS + slot, mask=qk, other=-1)
            at = tl.maximum(ps[:, None] - r2[None, :], 0) % cap
            same = (tl.load(ring_ptr + at, mask=qk[:, None] & rm[None, :], other=-2) == tail[None, :]) \
                | (r2[None, :] >= lens[:, None]) | (~rm[None, :])
            all_same = tl.min(same.to(tl.int32), axis=1) == 1
            tg = tl.load(tag_ptr + tl.maximum(ps, 0) % cap, mask=qk, other=-1)
            oks = qk & (ps >= 0) & (ps - lens + 1 > oldest) & (cnt >= lens) & all_same & (tg == grp)
            nxt = tl.load(ring_ptr + tl.maximum(ps + 1, 0) % cap, mask=qk, other=-1)
            oks = oks & (nxt >= 0) & (ps + 1 < total)
            first = tl.max(tl.where(oks, q, -1), axis=0)
            first_tok = tl.sum(tl.where(q == tl.maximum(first, 0), nxt, 0), axis=0)
            second = tl.max(tl.where(oks & (nxt != first_tok), q, -1), axis=0)
            if OUT_GREEDY and OUT_SAMPLED:
                row_on = smp | (~smp)
            elif OUT_GREEDY:
                row_on = ~smp
            elif OUT_SAMPLED:
                row_on = smp
            else:
                row_on = smp & (~smp)
            for k in tl.static_range(2):
                pick = tl.where(k == 0, first, second)
                pc = tl.maximum(pick, 0)
                p_sel = tl.sum(tl.where(q == pc, ps, 0), axis=0)
                match = tl.where(pick >= 0, tl.sum(tl.where(q == pc, lens, 0), axis=0), 0).to(tl.int64)
                idx = p_sel + 1 + t
                otok = tl.load(ring_ptr + tl.maximum(idx, 0) % cap, mask=td, other=-1)
                live = (otok >= 0) & (idx < total) & (match > 0) & td
                stop = tl.min(tl.where(live, D, t), axis=0)           # first node that is not live
                ovalid = (t < stop) & td & row_on
                _emit_chain(tl.where(t < stop, otok, 0), ovalid, match, c + k, b, s, OUTPUTS_MEMBER, t, td,
                            est_table_ptr, scale_ptr, under_ptr, rbase_ptr, logp_edges_ptr, depth_edges_ptr,
                            match_edges_ptr, tok_ptr, par_ptr, est_ptr, valid_ptr, bins_ptr, member_ptr, per_mode,
                            D, C, M, NQE, NDE, NME, BE)


def chain_part_triton(win: Windows, groups: torch.Tensor, sampled: torch.Tensor, prices: Prices,
                      layout: RetrievalBins, index: Optional[RingView], opts: ChainOptions) -> _Out:
    """`chain_part_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and results.

    Raises:
        RuntimeError: Triton is not installed. ValueError: both sources off.
    """
    hist, count = win
    est_table, scale, under = prices
    retrieval_base, logp_edges, depth_edges, match_edges, per_mode = layout
    ring, ring_tag, ring_table, ring_total, ring_lengths, ring_pow_r, ring_pow_m, match_lengths = (
        index if index is not None else (None,) * 7 + ([],))
    depth, lookup_max_match, outputs_greedy, outputs_sampled = opts
    if triton is None:
        raise RuntimeError("graft chain_part: Triton is not installed")
    lookup, outputs = lookup_max_match > 0, ring is not None
    if not (lookup or outputs):
        raise ValueError("graft chain_part: lookup and the output index are both off")
    b, length = hist.shape
    dev = hist.device
    chains = int(lookup) + CHAINS * int(outputs)
    width = chains * depth
    tokens = torch.empty(b, width, dtype=torch.int64, device=dev)
    parents, bins, member = torch.empty_like(tokens), torch.empty_like(tokens), torch.empty_like(tokens)
    est = torch.empty(b, width, dtype=torch.float32, device=dev)
    valid = torch.empty(b, width, dtype=torch.bool, device=dev)
    kk = sum(1 for m in match_lengths if m <= length) if outputs else 1
    mm = match_lengths[kk - 1] if outputs else 1
    hist64 = hist.contiguous().to(torch.int64)
    if b > 0 and width > 0:
        p2 = triton.next_power_of_2
        dummy = hist64
        _chain_part_kernel[(b,)](
            hist64, count.contiguous().to(torch.int64), groups.contiguous().to(torch.int64),
            int8_arg(sampled), est_table.contiguous(), scale.contiguous().float(),
            int8_arg(under), retrieval_base.contiguous().to(torch.int64),
            logp_edges.contiguous().float(), depth_edges.contiguous().to(torch.int64),
            match_edges.contiguous().to(torch.int64),
            *((ring.contiguous(), ring_tag.contiguous(), ring_table.contiguous(), ring_total.reshape(1),
               ring_lengths.contiguous(), ring_pow_r.contiguous(), ring_pow_m.contiguous()) if outputs
              else (dummy,) * 7),
            tokens, parents, est, valid.view(torch.int8), bins, member,
            length, ring.shape[0] if outputs else 1, int(per_mode), HASH_MIX, HASH_ADD,
            D=depth, C=chains, M=scale.shape[1], LOOKUP=lookup, MAXM=max(int(lookup_max_match), 1),
            OUTPUTS=outputs, KK=kk, MM=mm, SLOTS=ring_table.shape[1] if outputs else 1,
            OUT_GREEDY=bool(outputs_greedy), OUT_SAMPLED=bool(outputs_sampled), NQE=logp_edges.numel(),
            NDE=depth_edges.numel(), NME=match_edges.numel(), BD=p2(max(depth, 2)),
            BJ=min(256, p2(max(length, 2))), BM=p2(max(int(lookup_max_match), 2)), BK=p2(max(kk, 2)),
            BMM=p2(max(mm, 2)), BE=p2(max(logp_edges.numel(), depth_edges.numel(), match_edges.numel(), 2)),
            LOOKUP_MEMBER=SOURCE_LOOKUP, OUTPUTS_MEMBER=SOURCE_OUTPUTS, enable_fp_fusion=False)
    return tokens, parents, est, valid, bins, member


def _chain_part_fake(win: Windows, groups: torch.Tensor, sampled: torch.Tensor, prices: Prices,
                     layout: RetrievalBins, index: Optional[RingView], opts: ChainOptions) -> _Out:
    b = win.hist.shape[0]
    width = (int(opts.lookup_max_match > 0) + CHAINS * int(index is not None)) * opts.depth
    e = win.hist.new_empty((b, width), dtype=torch.int64)
    return (e, e.clone(), win.hist.new_empty((b, width), dtype=torch.float32),
            win.hist.new_empty((b, width), dtype=torch.bool), e.clone(), e.clone())


#: ``graft::chain_part``: `chain_part_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
chain_part = fused_op("chain_part", chain_part_reference, _chain_part_fake,
                      chain_part_triton if triton is not None else None)
