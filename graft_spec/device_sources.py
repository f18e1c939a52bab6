"""The retrieval sources of a round, behind one interface.

Each source the step reads on device is one `DeviceSource`: ``propose(r)`` turns the round's inputs
(`RoundInputs`) into one priced `Candidates` block ``[B, C]`` (one fused op on a CUDA device,
graft_spec/kernels/), or None when it has nothing to propose this round. `GraftStep.retrieve` runs
its sources in tree order and stacks their blocks after the draft's; adding a source is one class
here and one entry in `device_sources`.

| source | members | op |
|---|---|---|
| `SuccessorSource` | successor | ``graft::successor_part`` (kernels/successor_part.py) |
| `ChainSource` | lookup, outputs | ``graft::chain_part`` (kernels/chain_part.py) |
| `HostProposalSource` | suffix, corpus | ``graft::host_part`` (kernels/host_part.py) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .calibration import Calibrator
from .config import GraftConfig
from .kernels.chain_part import chain_part
from .kernels.host_part import host_part
from .kernels.successor_part import successor_part
from .kernels.views import Candidates, ChainOptions, Prices, Windows
from .retrieval.buffer import HostCandidates
from .numerics.lookup import LOOKUP_MAX_MATCH
from .retrieval.output_ring import OutputRing
from .retrieval.successor import SuccessorTable
from .sources import SOURCE_SUCCESSOR

__all__ = ["RoundInputs", "DeviceSource", "SuccessorSource", "ChainSource", "HostProposalSource", "device_sources"]


@dataclass
class RoundInputs:
    """What a source may read in one round, for the ``B`` rows of the batch.

    Attributes:
        roots: ``int64[B]`` root tokens.
        host: `HostCandidates` ``[B, M]`` (its ``group``: each row's successor-table isolation group).
        hist, count: ``int64[B, L]`` / ``int64[B]`` the slots' token windows (history.py), ending
            with the root.
        seq_lens: ``int64[B]`` committed tokens before the root.
        sampled: ``bool[B]`` rows verified by sampling.
        est_table: ``float32`` the calibrator's estimate table (`Calibrator.table`).
        factors: the rows' per-request correction ``(scale float32[B, NUM_MEMBERS], under
            bool[B, NUM_MEMBERS])`` (`RequestCorrection.factors`; the identity when uncorrected).
    """

    roots: torch.Tensor
    host: HostCandidates
    hist: torch.Tensor
    count: torch.Tensor
    seq_lens: torch.Tensor
    sampled: torch.Tensor
    est_table: torch.Tensor
    factors: tuple[torch.Tensor, torch.Tensor]

    @property
    def windows(self) -> Windows:
        """The rows' token windows (`Windows`)."""
        return Windows(self.hist, self.count)

    @property
    def prices(self) -> Prices:
        """What the round prices with (`Prices`)."""
        return Prices(self.est_table, *self.factors)


class DeviceSource:
    """A retrieval source of the step: ``propose`` returns its priced candidates of a round.

    Subclasses implement `args` (the arguments of their op for a round) and `op`; `propose` calls
    one with the other. Static shapes only: what a source proposes may depend on the data, how many
    candidates it returns may not."""

    #: the fused op (a `graft_spec.kernels` dispatcher: the kernel on CUDA, the reference elsewhere)
    op = None

    def args(self, r: RoundInputs) -> Optional[tuple]:
        """The op's arguments for round ``r``, or None when the source proposes nothing (a static
        property of the source or of the input's shapes, never of its values)."""
        raise NotImplementedError

    def propose(self, r: RoundInputs) -> Optional[Candidates]:
        """``Candidates`` ``[B, C]``: parents within the block (-1 = a child of the root), estimates
        through the rows' correction; None when `args` is None."""
        a = self.args(r)
        return None if a is None else Candidates(*type(self).op(*a))


class SuccessorSource(DeviceSource):
    """The successor table's template under each root (retrieval/successor.py; token recycling)."""

    op = staticmethod(successor_part)

    def __init__(self, table: SuccessorTable, calibrator: Calibrator):
        self.table, self.calibrator = table, calibrator

    def args(self, r: RoundInputs) -> tuple:
        """Arguments of `kernels.successor_part.successor_part`."""
        lay = self.calibrator.layout
        return (r.roots, r.host.group, r.sampled, self.table.view, r.prices, lay.offset(SOURCE_SUCCESSOR),
                lay.per_mode)


class ChainSource(DeviceSource):
    """The device chains: prompt lookup in the slot's history (numerics/lookup.py), then the output
    index's two (retrieval/output_ring.py, on the rows ``retrieval.outputs`` gives them to), each
    ``depth`` deep.

    Args:
        lookup: whether prompt lookup is on.
        ring: the output index, or None when off.
        calibrator: the engine's `Calibrator`.
        depth: chain length (N - 1).
        outputs_modes: ``(greedy, sampled)`` rows the output index serves (`RetrievalConfig.outputs_modes`).
    """

    op = staticmethod(chain_part)

    def __init__(self, lookup: bool, ring: Optional[OutputRing], calibrator: Calibrator, depth: int,
                 outputs_modes: tuple[bool, bool]):
        self.lookup, self.ring, self.calibrator = lookup, ring, calibrator
        self.depth, self.outputs_modes = depth, outputs_modes

    def args(self, r: RoundInputs) -> tuple:
        """Arguments of `kernels.chain_part.chain_part`."""
        return (r.windows, r.host.group, r.sampled, r.prices, self.calibrator.retrieval_view,
                self.ring.view if self.ring is not None else None,
                ChainOptions(self.depth, LOOKUP_MAX_MATCH if self.lookup else 0, *self.outputs_modes))


class HostProposalSource(DeviceSource):
    """The host proposals (suffix, corpus; retrieval/buffer.py), re-anchored at the device's root
    (`step.reanchor`) and priced. Proposes nothing when the host buffer has no columns."""

    op = staticmethod(host_part)

    def __init__(self, calibrator: Calibrator):
        self.calibrator = calibrator

    def args(self, r: RoundInputs) -> Optional[tuple]:
        """Arguments of `kernels.host_part.host_part`, or None for a zero-width host buffer."""
        if r.host.width == 0:
            return None
        return r.host.block, r.windows, r.seq_lens, r.sampled, r.prices, self.calibrator.retrieval_view


def device_sources(config: GraftConfig, calibrator: Calibrator, successor: Optional[SuccessorTable],
                   outputs: Optional[OutputRing]) -> list[DeviceSource]:
    """The enabled sources of ``config``, in tree order (successor, chains, host).

    Args:
        config: validated `GraftConfig` (``retrieval.lookup``, ``retrieval.outputs_modes``,
            ``num_draft_tokens``).
        calibrator: the engine's `Calibrator`.
        successor: the successor table, or None when disabled.
        outputs: the output index, or None when disabled.
    """
    sources: list[DeviceSource] = []
    if successor is not None:
        sources.append(SuccessorSource(successor, calibrator))
    if config.retrieval.lookup or outputs is not None:
        sources.append(ChainSource(config.retrieval.lookup, outputs, calibrator, config.num_draft_tokens - 1,
                                   tuple(config.retrieval.outputs_modes)))
    sources.append(HostProposalSource(calibrator))
    return sources
