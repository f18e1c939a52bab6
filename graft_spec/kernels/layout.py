"""The verify layout of a tree in one kernel: depth, positions, ancestor mask and sibling links.

Reference: `layout_reference` (pointer jumping over ``[B, N]`` tensors, graft_spec/tree.py). Fused:
`_layout_kernel`, one Triton program per request that walks every node's ancestors with a fixed N
steps (parents < own index, so no path is longer than N) and compares the parent row with itself
for the sibling links. The outputs are integers and booleans, so the two agree exactly.

The op ``graft::tree_layout`` (`registry.fused_op`) has the reference as its CPU implementation
and the Triton kernel as its CUDA implementation; on CPU the step runs the reference directly.
Source of the output contract: SGLang's ``build_tree_kernel_efficient`` (``eagle_utils.py:138``;
``retrive_next_token`` / ``retrive_next_sibling``).
"""

from __future__ import annotations

import torch

from ..tree import ancestor_mask, node_depths, pointer_jumps, sibling_links
from .dispatch import triton
from .registry import fused_op

__all__ = ["layout_reference", "layout_triton", "tree_layout"]

if triton is not None:
    import triton.language as tl


def layout_reference(parents: torch.Tensor, seq_lens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verify layout of trees ``parents`` ``int64[B, N]`` (-1 = root, parent < own index).

    Args:
        parents: ``int64[B, N]``.
        seq_lens: ``int64[B]`` committed tokens before each root.
    Returns:
        ``(depth int64[B, N], positions int64[B, N] = seq_len + depth, mask bool[B, N, N] (j == i or
        j an ancestor of i), first_child int64[B, N], next_sibling int64[B, N])``, -1 where none.
    """
    jumps = pointer_jumps(parents)
    depth = node_depths(parents, jumps)
    first, nxt = sibling_links(parents)
    return depth, seq_lens.to(torch.int64)[:, None] + depth, ancestor_mask(parents, jumps), first, nxt


if triton is not None:
    @triton.jit
    def _layout_kernel(parents_ptr, seq_lens_ptr, depth_ptr, pos_ptr, mask_ptr, first_ptr, next_ptr,
                       N: tl.constexpr, BLOCK: tl.constexpr):
        """One request per program: ``BLOCK`` >= N nodes as rows (i) and columns (j).

        Work per program: O(N**2) per step of the N-step ancestor walk (O(N**3) in all, on an
        ``[BLOCK, BLOCK]`` tile), O(N**2) for the sibling links."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        j = tl.arange(0, BLOCK)
        live_i = i < N
        live_j = j < N
        row = parents_ptr + b * N
        par_i = tl.load(row + i, mask=live_i, other=-1)
        par_j = tl.load(row + j, mask=live_j, other=-2)
        # ancestors: walk N steps up from every node, marking each ancestor's column
        anc = (i[:, None] == j[None, :]) & live_i[:, None] & live_j[None, :]
        depth = tl.zeros([BLOCK], dtype=tl.int64)
        cur = par_i
        for _ in range(N):
            up = cur >= 0
            anc = anc | ((cur[:, None] == j[None, :]) & up[:, None])
            depth += up.to(tl.int64)
            cur = tl.load(row + tl.where(up, cur, 0), mask=up, other=-1)
        seq = tl.load(seq_lens_ptr + b).to(tl.int64)
        tl.store(depth_ptr + b * N + i, depth, mask=live_i)
        tl.store(pos_ptr + b * N + i, seq + depth, mask=live_i)
        out = mask_ptr + b * N * N + i[:, None] * N + j[None, :]
        tl.store(out, anc, mask=live_i[:, None] & live_j[None, :])
        # first child of i: the smallest j whose parent is i
        big = tl.full([BLOCK, BLOCK], N, dtype=tl.int64)
        jj = j[None, :].to(tl.int64) + tl.zeros([BLOCK, BLOCK], dtype=tl.int64)
        child = (par_j[None, :] == i[:, None]) & live_j[None, :]
        first = tl.min(tl.where(child, jj, big), axis=1)
        tl.store(first_ptr + b * N + i, tl.where(first == N, -1, first), mask=live_i)
        # next sibling of i: the smallest j > i with the same parent (the root has none)
        same = (par_j[None, :] == par_i[:, None]) & (j[None, :] > i[:, None]) & live_j[None, :]
        nxt = tl.min(tl.where(same, jj, big), axis=1)
        nxt = tl.where((nxt == N) | (i == 0), -1, nxt)
        tl.store(next_ptr + b * N + i, nxt, mask=live_i)


def layout_triton(parents: torch.Tensor, seq_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layout_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and results.

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("graft tree_layout: Triton is not installed")
    parents = parents.contiguous().to(torch.int64)
    b, n = parents.shape
    dev = parents.device
    depth = torch.empty(b, n, dtype=torch.int64, device=dev)
    pos = torch.empty_like(depth)
    mask = torch.empty(b, n, n, dtype=torch.bool, device=dev)
    first = torch.empty_like(depth)
    nxt = torch.empty_like(depth)
    if b > 0:
        _layout_kernel[(b,)](parents, seq_lens.contiguous().to(torch.int64), depth, pos, mask, first, nxt,
                             N=n, BLOCK=triton.next_power_of_2(max(n, 2)))
    return depth, pos, mask, first, nxt


def _layout_fake(parents: torch.Tensor, seq_lens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n = parents.shape
    e = parents.new_empty((b, n), dtype=torch.int64)
    return e, e.clone(), parents.new_empty((b, n, n), dtype=torch.bool), e.clone(), e.clone()


#: ``graft::tree_layout``: `layout_reference`'s contract, one fused launch on a CUDA device (or inside
#: `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
tree_layout = fused_op("tree_layout", layout_reference, _layout_fake, layout_triton if triton is not None else None)
