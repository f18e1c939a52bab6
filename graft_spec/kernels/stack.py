"""A round's candidate blocks stacked into one ``[B, U]`` block in one kernel (`views.Candidates.stack`).

The rooted draft block comes first, then every retrieved block with its parents re-pointed into
the stack (-1, a child of the root, becomes 0); the selection priority is a block's key where it has
one, else its estimate; a row whose request opted out of speculation loses every candidate.
Reference: `stack_reference` (torch: a concatenation per field and two ops per block). Fused:
`_stack_kernel`, one Triton program per request copying up to `MAX_BLOCKS` blocks; copies are exact.
The op ``graft::stack_candidates`` has the reference as its CPU implementation and the kernel as its
CUDA implementation; `stack_candidates` is registered by `registry.fused_op`.
"""

from __future__ import annotations

import torch

from .common import row_arg
from .dispatch import triton
from .registry import fused_op

if triton is not None:
    import triton.language as tl

__all__ = ["FIELDS", "MAX_BLOCKS", "stack_candidates", "stack_reference", "stack_triton"]

#: The fields of a block, in order: tokens, parents (int64), est (float32), valid (bool), bins,
#: member (int64), priority (float32).
FIELDS = 7
#: Blocks the kernel stacks (the rooted draft block and up to three retrieved ones).
MAX_BLOCKS = 4


def stack_reference(blocks: list[torch.Tensor], speculate: torch.Tensor) -> list[torch.Tensor]:
    """Stack candidate blocks.

    Args:
        blocks: ``FIELDS`` tensors per block, blocks in order (the rooted block first): tokens,
            parents, est, valid, bins, member, priority, each ``[B, C_i]`` (`Candidates`; a member
            field may be one row broadcast over the batch, row stride 0).
        speculate: ``bool[B]`` rows that may speculate (the others' candidates become invalid).
    Returns:
        The ``FIELDS`` stacked tensors ``[B, sum C_i]``.
    """
    out = [[] for _ in range(FIELDS)]
    offset = 0
    for i in range(0, len(blocks), FIELDS):
        block = blocks[i:i + FIELDS]
        for f, x in enumerate(block):
            out[f].append(x if f != 1 or i == 0 else torch.where(x < 0, 0, x + offset))
        offset += block[0].shape[1]
    cat = [torch.cat(x, 1) for x in out]
    cat[3] = cat[3] & speculate[:, None]
    return cat


if triton is not None:
    @triton.jit
    def _copy_block(src, dst, b, width, offset, total, shift, repoint: tl.constexpr,
                    BW: tl.constexpr, row):
        for start in range(0, width, BW):
            j = start + tl.arange(0, BW)
            live = j < width
            x = tl.load(src + b * row + j, mask=live)
            if repoint:
                x = tl.where(x < 0, 0, x + shift)
            tl.store(dst + b * total + offset + j, x, mask=live)

    @triton.jit
    def _copy_fields(t, p, e, v, bn, m, ms, k, o_t, o_p, o_e, o_v, o_b, o_m, o_k, spec, b, width, offset, total,
                     REPOINT: tl.constexpr, BW: tl.constexpr):
        _copy_block(t, o_t, b, width, offset, total, offset, False, BW, width)
        _copy_block(p, o_p, b, width, offset, total, offset, REPOINT, BW, width)
        _copy_block(e, o_e, b, width, offset, total, offset, False, BW, width)
        for start in range(0, width, BW):
            j = start + tl.arange(0, BW)
            live = j < width
            x = tl.load(v + b * width + j, mask=live, other=0) != 0
            tl.store(o_v + b * total + offset + j, x & spec, mask=live)
        _copy_block(bn, o_b, b, width, offset, total, offset, False, BW, width)
        _copy_block(m, o_m, b, width, offset, total, offset, False, BW, ms)
        _copy_block(k, o_k, b, width, offset, total, offset, False, BW, width)

    @triton.jit
    def _stack_kernel(t0, p0, e0, v0, b0, m0, k0, t1, p1, e1, v1, b1, m1, k1, t2, p2, e2, v2, b2, m2, k2,
                      t3, p3, e3, v3, b3, m3, k3, spec_ptr, o_t, o_p, o_e, o_v, o_b, o_m, o_k, ms0, ms1, ms2, ms3,
                      W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, BW: tl.constexpr):
        """One request per program: the blocks' fields copied at their offsets (``ms*``: the member
        fields' row strides, 0 for a broadcast row).

        Work per program: O(W0 + W1 + W2 + W3) copies, no barrier."""
        b = tl.program_id(0)
        spec = tl.load(spec_ptr + b) != 0
        total = W0 + W1 + W2 + W3
        _copy_fields(t0, p0, e0, v0, b0, m0, ms0, k0, o_t, o_p, o_e, o_v, o_b, o_m, o_k, spec, b, W0, 0, total,
                     False, BW)
        if W1 > 0:
            _copy_fields(t1, p1, e1, v1, b1, m1, ms1, k1, o_t, o_p, o_e, o_v, o_b, o_m, o_k, spec, b, W1, W0, total,
                         True, BW)
        if W2 > 0:
            _copy_fields(t2, p2, e2, v2, b2, m2, ms2, k2, o_t, o_p, o_e, o_v, o_b, o_m, o_k, spec, b, W2, W0 + W1,
                         total, True, BW)
        if W3 > 0:
            _copy_fields(t3, p3, e3, v3, b3, m3, ms3, k3, o_t, o_p, o_e, o_v, o_b, o_m, o_k, spec, b, W3, W0 + W1 + W2,
                         total, True, BW)


def stack_triton(blocks: list[torch.Tensor], speculate: torch.Tensor) -> list[torch.Tensor]:
    """`stack_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and results.

    Raises:
        RuntimeError: Triton is not installed, or more than `MAX_BLOCKS` blocks.
    """
    if triton is None:
        raise RuntimeError("graft stack_candidates: Triton is not installed")
    n = len(blocks) // FIELDS
    if n > MAX_BLOCKS:
        raise RuntimeError(f"graft stack_candidates: at most {MAX_BLOCKS} blocks, got {n}")
    b = blocks[0].shape[0]
    widths = [blocks[i * FIELDS].shape[1] for i in range(n)] + [0] * (MAX_BLOCKS - n)
    total = sum(widths)
    first = blocks[:FIELDS]
    out = [torch.empty(b, total, dtype=x.dtype, device=x.device) for x in first]
    # the member fields are read through their row strides (the rooted block's is a broadcast row)
    members = [row_arg(blocks[i * FIELDS + 5]) for i in range(n)]
    args = [members[i // FIELDS][0] if i % FIELDS == 5 else x.contiguous() for i, x in enumerate(blocks)]
    args += list(first) * (MAX_BLOCKS - n)                                    # absent blocks: never read
    strides = [s for _, s in members] + [0] * (MAX_BLOCKS - n)
    if b > 0:
        _stack_kernel[(b,)](*args, speculate.contiguous(), *out, *strides, W0=widths[0], W1=widths[1],
                            W2=widths[2], W3=widths[3], BW=64)
    return out


def _stack_fake(blocks: list[torch.Tensor], speculate: torch.Tensor) -> list[torch.Tensor]:
    total = sum(blocks[i].shape[1] for i in range(0, len(blocks), FIELDS))
    b = blocks[0].shape[0]
    return [x.new_empty((b, total)) for x in blocks[:FIELDS]]


#: ``graft::stack_candidates``: `stack_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`) for at most `MAX_BLOCKS` blocks, the torch reference elsewhere or
#: with ``GRAFT_REFERENCE_KERNELS=1``.
stack_candidates = fused_op("stack_candidates", stack_reference, _stack_fake,
                            stack_triton if triton is not None else None,
                            when=lambda blocks, speculate: len(blocks) <= FIELDS * MAX_BLOCKS)
