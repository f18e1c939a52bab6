"""The successor table's priced candidates of a round in one kernel (retrieval/successor.py).

A fixed rank template (``T`` slots, parent slot -1 = the root) is filled under every row's root
token from the row's isolation group of the table: slot u with parent slot p and rank r gets
``table[row(token(p)), r]`` (an empty entry, -1, empties its subtree through the group's all -1
row). Every slot has its own calibration bin; its estimate goes through the row's per-request
correction of the successor member.

Reference: `successor_part_reference`, the computation of ``SuccessorSource.propose`` (device_sources.py:
`SuccessorTable.expand`, `Calibrator.successor_bins`, `numerics.correction.price`) as a function of tensors
and ints, one masked gather per template depth. Fused: `_successor_part_kernel`, one Triton program
per request: each slot walks its own path down from the root, level by level (for level j, its
ancestor at depth j is found by walking up the template), so no slot waits for another. Tokens,
bins and flags are integers; the estimate is one table read through the same float32 expression,
so the two agree exactly. The op ``graft::successor_part`` has the reference as its CPU
implementation and the kernel as its CUDA implementation; `successor_part` is registered by `registry.fused_op`.
"""

from __future__ import annotations

import torch

from ..numerics.correction import price
from ..sources import SOURCE_SUCCESSOR
from .common import int8_arg
from .dispatch import triton
from .registry import fused_op
from .successor import group_rows, table_rows
from .views import Prices, SuccessorView

if triton is not None:
    import triton.language as tl
    from .common import apply_correction

__all__ = ["successor_part", "successor_part_reference", "successor_part_triton"]

_Out = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def expand_template(roots: torch.Tensor, groups: "torch.Tensor | int", table: torch.Tensor, t_parent: torch.Tensor,
                    t_rank: torch.Tensor, t_depth: torch.Tensor, rows: int, vocab: int, levels: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The successor template filled under every root token, one gather per template depth
    (`SuccessorTable.expand`, retrieval/successor.py, which documents the rule).

    Args:
        roots: ``int64[B]``; groups: ``int64[B, 1]`` (or one int) isolation groups; table, t_parent,
            t_rank, t_depth, rows, vocab: the `SuccessorTable`'s; levels: ``max(t_depth)``.
    Returns:
        ``(tokens int64[B, T], valid bool[B, T])``: tokens 0 where not valid (an empty entry, or an
        ancestor's).
    """
    b, t, k = roots.shape[0], t_parent.shape[0], table.shape[1]
    # a negative group's root gets the empty row, so every slot below it is empty too
    root_row = table_rows(roots.to(torch.int64).reshape(b, 1), groups, rows, vocab)[0]
    safe = groups.clamp(min=0) if isinstance(groups, torch.Tensor) else max(int(groups), 0)
    flat = table.view(-1)
    toks = torch.full((b, t), -1, dtype=torch.int64, device=roots.device)
    for d in range(1, levels + 1):                                     # one gather per template depth
        if d == 1:
            prow = root_row.expand(b, t)
        else:
            par = toks[:, t_parent.clamp(min=0)]
            prow = group_rows(par, safe, rows, (par >= 0) & (par < vocab))
        toks = torch.where(t_depth == d, flat[prow * k + t_rank].to(torch.int64), toks)  # rows of empty parents: -1
    return toks.clamp(min=0), toks >= 0


def successor_part_reference(roots: torch.Tensor, groups: torch.Tensor, sampled: torch.Tensor, succ: SuccessorView,
                             prices: Prices, bin_offset: int, per_mode: int) -> _Out:
    """The successor template expanded from every root and priced (``SuccessorSource.propose``,
    device_sources.py, with `SuccessorTable.expand` of retrieval/successor.py, `Calibrator.successor_bins` and
    `numerics.correction.price`).

    Args:
        roots: ``int64[B]`` root tokens; groups: ``int64[B]`` isolation group of each row;
        sampled: ``bool[B]`` rows verified by sampling (their own bins).
        succ: the table and its template (`SuccessorTable.view`; parent slot -1 = the root,
            parents before children).
        prices: the round's `Prices` (the identity correction ``(1, False)`` prices as none).
        bin_offset: ``Calibrator.layout.offset(SOURCE_SUCCESSOR)``; per_mode: ``layout.per_mode``.
    Returns:
        ``(tokens int64[B, T], parents int64[B, T], est float32[B, T], valid bool[B, T],
        bins int64[B, T], member int64[B, T])``, a `Candidates` block (kernels/views.py): tokens 0 and
        est 0 where not valid, bins -1 where not valid, member ``SOURCE_SUCCESSOR``.
    """
    table, t_parent, t_rank, t_depth, rows, vocab, levels = succ
    est_table, scale, under = prices
    b, t = roots.shape[0], t_parent.shape[0]
    tokens, valid = expand_template(roots, groups.reshape(b, 1).to(torch.int64), table, t_parent, t_rank, t_depth,
                                    rows, vocab, levels)
    bins = (torch.arange(t, device=roots.device) + bin_offset)[None, :] + (sampled.to(torch.int64) * per_mode)[:, None]
    est = torch.where(valid, price(est_table[bins], SOURCE_SUCCESSOR, (scale, under)), 0.0)
    return (tokens, t_parent.expand(b, t).clone(), est, valid, torch.where(valid, bins, -1),
            torch.full_like(tokens, SOURCE_SUCCESSOR))


if triton is not None:
    @triton.jit
    def _successor_part_kernel(roots_ptr, groups_ptr, sampled_ptr, table_ptr, par_ptr, rank_ptr, depth_ptr,
                               est_table_ptr, scale_ptr, under_ptr,
                               tok_ptr, parents_ptr, est_ptr, valid_ptr, bins_ptr, member_ptr,
                               rows, vocab, bin_offset, per_mode,
                               T: tl.constexpr, K: tl.constexpr, M: tl.constexpr, LEVELS: tl.constexpr,
                               MEMBER: tl.constexpr, BLOCK: tl.constexpr):
        """One request per program, template slots as lanes (``BLOCK`` >= T).

        Work per program: O(T * LEVELS**2) (each slot walks up to its ancestor at every level);
        no barrier."""
        b = tl.program_id(0)
        u = tl.arange(0, BLOCK)
        live = u < T
        grp = tl.load(groups_ptr + b).to(tl.int64)
        root = tl.load(roots_ptr + b).to(tl.int64)
        dep = tl.load(depth_ptr + u, mask=live, other=0)
        cur = tl.zeros([BLOCK], dtype=tl.int64) + root               # token of the ancestor at depth j - 1
        for j in range(1, LEVELS + 1):
            a = u.to(tl.int64)                                        # the ancestor at depth j: walk up
            for _ in range(LEVELS):
                da = tl.load(depth_ptr + a, mask=live, other=0)
                pa = tl.load(par_ptr + a, mask=live, other=0)
                a = tl.where(da > j, pa, a)
            rk = tl.load(rank_ptr + a, mask=live, other=0)
            ok = (cur >= 0) & (cur < vocab) & (grp >= 0)
            row = tl.maximum(grp, 0) * (rows + 2) + tl.where(ok, cur % rows, rows)
            here = live & (dep >= j)
            nxt = tl.load(table_ptr + row * K + rk, mask=here, other=-1).to(tl.int64)
            cur = tl.where(here, nxt, cur)
        valid = live & (cur >= 0)
        s = (tl.load(sampled_ptr + b) != 0).to(tl.int64)
        bins = bin_offset + u.to(tl.int64) + s * per_mode
        base = tl.load(est_table_ptr + bins, mask=live, other=0.0)
        sc = tl.load(scale_ptr + b * M + MEMBER)
        un = tl.load(under_ptr + b * M + MEMBER) != 0
        priced = apply_correction(base, sc, un)
        out = b * T + u
        tl.store(tok_ptr + out, tl.where(valid, cur, 0), mask=live)
        tl.store(parents_ptr + out, tl.load(par_ptr + u, mask=live, other=-1), mask=live)
        tl.store(est_ptr + out, tl.where(valid, priced, 0.0), mask=live)
        tl.store(valid_ptr + out, valid.to(tl.int8), mask=live)
        tl.store(bins_ptr + out, tl.where(valid, bins, -1), mask=live)
        tl.store(member_ptr + out, tl.full([BLOCK], MEMBER, tl.int64), mask=live)


def successor_part_triton(roots: torch.Tensor, groups: torch.Tensor, sampled: torch.Tensor, succ: SuccessorView,
                          prices: Prices, bin_offset: int, per_mode: int) -> _Out:
    """`successor_part_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and results.

    Raises:
        RuntimeError: Triton is not installed.
    """
    table, t_parent, t_rank, t_depth, rows, vocab, levels = succ
    est_table, scale, under = prices
    if triton is None:
        raise RuntimeError("graft successor_part: Triton is not installed")
    b, t = roots.shape[0], t_parent.shape[0]
    dev = roots.device
    tokens = torch.empty(b, t, dtype=torch.int64, device=dev)
    parents = torch.empty_like(tokens)
    est = torch.empty(b, t, dtype=torch.float32, device=dev)
    valid = torch.empty(b, t, dtype=torch.bool, device=dev)
    bins = torch.empty_like(tokens)
    member = torch.empty_like(tokens)
    if b > 0 and t > 0:
        _successor_part_kernel[(b,)](
            roots.contiguous().to(torch.int64), groups.contiguous().to(torch.int64),
            int8_arg(sampled), table.contiguous(), t_parent.contiguous(), t_rank.contiguous(),
            t_depth.contiguous(), est_table.contiguous(), scale.contiguous().float(),
            int8_arg(under), tokens, parents, est, valid.view(torch.int8), bins, member,
            int(rows), int(vocab), int(bin_offset), int(per_mode),
            T=t, K=table.shape[1], M=scale.shape[1], LEVELS=int(levels), MEMBER=SOURCE_SUCCESSOR,
            BLOCK=triton.next_power_of_2(max(t, 2)), enable_fp_fusion=False)
    return tokens, parents, est, valid, bins, member


def _successor_part_fake(roots: torch.Tensor, groups: torch.Tensor, sampled: torch.Tensor, succ: SuccessorView,
                         prices: Prices, bin_offset: int, per_mode: int) -> _Out:
    b, t = roots.shape[0], succ.t_parent.shape[0]
    e = roots.new_empty((b, t), dtype=torch.int64)
    return (e, e.clone(), roots.new_empty((b, t), dtype=torch.float32), roots.new_empty((b, t), dtype=torch.bool),
            e.clone(), e.clone())


#: ``graft::successor_part``: `successor_part_reference`'s contract, one fused launch on a CUDA device
#: (or inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
successor_part = fused_op("successor_part", successor_part_reference, _successor_part_fake,
                          successor_part_triton if triton is not None else None)
