"""Shadow checks: every fused op call runs its Triton kernel AND its torch reference, and compares.

Inside `shadow_references`, a call of a fused op (`registry.FusedOp`) that has a kernel runs the
kernel's launcher on the call's own tensors and the reference on clones of every tensor argument,
then compares what each wrote and returned: bit for bit, or, for the outputs the op declares
approximate (`fused_op(..., approximate=...)`: a float computed with a device's own ``log`` /
``exp`` / dot products), within `APPROX_TOLERANCE` of its dtype. The caller goes on with the
kernel's results. It runs wherever the kernels run: on a CUDA device, or on CPU tensors under
``TRITON_INTERPRET=1``; not under CUDA-graph capture (it clones and reads results back).

This is how the GPU check compares every op at the shapes a server runs (tests/test_kernels_cuda.py,
scripts/device_check.sh): the planner's eager rounds at N 24 / 60 and batch 1 / 64 inside one block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

__all__ = ["APPROX_TOLERANCE", "ShadowLog", "active", "shadow_references"]

#: (atol = rtol) by dtype for outputs an op declares approximate
APPROX_TOLERANCE = {torch.float32: 2e-5, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -7}


@dataclass
class ShadowLog:
    """What a `shadow_references` block compared.

    Attributes:
        calls: op name -> kernel calls compared.
        mismatches: ``(op, output, detail)`` of every output that differed (empty when all agree).
    """

    calls: dict = field(default_factory=dict)
    mismatches: list = field(default_factory=list)

    def compare(self, op: str, pairs: list, approximate: frozenset) -> None:
        """Record one call: ``pairs`` of ``(label, kernel tensor, reference tensor)``; a label in
        ``approximate`` is compared within `APPROX_TOLERANCE`."""
        self.calls[op] = self.calls.get(op, 0) + 1
        for label, got, want in pairs:
            if got.shape != want.shape or got.dtype != want.dtype:
                self.mismatches.append((op, label, f"{tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"))
                continue
            if label in approximate and got.is_floating_point():
                tol = APPROX_TOLERANCE.get(got.dtype, 2e-5)
                same_inf = torch.equal(got.isinf(), want.isinf())
                fin = ~want.isinf()
                ok = same_inf and torch.allclose(got[fin].float(), want[fin].float(), atol=tol, rtol=tol,
                                                 equal_nan=True)
            else:
                ok = torch.equal(got, want) or (got.is_floating_point() and bool(
                    ((got == want) | (got.isnan() & want.isnan())).all()))
            if not ok:
                diff = (got.double() - want.double()).abs().nan_to_num(0.0)
                self.mismatches.append((op, label, f"{int((got != want).sum())} of {got.numel()} differ, "
                                                   f"max |diff| {float(diff.max()):.3g}"))


_LOG: list[Optional[ShadowLog]] = [None]


def active() -> Optional[ShadowLog]:
    """The log of the enclosing `shadow_references` block, or None outside one."""
    return _LOG[0]


@contextlib.contextmanager
def shadow_references() -> Iterator[ShadowLog]:
    """Within the block every fused op with a kernel runs kernel and reference and compares them
    (module docstring); yields the `ShadowLog`."""
    saved, _LOG[0] = _LOG[0], ShadowLog()
    try:
        yield _LOG[0]
    finally:
        _LOG[0] = saved
