"""Which implementation a fused op runs: the Triton kernel on a CUDA device, the torch reference
elsewhere, and the switches that change it (``GRAFT_REFERENCE_KERNELS=1``, `fused_ops_everywhere`,
the start-up fallback `use_reference_kernels`). Every op dispatches through `fused_kernels_for`
(`registry.FusedOp.__call__`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

try:  # Triton ships with CUDA builds of torch; without it the reference runs everywhere
    import triton
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

__all__ = ["REFERENCE_ENV", "triton", "fused_enabled", "fused_kernels_for", "fused_ops_everywhere",
           "use_reference_kernels", "kernel_path"]

#: Environment switch: ``1`` = the torch reference on every device.
REFERENCE_ENV = "GRAFT_REFERENCE_KERNELS"
_EVERYWHERE = [False]
_FALLBACK: list = [None]   # `use_reference_kernels`: the reason, once a start-up check failed


@contextlib.contextmanager
def fused_ops_everywhere() -> Iterator[None]:
    """Within the block, the fused ops are called on every device (on CPU each runs its reference
    as its implementation): what the op counter of ``sglang_patch.bench.step`` counts as the fused
    path (``graft_fused`` rows), one op per fused launch."""
    _EVERYWHERE[0] = True
    try:
        yield
    finally:
        _EVERYWHERE[0] = False


def fused_kernels_for(t: torch.Tensor) -> bool:
    """True when a fused op should run for tensor ``t``: on a CUDA device (or inside
    `fused_ops_everywhere`) with `fused_enabled`."""
    return (t.is_cuda or _EVERYWHERE[0]) and fused_enabled()


def fused_enabled() -> bool:
    """True when the fused kernels may run: Triton is importable, ``GRAFT_REFERENCE_KERNELS`` is
    not ``1`` and `use_reference_kernels` has not been called."""
    return triton is not None and _FALLBACK[0] is None and os.environ.get(REFERENCE_ENV, "0") != "1"


def use_reference_kernels(reason: str) -> None:
    """Run the torch references from now on in this process (what a server does when a fused
    kernel fails to compile or capture at start-up); ``reason`` is kept for `kernel_path`."""
    _FALLBACK[0] = reason


def kernel_path() -> str:
    """Which implementation the fused ops run on a CUDA device: ``"fused"``, ``"reference"`` (the
    environment switch or no Triton) or ``"reference (fallback: <reason>)"``."""
    if _FALLBACK[0] is not None:
        return f"reference (fallback: {_FALLBACK[0]})"
    return "fused" if fused_enabled() else "reference"
