"""The rows' per-request correction in one kernel (request_correction.py `RequestCorrection.factors`).

Each row reads its slot's window per member source (trials, sum of estimates, hits) and turns it
into `calibration.linear_correction`'s ``(scale, under)``; members outside the corrected set get the
identity. Reference: `factors_reference` (torch). Fused: `_factors_kernel`, one Triton
program per request doing the same float operations in the same order, compiled without fused
multiply-add, so the two agree bit for bit. The op ``graft::request_factors`` has the reference as
its CPU implementation and the kernel as its CUDA implementation; `request_factors` is registered by
`registry.fused_op`.
"""

from __future__ import annotations

import torch

from ..numerics import correction
from .dispatch import triton
from .registry import fused_op

if triton is not None:
    import triton.language as tl
    from .common import linear_correction

__all__ = ["request_factors", "factors_reference", "factors_triton"]


def factors_reference(recent: torch.Tensor, slot_ids: torch.Tensor, on: torch.Tensor, pseudo_trials: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale float32[B, M], under bool[B, M])`` of the windows ``recent`` ``float32[slots, M, 3]``
    of slots ``slot_ids`` ``int64[B]``; members where ``on`` ``bool[M]`` is False get (1, False).
    Source: request_correction.py ``RequestCorrection.factors``."""
    t, e, h = recent.index_select(0, slot_ids.to(torch.int64)).unbind(2)
    scale, under = correction.linear_correction(t, e, h, pseudo_trials)
    return torch.where(on, scale, 1.0), under & on


if triton is not None:
    @triton.jit
    def _factors_kernel(recent_ptr, slot_ptr, on_ptr, scale_ptr, under_ptr, pseudo, M: tl.constexpr,
                        BM: tl.constexpr):
        """One request per program; members as lanes.

        Work per program: O(M) (one window row per member)."""
        b = tl.program_id(0)
        c = tl.arange(0, BM)
        live = c < M
        row = recent_ptr + tl.load(slot_ptr + b) * M * 3 + c * 3
        t = tl.load(row, mask=live, other=0.0)
        e = tl.load(row + 1, mask=live, other=0.0)
        h = tl.load(row + 2, mask=live, other=0.0)
        scale, under = linear_correction(t, e, h, pseudo)
        on = tl.load(on_ptr + c, mask=live, other=0) != 0
        tl.store(scale_ptr + b * M + c, tl.where(on, scale, 1.0), mask=live)
        tl.store(under_ptr + b * M + c, under & on, mask=live)


def factors_triton(recent, slot_ids, on, pseudo_trials: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`factors_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and results.

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("graft request_factors: Triton is not installed")
    b, m = slot_ids.shape[0], recent.shape[1]
    scale = torch.empty(b, m, dtype=torch.float32, device=recent.device)
    under = torch.empty(b, m, dtype=torch.bool, device=recent.device)
    if b > 0:
        _factors_kernel[(b,)](recent, slot_ids, on, scale, under, float(pseudo_trials), M=m,
                              BM=triton.next_power_of_2(max(m, 2)), enable_fp_fusion=False)
    return scale, under


def _factors_fake(recent: torch.Tensor, slot_ids: torch.Tensor, on: torch.Tensor, pseudo_trials: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    b, m = slot_ids.shape[0], recent.shape[1]
    return recent.new_empty((b, m)), recent.new_empty((b, m), dtype=torch.bool)


#: ``graft::request_factors``: `factors_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
request_factors = fused_op("request_factors", factors_reference, _factors_fake,
                           factors_triton if triton is not None else None)
