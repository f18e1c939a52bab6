"""A replayed round's per-batch inputs loaded into the captured graphs' buffers in one kernel each.

`graft_spec.graphs.StepGraphs` replays the step and its bookkeeping over static input buffers.

* Build: the draft and the host proposals are written there in place by the engine; roots, slots,
  committed lengths and sampled rows are the engine's own per-batch tensors, so a round copies them
  in: `load_rows` does the four copies (with their dtype casts) as one launch. Reference:
  `load_rows_reference` (four ``copy_``). Fused: `_load_rows_kernel`, ``ceil(B / 128)`` programs.
* Observe: the verify outcome is the engine's too (SGLang's accept index, committed tokens and
  accept lengths, made after its verify forward): `load_outcome` turns the accept index into the
  accepted-node mask and copies the rest, with the slots and the batch size, as one launch.
  Reference: `load_outcome_reference` (`on_path_from_accept_index` and five copies). Fused:
  `_load_outcome_kernel`, one program per row.

Both are exact (integer copies and compares). The ops ``graft::load_rows`` and
``graft::load_outcome`` have the references as their CPU implementation and the kernels as their
CUDA implementation (`registry.fused_op`).
"""

from __future__ import annotations

import torch

from ..tree import on_path_from_accept_index
from .common import int8_arg
from .dispatch import triton
from .registry import fused_op

if triton is not None:
    import triton.language as tl

__all__ = ["load_rows", "load_rows_reference", "load_rows_triton", "load_outcome", "load_outcome_reference",
           "load_outcome_triton"]

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


def load_outcome_reference(on_path_out: torch.Tensor, committed_out: torch.Tensor, accept_len_out: torch.Tensor,
                           slots_out: torch.Tensor, rows_out: torch.Tensor, accept_index: torch.Tensor,
                           committed: torch.Tensor, accept_len: torch.Tensor, slots: torch.Tensor) -> None:
    """Write a verified round of ``B`` rows into the first ``B`` rows of an observe's buffers, in place.

    Args:
        on_path_out: ``bool[>= B, N]``, row b set to `on_path_from_accept_index` of ``accept_index``
            (N: the buffer's width, the tree's).
        committed_out: ``int64[>= B, C]``, the first ``min(C, L)`` columns of ``committed``.
        accept_len_out, slots_out: ``int64[>= B]``; rows_out: ``int64[1]``, set to B.
        accept_index: ``int[B, W]`` SGLang's flat accepted node ids (``b * N + i``, -1 padded).
        committed: ``int[B, L]`` committed tokens per row (any integer dtype and strides).
        accept_len, slots: ``int[B]`` (any integer dtype and stride).
    """
    b, n = accept_index.shape[0], on_path_out.shape[1]
    on_path_out[:b].copy_(on_path_from_accept_index(accept_index, n))
    c = min(committed_out.shape[1], committed.shape[1])
    committed_out[:b, :c].copy_(committed[:, :c])
    accept_len_out[:b].copy_(accept_len)
    slots_out[:b].copy_(slots)
    rows_out.fill_(b)


if triton is not None:
    @triton.jit
    def _load_outcome_kernel(po, co, lo, so, ro, acc, com, ln, sl, N, W, C, pos, cos, accs0, accs1, coms0, coms1,
                             lns, sls, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
        """Row ``b``: node i is on the path when some accept-index entry maps to it (as the
        reference: ``-1`` and ids past the row clamp to N, ids before it to the root), then the
        committed tokens, accept length and slot. Work per program: O(BLOCK_N * BLOCK_W); no barrier."""
        b = tl.program_id(0)
        w = tl.arange(0, BLOCK_W)
        a = tl.load(acc + b * accs0 + w * accs1, mask=w < W, other=-1).to(tl.int64)
        local = tl.where(a >= 0, a - b.to(tl.int64) * N, N)
        local = tl.minimum(tl.maximum(local, 0), N)
        i = tl.arange(0, BLOCK_N)
        hit = tl.max((local[None, :] == i[:, None]).to(tl.int8), axis=1)
        tl.store(po + b * pos + i, hit, mask=i < N)
        c = tl.arange(0, BLOCK_C)
        tl.store(co + b * cos + c, tl.load(com + b * coms0 + c * coms1, mask=c < C).to(tl.int64), mask=c < C)
        tl.store(lo + b, tl.load(ln + b * lns).to(tl.int64))
        tl.store(so + b, tl.load(sl + b * sls).to(tl.int64))
        if b == 0:
            tl.store(ro, tl.num_programs(0).to(tl.int64))


def load_outcome_triton(on_path_out, committed_out, accept_len_out, slots_out, rows_out, accept_index, committed,
                        accept_len, slots) -> None:
    """`load_outcome_reference` as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and effects; the inputs are read in place through their
    strides, the outputs must have a contiguous last axis.

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("graft load_outcome: Triton is not installed")
    b, w = accept_index.shape
    if b == 0:
        rows_out.fill_(0)
        return
    n = on_path_out.shape[1]
    c = min(committed_out.shape[1], committed.shape[1])
    path = int8_arg(on_path_out)
    _load_outcome_kernel[(b,)](
        path, committed_out, accept_len_out, slots_out, rows_out, accept_index, committed, accept_len, slots,
        n, w, c, path.stride(0), committed_out.stride(0), accept_index.stride(0), accept_index.stride(1),
        committed.stride(0), committed.stride(1), accept_len.stride(0), slots.stride(0),
        BLOCK_N=triton.next_power_of_2(n), BLOCK_W=triton.next_power_of_2(max(w, 1)),
        BLOCK_C=triton.next_power_of_2(max(c, 1)))


def _load_outcome_fake(on_path_out: torch.Tensor, committed_out: torch.Tensor, accept_len_out: torch.Tensor,
                       slots_out: torch.Tensor, rows_out: torch.Tensor, accept_index: torch.Tensor,
                       committed: torch.Tensor, accept_len: torch.Tensor, slots: torch.Tensor) -> None:
    return None


#: ``graft::load_outcome``: `load_outcome_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
load_outcome = fused_op("load_outcome", load_outcome_reference, _load_outcome_fake,
                        load_outcome_triton if triton is not None else None,
                        mutates=("on_path_out", "committed_out", "accept_len_out", "slots_out", "rows_out"))
