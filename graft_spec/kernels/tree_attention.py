"""Tree attention over a paged KV cache: each tree node attends to its request's context and to its
own ancestors among the tree's nodes, in one launch.

A verify step writes a request's tree nodes (parents first, node 0 the root) as its last ``q`` keys
and values, at positions ``ctx .. ctx + q - 1`` of its sequence (``ctx = seq_len - q``); an engine's
causal kernel lets node j see every node before it. This op recomputes the attention output of the
tree rows only: key position ``p`` is visible to node j when ``p < ctx`` or ``visible[j, p - ctx]``
(`graft_spec.tree.ancestor_mask`; a node sees itself and its root, so no row is fully masked). Keys
and values are read through the block table as ``[num_blocks, block_size, H_kv, D]`` tensors of any
strides with a unit stride along D (vLLM 0.33's FlashAttention views
``kv_cache.transpose(1, 2).split(D, dim=-1)`` of its ``[num_blocks, H_kv, block_size, 2 * D]`` cache,
v1/attention/backends/flash_attn.py:1244, read in place); grouped-query heads share their KV head.

Both implementations run the same online softmax (FlashAttention's, Dao et al. 2022, Alg. 1) over
key blocks of `BLOCK_KEYS` positions in float32: per block the scores ``q . k * scale`` (masked keys
``-inf``), the running maximum ``m``, ``l = l * exp(m_old - m) + sum(exp(s - m))`` and
``acc = acc * exp(m_old - m) + exp(s - m) @ v``, then ``acc / l``. They agree to float32 rounding,
not bit for bit: the dot products and ``exp`` are each implementation's own (Triton's ``tl.dot`` in
IEEE float32 and ``exp`` on a GPU, numpy's under ``TRITON_INTERPRET=1``, torch's for the reference).

`paged_tree_attention` dispatches like every fused op (`registry.fused_op`): the Triton kernel on a
CUDA device, the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import triton
from .registry import fused_op

if triton is not None:
    import triton.language as tl

__all__ = ["BLOCK_KEYS", "PagedCache", "TreeRows", "paged_tree_attention", "paged_tree_attention_reference",
           "paged_tree_attention_triton"]

#: key positions per step of the online softmax (both implementations)
BLOCK_KEYS = 32


class PagedCache(NamedTuple):
    """A step's paged keys and values.

    Attributes:
        key_cache, value_cache: ``float[num_blocks, block_size, H_kv, D]``, the same strides, unit
            stride along D.
        block_table: ``int[B, max_blocks]`` each request's blocks, in position order (rows contiguous).
        seq_lens: ``int[B]`` keys per request, its tree's nodes included.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


class TreeRows(NamedTuple):
    """The step's tree nodes, one entry per node of every request verified as a tree.

    Attributes:
        rows: ``int64[R]`` the query row of each node; req: ``int64[R]`` its request.
        visible: ``bool[R, W]`` which of its request's tree nodes each node sees (column j = node j,
            `graft_spec.tree.ancestor_mask`; W >= the largest tree).
        tree_lens: ``int[B]`` tree nodes per request (its last ``tree_lens`` keys).
    """

    rows: torch.Tensor
    req: torch.Tensor
    visible: torch.Tensor
    tree_lens: torch.Tensor


def paged_tree_attention_reference(out: torch.Tensor, query: torch.Tensor, cache: PagedCache, trees: TreeRows,
                                   scale: float) -> None:
    """Attention of the tree rows (module docstring), written into ``out`` at ``trees.rows``.

    Args:
        out: ``float[T, H_q, D]`` the step's attention output (rows outside the trees untouched).
        query: ``float[T, H_q, D]`` the step's queries (H_q a multiple of H_kv).
        cache: the step's `PagedCache`; trees: its `TreeRows`.
        scale: the softmax scale (``1 / sqrt(D)`` for most models).
    Raises:
        ValueError: the shapes disagree.
    """
    r, hq, d, bs, hkv, rep = _shapes(out, query, cache, trees)
    if r == 0:
        return
    key_cache, value_cache, block_table, seq_lens = cache
    rows, req, visible, tree_lens = trees
    dev = query.device
    req = req.to(torch.int64)
    lens = seq_lens.to(dev, torch.int64)[req]                                      # [R]
    ctx = lens - tree_lens.to(dev, torch.int64)[req]
    q = query[rows].float().reshape(r, hkv, rep, d)                                 # [R, Hkv, rep, D]
    m = torch.full((r, hkv, rep), float("-inf"), device=dev)
    l_sum = torch.zeros(r, hkv, rep, device=dev)
    acc = torch.zeros(r, hkv, rep, d, device=dev)
    table = block_table.to(dev, torch.int64)[req]                                   # [R, max_blocks]
    top = int(lens.max())
    for n0 in range(0, top, BLOCK_KEYS):
        pos = n0 + torch.arange(BLOCK_KEYS, device=dev)                             # [K]
        inside = pos[None, :] < lens[:, None]                                       # [R, K]
        blk = table.gather(1, (pos // bs).clamp(max=table.shape[1] - 1).expand(r, -1))
        blk = torch.where(inside, blk, 0)
        off = (pos % bs).expand(r, -1)
        k = key_cache[blk, off].float()                                             # [R, K, Hkv, D]
        v = value_cache[blk, off].float()
        node = (pos[None, :] - ctx[:, None]).clamp(0, visible.shape[1] - 1)
        seen = inside & ((pos[None, :] < ctx[:, None]) | visible.gather(1, node))   # [R, K]
        s = torch.einsum("rhqd,rkhd->rhqk", q, k) * scale                            # [R, Hkv, rep, K]
        s = torch.where(seen[:, None, None, :], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("rhqk,rkhd->rhqd", p, v)
        m = m_new
    out[rows] = (acc / l_sum[..., None]).reshape(r, hq, d).to(out.dtype)


def _shapes(out: torch.Tensor, query: torch.Tensor, cache: PagedCache, trees: TreeRows) -> tuple:
    """``(R nodes, H_q, D, block_size, H_kv, H_q / H_kv)`` of a checked call (`_check`)."""
    _check(out, query, cache, trees)
    hq, d = query.shape[1], query.shape[2]
    bs, hkv = cache.key_cache.shape[1], cache.key_cache.shape[2]
    return trees.rows.shape[0], hq, d, bs, hkv, hq // hkv


def _check(out: torch.Tensor, query: torch.Tensor, cache: PagedCache, trees: TreeRows) -> None:
    key_cache, value_cache = cache.key_cache, cache.value_cache
    rows, req, visible = trees.rows, trees.req, trees.visible
    if query.dim() != 3 or out.shape != query.shape:
        raise ValueError(f"paged_tree_attention: query {tuple(query.shape)} and out {tuple(out.shape)} "
                         "must both be [T, H_q, D]")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.shape[3] != query.shape[2]:
        raise ValueError(f"paged_tree_attention: caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} "
                         f"are not [num_blocks, block_size, H_kv, {query.shape[2]}]")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError(f"paged_tree_attention: cache strides {key_cache.stride()} / {value_cache.stride()} "
                         "must agree and be 1 along D")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"paged_tree_attention: {query.shape[1]} query heads over {key_cache.shape[2]} KV heads")
    if rows.shape != req.shape or visible.dim() != 2 or visible.shape[0] != rows.shape[0]:
        raise ValueError(f"paged_tree_attention: rows {tuple(rows.shape)}, req {tuple(req.shape)} and "
                         f"visible {tuple(visible.shape)} do not describe the same tree nodes")


if triton is not None:

    @triton.jit
    def _tree_attention_kernel(out_ptr, q_ptr, k_ptr, v_ptr, table_ptr, seq_ptr, tree_ptr, rows_ptr, req_ptr,
                               vis_ptr, scale, table_stride, W, HQ, HKV, BS, D, S_BLK, S_OFF, S_HEAD,
                               REP: tl.constexpr, REP_PAD: tl.constexpr, D_PAD: tl.constexpr,
                               BLOCK_K: tl.constexpr):
        """One program per (tree node, KV head): its ``REP`` query heads against its request's keys,
        ``ceil(seq_len / BLOCK_K)`` steps of a ``[REP_PAD, D] x [D, BLOCK_K]`` score tile and a
        ``[REP_PAD, BLOCK_K] x [BLOCK_K, D]`` value tile (O(seq_len * REP * D) per program)."""
        i = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        row = tl.load(rows_ptr + i).to(tl.int64)
        b = tl.load(req_ptr + i).to(tl.int64)
        seq = tl.load(seq_ptr + b).to(tl.int64)
        ctx = seq - tl.load(tree_ptr + b).to(tl.int64)
        heads = tl.arange(0, REP_PAD)
        dims = tl.arange(0, D_PAD)
        qmask = (heads[:, None] < REP) & (dims[None, :] < D)
        q = tl.load(q_ptr + (row * HQ + h * REP + heads[:, None]) * D + dims[None, :], mask=qmask, other=0.0)
        q = q.to(tl.float32)
        m = tl.full([REP_PAD], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([REP_PAD], dtype=tl.float32)
        acc = tl.zeros([REP_PAD, D_PAD], dtype=tl.float32)
        for n0 in range(0, seq, BLOCK_K):
            pos = n0 + tl.arange(0, BLOCK_K).to(tl.int64)
            inside = pos < seq
            blk = tl.load(table_ptr + b * table_stride + pos // BS, mask=inside, other=0).to(tl.int64)
            kvmask = inside[:, None] & (dims[None, :] < D)
            offs = (blk * S_BLK + (pos % BS) * S_OFF + h * S_HEAD)[:, None] + dims[None, :]
            k = tl.load(k_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)          # [BLOCK_K, D_PAD]
            v = tl.load(v_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)
            node = tl.minimum(tl.maximum(pos - ctx, 0), W - 1)
            vis = tl.load(vis_ptr + i * W + node, mask=inside & (pos >= ctx), other=0)
            seen = inside & ((pos < ctx) | (vis != 0))
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                 # [REP_PAD, BLOCK_K]
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        res = acc / l_sum[:, None]
        tl.store(out_ptr + (row * HQ + h * REP + heads[:, None]) * D + dims[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=qmask)


def paged_tree_attention_triton(out: torch.Tensor, query: torch.Tensor, cache: PagedCache, trees: TreeRows,
                                scale: float) -> None:
    """`paged_tree_attention_reference` as one Triton launch over (tree nodes x KV heads) programs
    (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``). Same arguments and effect; ``out``,
    ``query``, the tree rows' index tensors, ``seq_lens`` and the rows of ``block_table`` must be
    contiguous (vLLM's are); the caches are read through their strides; ``visible`` is made a
    contiguous bool tensor here only when it is not one.

    Raises:
        RuntimeError: Triton is not installed; ValueError: as the reference.
    """
    if triton is None:
        raise RuntimeError("graft paged_tree_attention: Triton is not installed")
    r, hq, d, bs, hkv, rep = _shapes(out, query, cache, trees)
    if r == 0:
        return
    key_cache, value_cache, block_table, seq_lens = cache
    rows, req, visible, tree_lens = trees
    vis = visible if visible.dtype == torch.bool and visible.is_contiguous() else visible.contiguous().bool()
    d_pad = max(16, triton.next_power_of_2(d))
    _tree_attention_kernel[(r, hkv)](
        out, query, key_cache, value_cache, block_table, seq_lens, tree_lens, rows, req, vis.view(torch.int8),
        float(scale), block_table.stride(0), vis.shape[1], hq, hkv, bs, d, *key_cache.stride()[:3],
        REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D_PAD=d_pad, BLOCK_K=BLOCK_KEYS,
        num_warps=8 if d_pad >= 128 else 4)   # [BLOCK_K, 128] K and V tiles: 8 warps keep them in registers


def _paged_tree_attention_fake(out: torch.Tensor, query: torch.Tensor, cache: PagedCache, trees: TreeRows,
                               scale: float) -> None:
    return None


#: ``graft::paged_tree_attention``: `paged_tree_attention_reference`'s contract, one launch on a CUDA
#: device (or inside `fused_ops_everywhere`), the torch reference elsewhere or with
#: ``GRAFT_REFERENCE_KERNELS=1``.
paged_tree_attention = fused_op("paged_tree_attention", paged_tree_attention_reference, _paged_tree_attention_fake,
                                paged_tree_attention_triton if triton is not None else None, mutates=("out",),
                                approximate=("out",))
