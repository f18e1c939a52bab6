"""SGLang's flat verify tree-mask layouts, written from batched ancestor masks (device-neutral).

Used by the Graft verify input (``graft_info.py``, every device) and by the CPU layer's tree build
(``cpu/tree_ops.py``). Layout source: SGLang 0.5.23 ``speculative/eagle_utils.py:138-205`` and
``kernels/ops/speculative/spec_tree.py:127-160``.
"""

from __future__ import annotations

import torch

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
