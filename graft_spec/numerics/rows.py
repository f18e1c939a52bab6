"""Row-wise helpers of the per-slot windows: shifting tokens into a right-aligned window
(history.py) and the rows a mode switch selects.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["shifted", "append_rows", "mode_rows", "mode_selector"]


def shifted(old: torch.Tensor, new: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``old`` [B, L] followed by the first ``lens`` tokens of ``new`` [B, W], last L kept."""
    ext = torch.cat([old, new.to(torch.int64)], dim=1)                                   # [B, L + W]
    idx = lens.to(torch.int64)[:, None] + torch.arange(old.shape[1], device=ext.device)
    return ext.gather(1, idx)


def append_rows(tokens: torch.Tensor, count: torch.Tensor, slot_ids: torch.Tensor, new: torch.Tensor,
                lens: torch.Tensor) -> None:
    """Append the first ``lens[b]`` of ``new[b]`` (``int64[B, W]``) to the windows ``tokens``
    ``int64[slots, L]`` / ``count`` ``int64[slots]`` of slot ``slot_ids[b]`` (distinct), in place."""
    ids = slot_ids.to(torch.int64)
    length = tokens.shape[1]
    tokens.index_copy_(0, ids, shifted(tokens.index_select(0, ids), new, lens))
    count.index_copy_(0, ids, (count.index_select(0, ids) + lens.to(torch.int64)).clamp(max=length))


def mode_selector(modes: tuple, sampled: torch.Tensor) -> tuple[Optional[torch.Tensor], bool]:
    """`mode_rows` as ``(rows, invert)`` with no op: the rows whose mode is on are those where
    ``rows`` is not ``invert`` (``rows`` None: every row). For (greedy, sampled) = (True, False) that
    is ``(sampled, True)``. A config switch, not data-dependent control flow.

    Raises:
        ValueError: both modes off (no row; `mode_rows` gives an all-False mask then).
    """
    greedy_on, sampled_on = bool(modes[0]), bool(modes[1])
    if greedy_on and sampled_on:
        return None, False
    if not (greedy_on or sampled_on):
        raise ValueError("mode_selector: both modes off")
    return sampled, greedy_on


def mode_rows(modes: tuple, sampled: torch.Tensor) -> Optional[torch.Tensor]:
    """``bool[B]`` rows whose mode is on in ``modes`` = (greedy, sampled) (``sampled`` ``bool[B]``);
    None when both are (every row). A config switch, not data-dependent control flow."""
    if not (modes[0] or modes[1]):
        return torch.zeros_like(sampled)
    rows, invert = mode_selector(modes, sampled)
    return None if rows is None else (~rows if invert else rows)
