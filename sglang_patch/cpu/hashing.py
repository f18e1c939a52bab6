"""Torch MurmurHash3 (32-bit) for SGLang's seeded sampling on CPU.

SGLang 0.5.23 derives per-request deterministic random numbers (``sampling_seed``) from
``murmur_hash32(seed, position, column)`` (``kernels/ops/sampling/murmur_hash.py:104``): Triton on
GPUs, the CPU build of ``sgl_kernel`` on CPU tensors (not on PyPI). Used by the plain sampler
(``srt/layers/sampler.py:958``), the draft proposal (``speculative/spec_utils.py:174``) and the
verify coins (``speculative/eagle_utils.py:438``).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _M32
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _M32
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """MurmurHash3-32 of the 16-byte key (seed low, seed high, position, column), seed 0.

    Same function as SGLang's Triton ``murmur_hash32_kernel`` (murmur_hash.py:51): the 64-bit seed
    is split into two 32-bit blocks, position and column are truncated to 32 bits.

    Args:
        seed: ``int[N]`` (uint64/int64); positions: ``int[N]``; col_indices: ``int[M]``.
    Returns:
        ``uint32[N, M]``.
    Raises:
        ValueError: ``seed``/``positions`` shapes differ or inputs are not 1-D.
    """
    if seed.shape != positions.shape or seed.dim() != 1 or col_indices.dim() != 1:
        raise ValueError(f"murmur_hash32: need 1-D seed/positions of one shape and 1-D columns, "
                         f"got {tuple(seed.shape)}, {tuple(positions.shape)}, {tuple(col_indices.shape)}")
    s = seed.to(torch.int64)           # bit pattern of the uint64 seed
    lo = s & _M32
    hi = (s >> 32) & _M32              # arithmetic shift; the mask keeps the 32 high bits
    pos = positions.to(torch.int64) & _M32
    col = col_indices.to(torch.int64) & _M32
    h = torch.zeros_like(lo)
    h = _mix(h, lo)
    h = _mix(h, hi)
    h = _mix(h, pos)[:, None]
    h = _mix(h, col[None, :])
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return h.to(torch.uint32)
