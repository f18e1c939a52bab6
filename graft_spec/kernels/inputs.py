"""A replayed round's per-batch inputs loaded into the captured step's buffers in one kernel.

`graft_spec.graphs.StepGraphs` replays the step over static input buffers. The draft and the host
proposals are written there in place by the engine; roots, slots, committed lengths and sampled rows
are the engine's own per-batch tensors, so a round copies them in: `load_rows` does the four copies
(with their dtype casts) as one launch. Reference: `load_rows_reference` (four ``copy_``). Fused:
`_load_rows_kernel`, ``ceil(B / 128)`` programs; copies are exact. The op ``graft::load_rows`` has
the reference as its CPU implementation and the kernel as its CUDA implementation; `load_rows` is
registered by `registry.fused_op`.
"""

from __future__ import annotations

import torch

from .common import int8_arg
from .dispatch import triton
from .registry import fused_op

if triton is not None:
    import triton.language as tl

__all__ = ["load_rows", "load_rows_reference", "load_rows_triton"]

_BLOCK = 128


def load_rows_reference(roots_out: torch.Tensor, slots_out: torch.Tensor, lens_out: torch.Tensor,
                        sampled_out: torch.Tensor, roots: torch.Tensor, slots: torch.Tensor,
                        seq_lens: torch.Tensor, sampled: torch.Tensor) -> None:
    """Write a batch of ``B`` rows into the first ``B`` rows of the buffers, in place.

    Args:
        roots_out, slots_out, lens_out: ``int64[>= B]``; sampled_out: ``bool[>= B]``.
        roots, slots, seq_lens: ``int[B]`` (any integer dtype, cast to int64; any stride);
            sampled: ``bool[B]``.
    """
    b = roots.shape[0]
    roots_out[:b].copy_(roots)
    slots_out[:b].copy_(slots)
    lens_out[:b].copy_(seq_lens)
    sampled_out[:b].copy_(sampled)


if triton is not None:
    @triton.jit
    def _load_rows_kernel(ro, so, lo, po, r, s, ln, p, B, rs, ss, ls, ps, BLOCK: tl.constexpr):
        """``BLOCK`` rows per program, each field loaded through its stride and stored as int64
        (the flags as int8). Work per program: O(BLOCK); no barrier."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < B
        tl.store(ro + i, tl.load(r + i * rs, mask=m).to(tl.int64), mask=m)
        tl.store(so + i, tl.load(s + i * ss, mask=m).to(tl.int64), mask=m)
        tl.store(lo + i, tl.load(ln + i * ls, mask=m).to(tl.int64), mask=m)
        tl.store(po + i, (tl.load(p + i * ps, mask=m) != 0).to(tl.int8), mask=m)


def load_rows_triton(roots_out, slots_out, lens_out, sampled_out, roots, slots, seq_lens, sampled) -> None:
    """`load_rows_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and effects; the inputs are read in place through
    their strides, the outputs must be contiguous.

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("graft load_rows: Triton is not installed")
    b = roots.shape[0]
    if b == 0:
        return
    flags = int8_arg(sampled)
    _load_rows_kernel[(triton.cdiv(b, _BLOCK),)](
        roots_out, slots_out, lens_out, int8_arg(sampled_out), roots, slots, seq_lens, flags, b,
        roots.stride(0), slots.stride(0), seq_lens.stride(0), flags.stride(0), BLOCK=_BLOCK)


def _load_rows_fake(roots_out: torch.Tensor, slots_out: torch.Tensor, lens_out: torch.Tensor,
                    sampled_out: torch.Tensor, roots: torch.Tensor, slots: torch.Tensor,
                    seq_lens: torch.Tensor, sampled: torch.Tensor) -> None:
    return None


#: ``graft::load_rows``: `load_rows_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
load_rows = fused_op("load_rows", load_rows_reference, _load_rows_fake,
                     load_rows_triton if triton is not None else None,
                     mutates=("roots_out", "slots_out", "lens_out", "sampled_out"))
