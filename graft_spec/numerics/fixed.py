"""The int64 fixed point that sums of estimates are accumulated in (calibration.py, "Source correction").

Integer sums are exact in every order, so GPU atomics, thread counts and tensor-parallel ranks all
give the same bits. The Triton twins are `kernels.common.to_fixed` / ``from_fixed``.
"""

from __future__ import annotations

import torch

__all__ = ["FIXED_ONE", "to_fixed", "from_fixed"]

#: One unit of the int64 fixed point that sums of estimates are accumulated in (the source window,
#: the request windows, the round metrics): integer sums are exact in every order, so GPU atomics,
#: thread counts and tensor-parallel ranks all give the same bits.
FIXED_ONE = 1 << 32


def to_fixed(x: torch.Tensor) -> torch.Tensor:
    """``int64``: non-negative ``x`` (float32 or float64) in units of 2**-32, truncated."""
    return (x.double() * FIXED_ONE).to(torch.int64)


def from_fixed(x: torch.Tensor) -> torch.Tensor:
    """``float32``: an int64 fixed-point value (`to_fixed`) as a float."""
    return (x.double() * (1.0 / FIXED_ONE)).float()
