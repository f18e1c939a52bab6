"""m-gram hashes of the output index (retrieval/output_ring.py): the reference per-token definition
and the prefix-sum form that hashes every tail length of a row at once (int64 arithmetic wraps).
"""

from __future__ import annotations

import torch

from ..tree import HASH_ADD, HASH_MIX, HASH_POW

__all__ = ["mgram_hash", "wrap64", "tail_hashes"]


def mgram_hash(windows: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
    """``int64[...]`` hash of the last dimension's tokens and the group tag (int64 arithmetic wraps).

    The reference definition (`OutputRing.insert`, retrieval/output_ring.py): ``h = tag * HASH_MIX + HASH_ADD``, then ``h = h * HASH_POW + w``
    per token, mixed as ``h ^ (h >> 29)``; `tail_hashes` gives the same values for every tail length."""
    h = tags.to(torch.int64) * HASH_MIX + HASH_ADD
    for i in range(windows.shape[-1]):                      # m is small and fixed per call
        h = h * HASH_POW + windows[..., i]
    return h ^ (h >> 29)


def wrap64(x: int) -> int:
    """A Python integer as the int64 it wraps to."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def tail_hashes(tail_rev: torch.Tensor, tags: torch.Tensor, lengths: torch.Tensor,
                 pow_r: torch.Tensor, pow_m: torch.Tensor) -> torch.Tensor:
    """`mgram_hash` of the last m tokens of every row, for every m in ``lengths``, in a fixed handful of ops.

    The unmixed hash of a tail of length m is ``seed * P**m + sum_{r < m} tok_r * P**r`` modulo
    2**64, with ``tok_r`` the r-th token back from the root (r = 0 the root) and ``seed`` the tag's:
    one product and one prefix sum over r give every length at once (the per-token loop of
    `mgram_hash` is the same polynomial, so the values are bit-identical).

    Args:
        tail_rev: ``int64[B, M]`` the last M tokens, newest first; tags: ``int64[B]`` groups;
        lengths: ``int64[K]`` tail lengths (1 <= m <= M); pow_r: ``int64[M]`` ``P**r``;
        pow_m: ``int64[K]`` ``P**m`` per length (both wrapped to int64).
    Returns:
        ``int64[B, K]`` mixed hashes.
    """
    sums = torch.cumsum(tail_rev * pow_r, dim=1).index_select(1, lengths - 1)          # [B, K]
    h = (tags.to(torch.int64) * HASH_MIX + HASH_ADD)[:, None] * pow_m + sums
    return h ^ (h >> 29)
