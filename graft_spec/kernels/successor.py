"""The successor table's update in one kernel (retrieval/successor.py, paper Eq. 12/14).

Every verified non-padding node overwrites its token's row (in its isolation group) with the
target's top-k after it; of several nodes with the same row, the one with the largest flat index
wins. The reference (`successor_update_reference`) finds the last writers with a stable sort
and writes them with ``index_copy_`` through a dump row; the kernel (`_successor_kernel`, one
program per block of nodes) lets a node write when no later valid node has its row, so the writes
are disjoint and the result does not depend on the device's order. The op
``graft::successor_update`` has the reference as its CPU implementation and the kernel as its CUDA
implementation; `successor_update` is registered by `registry.fused_op`.
"""

from __future__ import annotations

import torch

from .common import int8_arg
from .dispatch import triton
from .registry import fused_op

if triton is not None:
    import triton.language as tl

__all__ = ["PRIVATE_GROUP", "successor_update", "successor_update_reference", "successor_update_triton", "table_rows", "group_rows",
           "last_writer"]


#: The isolation group of a request that shares no cross-request state (`graft_spec.pipeline.GroupMap`):
#: negative, so the successor table neither proposes to its rows nor learns from them (`table_rows`),
#: and no output-index position carries it as a tag.
PRIVATE_GROUP = -2


def table_rows(tokens: torch.Tensor, groups: torch.Tensor, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row int64, ok bool)`` of ``tokens`` in ``groups`` (broadcast): row ``t mod rows`` of the
    group's block of ``rows + 2``; tokens outside ``[0, vocab)`` and every token of a negative group
    (a request without one, `graft_spec.pipeline.PRIVATE_GROUP`) are not ok and get group 0's empty row."""
    g = groups if isinstance(groups, torch.Tensor) else torch.as_tensor(groups, device=tokens.device)
    ok = (tokens >= 0) & (tokens < vocab) & (g >= 0)
    return group_rows(tokens, g.clamp(min=0), rows, ok), ok


def group_rows(tokens: torch.Tensor, groups: torch.Tensor, rows: int, ok: torch.Tensor) -> torch.Tensor:
    """`table_rows`' rows for groups known to be >= 0 and a given ``ok``: row ``t mod rows`` of the
    group's block where ok, the block's empty row elsewhere."""
    return groups * (rows + 2) + torch.where(ok, tokens % rows, rows)


def last_writer(row: torch.Tensor, ok: torch.Tensor, dump: int) -> torch.Tensor:
    """``row`` ``int64[M]`` with every entry but the last ok occurrence of each row redirected to
    ``dump`` (a stable sort; no host read)."""
    m = row.shape[0]
    key = torch.where(ok, row, dump) * (m + 1) + torch.arange(m, device=row.device)
    order = torch.argsort(key)
    srt = torch.where(ok, row, dump)[order]
    last = torch.cat([srt[1:] != srt[:-1], torch.ones(1, dtype=torch.bool, device=row.device)])
    return torch.full_like(row, dump).scatter_(0, order, torch.where(last, srt, dump))


def successor_update_reference(table: torch.Tensor, tokens: torch.Tensor, topk_ids: torch.Tensor,
                               valid: torch.Tensor, groups: torch.Tensor, rows: int, vocab: int,
                               invalid: int = 0) -> None:
    """Overwrite the rows of the valid nodes, in place.

    Args:
        table: ``int32[G * (rows + 2), k]``; rows R and R + 1 of every group stay -1.
        tokens: ``int64[B, N]`` node tokens (M = B * N nodes in flat order); topk_ids: ``int64[M, k']``
            the target's top-k after each, best first (k' > k truncated, k' < k leaves ranks at -1).
        valid: ``bool`` or ``int64[B, N]``: a node learns where ``valid != invalid`` (a mask with
            ``invalid`` 0, or the nodes' sources with ``invalid`` = ``SOURCE_PADDING``).
        groups: ``int64[B]`` isolation group of each row's nodes (a negative group's nodes are never
            written).
        rows: R, rows per group; vocab: tokens outside ``[0, vocab)`` are never written.
        invalid: the value of ``valid`` that marks a node that does not learn.
    """
    b, n = tokens.shape
    m, k = b * n, table.shape[1]
    row, ok = table_rows(tokens.reshape(m), groups[:, None].expand(b, n).reshape(m), rows, vocab)
    learn = valid.reshape(m).to(torch.int64) != invalid
    dest = last_writer(row, ok & learn, rows + 1)              # group 0's dump row
    new = torch.full((m, k), -1, dtype=torch.int32, device=table.device)
    kk = min(k, topk_ids.shape[-1])
    new[:, :kk] = topk_ids.reshape(m, -1)[:, :kk].to(torch.int32)
    table.index_copy_(0, dest, new)
    table.view(-1, rows + 2, k)[:, rows:].fill_(-1)


if triton is not None:
    @triton.jit
    def _successor_kernel(table_ptr, tok_ptr, topk_ptr, valid_ptr, group_ptr, M, N, group_stride, rows, vocab, invalid,
                          KP: tl.constexpr, K: tl.constexpr, KK: tl.constexpr, BI: tl.constexpr,
                          BJ: tl.constexpr, BK: tl.constexpr):
        """Nodes ``BI`` per program (node ``i`` of row ``i // N``); a node writes when no later valid
        node shares its row.

        Work per program: O(BI * M) row comparisons against the M nodes in ``M / BJ`` steps, then
        O(BI * K) table writes; ``ceil(M / BI)`` programs."""
        i = tl.program_id(0) * BI + tl.arange(0, BI)
        tok = tl.load(tok_ptr + i, mask=i < M, other=-1)
        grp = tl.load(group_ptr + (i // N) * group_stride, mask=i < M, other=0)
        ok = (tok >= 0) & (tok < vocab) & (tl.load(valid_ptr + i, mask=i < M, other=invalid) != invalid) & (i < M)
        ok = ok & (grp >= 0)
        row = tl.maximum(grp, 0) * (rows + 2) + tl.where(ok, tok % rows, rows)
        later = tl.zeros([BI], dtype=tl.int32)
        for start in range(0, M, BJ):
            j = start + tl.arange(0, BJ)
            tj = tl.load(tok_ptr + j, mask=j < M, other=-1)
            gj = tl.load(group_ptr + (j // N) * group_stride, mask=j < M, other=0)
            okj = (tj >= 0) & (tj < vocab) & (tl.load(valid_ptr + j, mask=j < M, other=invalid) != invalid)
            okj = okj & (j < M) & (gj >= 0)
            rj = tl.maximum(gj, 0) * (rows + 2) + tl.where(okj, tj % rows, rows)
            same = (rj[None, :] == row[:, None]) & okj[None, :] & (j[None, :] > i[:, None])
            later += tl.sum(same.to(tl.int32), axis=1)
        write = ok & (later == 0)
        c = tl.arange(0, BK)
        vals = tl.load(topk_ptr + i[:, None] * KP + c[None, :], mask=(i[:, None] < M) & (c[None, :] < KK), other=-1)
        tl.store(table_ptr + row[:, None] * K + c[None, :], vals.to(tl.int32),
                 mask=write[:, None] & (c[None, :] < K))


def successor_update_triton(table, tokens, topk_ids, valid, groups, rows: int, vocab: int, invalid: int = 0) -> None:
    """`successor_update_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and effects; the inputs are read in place (``groups``
    through its stride: a packed host block's column).

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("graft successor_update: Triton is not installed")
    b, n = tokens.shape
    m, k = b * n, table.shape[1]
    if m == 0:
        return
    topk = topk_ids.reshape(m, -1).contiguous()
    bi = 32
    _successor_kernel[(triton.cdiv(m, bi),)](table, tokens.contiguous(), topk,
                                            int8_arg(valid) if valid.dtype == torch.bool else valid.contiguous(),
                                            groups, m, n, groups.stride(0), rows, vocab, int(invalid),
                                            KP=topk.shape[1], K=k, KK=min(k, topk.shape[1]), BI=bi,
                                            BJ=128, BK=triton.next_power_of_2(max(k, 2)))


def _successor_fake(table: torch.Tensor, tokens: torch.Tensor, topk_ids: torch.Tensor, valid: torch.Tensor,
                    groups: torch.Tensor, rows: int, vocab: int, invalid: int = 0) -> None:
    return None


#: ``graft::successor_update``: `successor_update_reference`'s contract, one fused launch on a CUDA
#: device (or inside `fused_ops_everywhere`), the torch reference elsewhere or with
#: ``GRAFT_REFERENCE_KERNELS=1``.
successor_update = fused_op("successor_update", successor_update_reference, _successor_fake,
                            successor_update_triton if triton is not None else None, mutates=("table",))
