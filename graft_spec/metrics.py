"""Small accumulators for speculative-decoding statistics (host side, cheap).

* tau: mean accepted tokens per verify step per request, bonus included (Spec-Bench
  "#Mean accepted tokens"; SGLang meta_info.spec_accept_length).
* accept-length histogram, verified tokens per step (tree nodes sent to the target),
  per-source share of accepted draft tokens, pruning-stage histogram.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from .sources import NUM_SOURCES, SOURCE_NAMES
from .verify import VerifyResult

__all__ = ["AcceptanceStats"]


@dataclass
class AcceptanceStats:
    """Running totals over verify steps (one step = one request verified once)."""

    steps: int = 0
    emitted: int = 0
    verified: int = 0
    by_source: list = field(default_factory=lambda: [0] * NUM_SOURCES)
    hist: Counter = field(default_factory=Counter)
    stages: Counter = field(default_factory=Counter)

    def update(self, result: VerifyResult, num_verified: Optional[torch.Tensor | int] = None,
               stage: Optional[torch.Tensor] = None) -> None:
        """Add one batched verify step.

        Args:
            result: `VerifyResult` of the step.
            num_verified: tree nodes verified per request (``int64[B]``) or one int for
                all rows; default: the tree width N.
            stage: ``int64[B]`` `PruneResult.stage` (-1 = no pruning).
        """
        lens = result.accept_length.tolist()
        b = len(lens)
        self.steps += b
        self.emitted += sum(lens)
        self.hist.update(lens)
        if num_verified is None:
            num_verified = result.accept_index.shape[1]
        if isinstance(num_verified, torch.Tensor):
            self.verified += int(num_verified.sum().item())
        else:
            self.verified += int(num_verified) * b
        for i, c in enumerate(result.accepted_by_source.sum(dim=0).tolist()):
            self.by_source[i] += int(c)
        if stage is not None:
            self.stages.update(stage.tolist())

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step (bonus included); 0.0 before any step."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def verified_per_step(self) -> float:
        return self.verified / self.steps if self.steps else 0.0

    def source_share(self) -> dict[str, float]:
        """Fraction of accepted draft tokens (bonus excluded) by source."""
        tot = sum(self.by_source)
        return {name: (c / tot if tot else 0.0) for name, c in zip(SOURCE_NAMES, self.by_source)}

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tau": self.tau,
            "verified_per_step": self.verified_per_step,
            "accept_length_hist": {int(k): int(v) for k, v in sorted(self.hist.items())},
            "accepted_by_source": dict(zip(SOURCE_NAMES, self.by_source)),
            "source_share": self.source_share(),
            "stage_hist": {int(k): int(v) for k, v in sorted(self.stages.items())},
        }
