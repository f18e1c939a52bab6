"""Per-request correction of the retrieval sources' estimates (one window per engine slot).

The source correction (calibration.py) fits one scale per (mode, source) over the last few hundred
verified nodes, i.e. over the last few requests. How often a retrieval source is right is largely a
property of the request: a prompt whose answer repeats its own text makes the suffix and lookup
sources right most of the time, an open question almost never. A shared scale lags such a change by
a window, and the lag is not neutral: a request the scale over-prices gets many of that source's
nodes selected (many trials at too high a price), one it under-prices gets few, so the trial-weighted
mean estimate leans high, which no shorter shared window removes.

So every engine slot (the request it holds) keeps its own window per member source: trials ``T``,
sum of the estimates its nodes were priced with before this correction ``E`` (the bins' estimates
after the source correction) and hits ``H``, halved beyond ``window`` trials and emptied when a new
request takes the slot (`reset`). A round adds one trial per member that proposed verified nodes,
its nodes' mean estimate and hit rate: a retrieved chain's nodes fail together (a rejected node
rejects its subtree), so twenty nodes of one chain are one observation, not twenty (counted per
node, one failed chain of a long lookup match would move the request's price as far as twenty
independent misses, and the sources would end under-priced).

A retrieval node's estimate ``b`` (successor, suffix, corpus, lookup, outputs) is mapped through
`calibration.linear_correction` of its slot's window, with ``pseudo_trials`` of calibrated data so
that a request's first few rounds move it little. The map is monotone, so each source's ranking
within the request is its bins'; the draft and agreement members are left as the bins price them
(the stop gate's bounds on the draft frontier stay valid).

Static shapes, no host read: a gather of ``[B, NUM_MEMBERS, 3]`` per round to price, a scatter to
update. The rows are SGLang's ``req_pool_indices`` (the token history's rows); an engine whose rows
are batch positions (the vLLM worker) never calls `update`, and its windows stay empty (identity).
"""

from __future__ import annotations

import torch

from .kernels.factors import request_factors
from .numerics.correction import window_update
from .sources import SOURCE_SUCCESSOR, NUM_MEMBERS, RETRIEVAL_SOURCES

__all__ = ["RequestCorrection", "CORRECTED_MEMBERS", "window_update"]

#: The member sources a request's window corrects.
CORRECTED_MEMBERS = (SOURCE_SUCCESSOR, *RETRIEVAL_SOURCES)


class RequestCorrection:
    """Per-slot windows of (trials, estimated, hits) per member source and the correction they give.

    Args:
        slots: engine slots (grows with `ensure`).
        window: trials (rounds) per (slot, member) kept (halved beyond); 0 = off (identity, no update).
        pseudo_trials: ``a`` of `linear_correction` (> 0).
        device: where the windows live.
    Attributes:
        recent: ``float32[slots, NUM_MEMBERS, 3]`` (trials, sum of estimates, hits) per slot and member.
    Raises:
        ValueError: ``window < 0`` or ``pseudo_trials <= 0``.
    """

    def __init__(self, slots: int, window: float, pseudo_trials: float = 8.0,
                 device: torch.device | str = "cpu"):
        if window < 0:
            raise ValueError("RequestCorrection: window must be >= 0")
        if pseudo_trials <= 0:
            raise ValueError("RequestCorrection: pseudo_trials must be > 0")
        self.window, self.pseudo_trials = float(window), float(pseudo_trials)
        self.device = torch.device(device)
        self.recent = torch.zeros(max(1, slots), NUM_MEMBERS, 3, device=self.device)
        self._on = torch.zeros(NUM_MEMBERS, dtype=torch.bool, device=self.device)
        self._on[list(CORRECTED_MEMBERS)] = True
        self._off = torch.zeros_like(self._on)

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def ensure(self, slots: int) -> None:
        """Grow to at least ``slots`` rows (a host-side size check; grows once, at start-up)."""
        grow = slots - self.recent.shape[0]
        if grow > 0:
            self.recent = torch.cat([self.recent, self.recent.new_zeros(grow, NUM_MEMBERS, 3)])

    def reset(self, slot_ids: torch.Tensor) -> None:
        """Empty the windows of slots ``slot_ids`` ``int64[B]`` (a new request took them)."""
        self.recent.index_fill_(0, slot_ids.to(torch.int64), 0.0)

    def factors(self, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale float32[B, NUM_MEMBERS], under bool[B, NUM_MEMBERS])`` of the rows' slots
        ``int64[B]``; the identity (1, False) for members not in `CORRECTED_MEMBERS` and when off."""
        on = self._on if self.enabled else self._off
        return request_factors(self.recent, slot_ids, on, self.pseudo_trials)

    def update(self, slot_ids: torch.Tensor, bins: torch.Tensor, on_path: torch.Tensor,
               estimates: torch.Tensor) -> None:
        """Add one verified round to the rows' windows.

        Args:
            slot_ids: ``int64[B]`` distinct slots of the rows.
            bins: ``int64[B, N, NUM_MEMBERS]`` member bins of the round's nodes (-1: not proposed).
            on_path: ``bool[B, N]`` accepted nodes.
            estimates: the calibrator's table the round was priced with (before this correction).
        """
        if self.enabled:
            window_update(self.recent, slot_ids, bins, on_path, estimates, self.window)


