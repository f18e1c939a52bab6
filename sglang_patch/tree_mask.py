"""SGLang's flat verify tree-mask layouts, written from batched ancestor masks (device-neutral).

Used by the Graft verify input (``graft_info.py``, every device) and by the CPU layer's tree build
(``cpu/tree_ops.py``). Layout source: SGLang 0.5.23 ``speculative/eagle_utils.py:138-205`` and
``kernels/ops/speculative/spec_tree.py:127-160``.

`write_verify_mask` is the graft verify input's writer: one op (``graft::write_verify_mask``) that
writes the FULL_MASK prefix and tree cells, or the QLEN_ONLY cells, of every request; on a CUDA
device one Triton launch (`_verify_mask_kernel`), elsewhere its torch reference
(`verify_mask_reference`: the buffer filled with True, then `write_tree_mask`).
"""

from __future__ import annotations

import torch

from graft_spec.pipeline import fused_op

try:  # Triton ships with CUDA builds of torch; without it the reference runs everywhere
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# SGLang's TreeMaskMode values (spec_tree.py:47, an IntEnum); compared as ints so this module
# does not import SGLang.
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def write_tree_mask(
    tree_mask: torch.Tensor,
    mask: torch.Tensor,
    seq_lens: torch.Tensor,
    mode: int,
) -> None:
    """Write a batch of ancestor masks into SGLang's flat tree-mask buffer, in place.

    Layouts (eagle_utils.py:138-205, spec_tree.py:127-160):

    * QLEN_ONLY: ``bool[B * N * N]``, request-major, row-major ``mask[b, i, j]``.
    * FULL_MASK: per request ``N`` rows of ``seq_len_b + N`` columns, requests concatenated; only
      the last ``N`` columns (the tree part) are written, the prefix columns are left as the
      caller filled them (True).
    * QLEN_ONLY_BITPACKING: one integer per row (``B * N``), bit ``j`` set when ``mask[b, i, j]``.

    Args:
        tree_mask: the flat buffer to write (bool, or uint8/16/32 for bit packing).
        mask: ``bool[B, N, N]``.
        seq_lens: ``int[B]`` committed lengths (FULL_MASK only).
        mode: 0 FULL_MASK, 1 QLEN_ONLY, 2 QLEN_ONLY_BITPACKING.
    Raises:
        ValueError: unknown mode.
    """
    bs, n, _ = mask.shape
    if mode == QLEN_ONLY:
        tree_mask[: bs * n * n].copy_(mask.reshape(-1))
    elif mode == QLEN_ONLY_BITPACKING:
        weights = torch.pow(2, torch.arange(n, dtype=torch.int64, device=mask.device))
        packed = (mask.to(torch.int64) * weights).sum(dim=2).reshape(-1)
        tree_mask[: bs * n].copy_(packed.to(tree_mask.dtype))
    elif mode == FULL_MASK:
        lens = seq_lens.to(torch.int64)
        starts = torch.cumsum(lens * n + n * n, dim=0) - (lens * n + n * n)  # request offsets
        row = torch.arange(n, device=mask.device, dtype=torch.int64)
        # flat index of (b, i, seq_len_b + j) = start_b + i * (seq_len_b + n) + seq_len_b + j
        idx = (
            starts[:, None, None]
            + row[None, :, None] * (lens[:, None, None] + n)
            + lens[:, None, None]
            + row[None, None, :]
        )
        tree_mask.view(-1)[idx.reshape(-1)] = mask.reshape(-1).to(tree_mask.dtype)
    else:
        raise ValueError(f"unknown tree mask mode {mode}")


def verify_mask_reference(tree_mask: torch.Tensor, mask: torch.Tensor, seq_lens: torch.Tensor, mode: int,
                          fill_prefix: bool) -> None:
    """`write_verify_mask` in torch: with ``fill_prefix`` (FULL_MASK) the whole buffer is set to True
    first, then `write_tree_mask`."""
    if fill_prefix and mode == FULL_MASK:
        tree_mask.fill_(True)
    write_tree_mask(tree_mask, mask, seq_lens, mode)


if triton is not None:
    @triton.jit
    def _verify_mask_kernel(out_ptr, mask_ptr, seq_ptr, N: tl.constexpr, FULL: tl.constexpr, FILL: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
        """One program per (request b, tree row i): row i of request b in the flat layout."""
        b = tl.program_id(0)
        i = tl.program_id(1)
        cols = tl.arange(0, BLOCK_N)
        live = cols < N
        row = tl.load(mask_ptr + (b * N + i) * N + cols, mask=live, other=0)
        if FULL:
            start = tl.zeros([], dtype=tl.int64)      # request b's offset: sum over earlier requests
            for k in range(0, b):
                start += tl.load(seq_ptr + k).to(tl.int64) * N + N * N
            seq = tl.load(seq_ptr + b).to(tl.int64)
            base = start + i * (seq + N)
            if FILL:
                ones = tl.full([BLOCK_P], 1, dtype=tl.int1)
                for p in range(0, seq, BLOCK_P):
                    offs = p + tl.arange(0, BLOCK_P)
                    tl.store(out_ptr + base + offs, ones, mask=offs < seq)
            tl.store(out_ptr + base + seq + cols, row, mask=live)
        else:
            tl.store(out_ptr + (b * N + i) * N + cols, row, mask=live)


def verify_mask_triton(tree_mask: torch.Tensor, mask: torch.Tensor, seq_lens: torch.Tensor, mode: int,
                       fill_prefix: bool) -> None:
    """`write_verify_mask` as one Triton launch over ``B * N`` programs (CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1``); bit packing falls back to the reference. With ``fill_prefix`` only
    the cells of the requests' rows are set (the reference sets the whole buffer): the attention
    reads no other cell.

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("graft write_verify_mask: Triton is not installed")
    if mode not in (FULL_MASK, QLEN_ONLY):
        verify_mask_reference(tree_mask, mask, seq_lens, mode, fill_prefix)
        return
    bs, n, _ = mask.shape
    if bs > 0:
        _verify_mask_kernel[(bs, n)](tree_mask, mask.contiguous(), seq_lens.contiguous().to(torch.int64), N=n,
                                     FULL=mode == FULL_MASK, FILL=bool(fill_prefix),
                                     BLOCK_N=triton.next_power_of_2(max(n, 2)), BLOCK_P=1024)


def _verify_mask_fake(tree_mask: torch.Tensor, mask: torch.Tensor, seq_lens: torch.Tensor, mode: int,
                      fill_prefix: bool) -> None:
    return None


#: ``graft::write_verify_mask`` (`graft_spec.kernels.registry.fused_op`): one launch on a CUDA device.
verify_mask_op = fused_op("write_verify_mask", verify_mask_reference, _verify_mask_fake,
                          verify_mask_triton if triton is not None else None, mutates=("tree_mask",))


def write_verify_mask(tree_mask: torch.Tensor, mask: torch.Tensor, seq_lens: torch.Tensor, mode: int,
                      fill_prefix: bool) -> None:
    """Write a batch of ancestor masks into SGLang's flat tree-mask buffer, in place, with the
    FULL_MASK prefix columns set to True when ``fill_prefix``: one launch on a CUDA device
    (``graft::write_verify_mask``), `verify_mask_reference` elsewhere or with
    ``GRAFT_REFERENCE_KERNELS=1``.

    Args:
        tree_mask: the flat buffer (bool or uint8), at least `write_tree_mask`'s cells.
        mask: ``bool[B, N, N]`` ancestor masks.
        seq_lens: ``int[B]`` committed lengths (FULL_MASK only).
        mode: 0 FULL_MASK, 1 QLEN_ONLY, 2 QLEN_ONLY_BITPACKING.
        fill_prefix: set the FULL_MASK prefix columns (the committed context) to True.
    Raises:
        ValueError: unknown mode.
    """
    if mode not in (FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING):
        raise ValueError(f"unknown tree mask mode {mode}")
    verify_mask_op(tree_mask, mask, seq_lens, int(mode), bool(fill_prefix))
