"""Triton helpers shared by the kernels: the calibration's correction maps, operation for operation.

Each is the Triton twin of a torch function of calibration.py, written with the same float
operations in the same order (the kernels that use them launch without fused multiply-add, and
divide with ``tl.div_rn``, the IEEE round-to-nearest division torch uses: a plain ``/`` compiles to
an approximate divide on CUDA), so a kernel and its torch reference agree bit for bit.
"""

from __future__ import annotations

import torch

from .dispatch import triton


def int8_arg(t: torch.Tensor) -> torch.Tensor:
    """A flag tensor as an ``int8`` kernel argument without a launch: ``bool`` is viewed (the same
    bytes, 0 / 1), ``int8`` passed as it is; any other dtype is converted (one op)."""
    return t.view(torch.int8) if t.dtype == torch.bool else t.to(torch.int8)


def row_arg(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(x, its row stride)`` for a ``[B, C]`` kernel argument read row by row in place (a view such
    as a packed block's field or a tree's columns 1:); one copy when its last axis is not
    contiguous."""
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x, x.stride(0)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def to_fixed(x):
        """`calibration.to_fixed`: ``int64`` ``trunc(x * 2**32)`` through float64."""
        return (x.to(tl.float64) * 4294967296.0).to(tl.int64)

    @triton.jit
    def from_fixed(x):
        """`calibration.from_fixed`: an ``int64`` fixed-point value as ``float32`` through float64."""
        return (x.to(tl.float64) * (1.0 / 4294967296.0)).to(tl.float32)

    @triton.jit
    def apply_correction(est, scale, under):
        """`calibration.apply_correction`: ``1 - (1 - est) * scale`` where ``under``, else ``est * scale``."""
        return tl.where(under, 1.0 - (1.0 - est) * scale, est * scale)

    @triton.jit
    def linear_correction(t, e, h, pseudo):
        """`calibration.linear_correction` of windows (trials ``t``, estimated ``e``, hits ``h``):
        ``(scale, under)``."""
        pe = tl.div_rn(pseudo * e, tl.maximum(t, 1e-6))
        pm = pseudo - pe
        seen = t >= 1.0
        hs = tl.minimum(tl.where(seen, tl.div_rn(h + pe, tl.maximum(e + pe, 1e-6)), 1.0), 1.0)
        ms = tl.minimum(tl.where(seen, tl.div_rn(t - h + pm, tl.maximum(t - e + pm, 1e-6)), 1.0), 1.0)
        under = h > e
        return tl.where(under, ms, hs), under
