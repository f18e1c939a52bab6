"""The last L committed tokens of every engine slot, on the device.

Two consumers read it each round, both inside the graft step (static shapes, no host read):

* re-anchoring (step.py): host proposals made from an older view of the context are moved onto the
  device's root by matching their first tokens against the newest committed ones;
* the lookup source (numerics/lookup.py): prompt-lookup matches of the context's tail within the
  window, with no lag whatever the scheduler does.

The window is right-aligned: ``tokens[s, L - 1]`` is the newest token of slot s (after a round's
bookkeeping: the root of the next tree), ``count[s]`` how many positions from the right are valid.
Rows are engine slots (SGLang: ``req_pool_indices``); `reset` writes a request's context at
admission, `append` adds each round's committed tokens.
"""

from __future__ import annotations

import torch

from .kernels.views import Windows
from .numerics.rows import append_rows, shifted

__all__ = ["TokenHistory", "append_rows"]


class TokenHistory:
    """Right-aligned windows of the last ``length`` committed tokens per slot.

    Args:
        slots: engine slots (grows with `ensure`); length: L, tokens kept per slot (>= 2).
        device: where it lives.
    Attributes:
        tokens: ``int64[slots, L]``; count: ``int64[slots]`` valid tokens at the right end.
    """

    def __init__(self, slots: int, length: int, device: torch.device | str = "cpu"):
        if length < 2:
            raise ValueError("TokenHistory: length must be >= 2")
        self.length = length
        self.tokens = torch.zeros(max(1, slots), length, dtype=torch.int64, device=device)
        self.count = torch.zeros(max(1, slots), dtype=torch.int64, device=device)

    def ensure(self, slots: int) -> None:
        """Grow to at least ``slots`` rows (a host-side size check; grows once, at start-up)."""
        grow = slots - self.tokens.shape[0]
        if grow > 0:
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(grow, self.length)])
            self.count = torch.cat([self.count, self.count.new_zeros(grow)])

    def append(self, slot_ids: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """Append the first ``lens[b]`` of ``tokens[b]`` ``[B, W]`` to slot ``slot_ids[b]``."""
        append_rows(self.tokens, self.count, slot_ids, tokens, lens)

    def reset(self, slot_ids: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """Replace slot ``slot_ids[b]``'s window by the first ``lens[b]`` of ``tokens[b]``."""
        ids = slot_ids.to(torch.int64)
        empty = torch.zeros(ids.shape[0], self.length, dtype=torch.int64, device=self.tokens.device)
        self.tokens.index_copy_(0, ids, shifted(empty, tokens, lens))
        self.count.index_copy_(0, ids, lens.to(torch.int64).clamp(max=self.length))

    @property
    def windows(self) -> Windows:
        """Every slot's window (`Windows` ``[slots, L]``), as the fused ops read and write it."""
        return Windows(self.tokens, self.count)

    def gather(self, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens int64[B, L], count int64[B])`` of the given slots."""
        ids = slot_ids.to(torch.int64)
        return self.tokens.index_select(0, ids), self.count.index_select(0, ids)


