"""The fixed-size candidate buffer that carries host-side proposals to the device graft step.

Host sources (suffix index, corpus) run on the CPU, off the critical path: the adapter fills one row
per request while the accelerator drafts, then uploads the whole batch with one non-blocking copy
from pinned memory (`HostCandidateBuffer.upload`). The step sees fixed shapes whatever the sources
found: ``[B, M]`` candidates, invalid slots marked, plus the length of the context each row was
anchored at (the device compares it with its own committed length to re-anchor, step.py).

Layout of the staging tensor ``int64[max_batch, 5, M + 1]`` (one contiguous block per row):
row 0 tokens, 1 parents (-1 = child of the anchor), 2 log-probabilities (float64 bit patterns),
3 member source (-1 = empty slot), 4 match length; column M holds the anchor length (row 0), the
request's successor-table isolation group (row 1) and whether it speculates (row 2: 0 = the request
opted out of speculation, its tree carries no candidate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..kernels.views import HostBlock
from .base import Proposal

__all__ = ["HostCandidates", "HostCandidateBuffer", "copy_unless_same"]


def copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` unless ``src`` already is ``dst`` (same memory, strides and shape): an
    input the engine wrote in place is not copied onto itself."""
    if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride() or src.shape != dst.shape:
        dst.copy_(src)


@dataclass
class HostCandidates:
    """Host proposals of a batch, on the device.

    Attributes:
        tokens: ``int64[B, M]``.
        parents: ``int64[B, M]`` index of the parent candidate, -1 = child of the anchor.
        logp: ``float32[B, M]`` log of the source's path probability anchor -> node.
        member: ``int64[B, M]`` calibration member (one of RETRIEVAL_SOURCES), -1 = empty.
        match: ``int64[B, M]`` context tokens the proposal was matched on.
        anchor_len: ``int64[B]`` tokens of context (prompt + outputs) the host had seen; the anchor is
            the last of them.
        group: ``int64[B]`` the request's successor-table isolation group.
        speculate: ``bool[B]`` False for requests that opted out of speculation (no candidate of
            any source enters their tree; step.py).
        packed: the uploaded ``int64[B, 5, M + 1]`` block the fields were read from (`unpack`; module
            docstring), None when the fields were built one by one (a copy that changes a field sets
            it to None).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    logp: torch.Tensor
    member: torch.Tensor
    match: torch.Tensor
    anchor_len: torch.Tensor
    group: torch.Tensor
    speculate: Optional[torch.Tensor] = None
    packed: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.speculate is None:
            self.speculate = torch.ones_like(self.anchor_len, dtype=torch.bool)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def block(self) -> HostBlock:
        """The proposals' fields as the fused ops read them (`HostBlock`)."""
        return HostBlock(self.tokens, self.parents, self.logp, self.match, self.member, self.anchor_len)

    @staticmethod
    def unpack(block: torch.Tensor) -> "HostCandidates":
        """The fields of a packed block ``int64[B, 5, M + 1]`` (module docstring): views, plus two ops
        (the log-probabilities to ``float32``, the speculate flags to ``bool``)."""
        m = block.shape[2] - 1
        return HostCandidates(tokens=block[:, 0, :m], parents=block[:, 1, :m],
                              logp=block[:, 2, :m].view(torch.float64).float(), member=block[:, 3, :m],
                              match=block[:, 4, :m], anchor_len=block[:, 0, m], group=block[:, 1, m],
                              speculate=block[:, 2, m] != 0, packed=block)

    def pack_into(self, block: torch.Tensor) -> None:
        """Write the first ``B`` rows of a packed block ``int64[>= B, 5, M + 1]`` (the inverse of `unpack`):
        nothing when this batch was uploaded into those rows (`HostCandidateBuffer.upload` ``out``),
        one copy when it came packed elsewhere, else one per field (log-probabilities as ``float64``)."""
        b, m = self.tokens.shape
        if self.packed is not None and self.packed.shape[1:] == block.shape[1:]:
            copy_unless_same(block[:b], self.packed)
            return
        for row, field in ((0, self.tokens), (1, self.parents), (3, self.member), (4, self.match)):
            block[:b, row, :m].copy_(field)
        block[:b, 2, :m].view(torch.float64).copy_(self.logp)
        for row, field in enumerate((self.anchor_len, self.group, self.speculate)):
            block[:b, row, m].copy_(field)

    @staticmethod
    def empty(batch: int, width: int, device: torch.device | str = "cpu") -> "HostCandidates":
        """A batch without proposals (every slot empty, anchor length 0)."""
        z = torch.zeros(batch, width, dtype=torch.int64, device=device)
        zb = torch.zeros(batch, dtype=torch.int64, device=device)
        return HostCandidates(z, z - 1, torch.full((batch, width), -float("inf"), device=device), z - 1, z, zb,
                              zb.clone())


class HostCandidateBuffer:
    """Pinned staging rows for `HostCandidates` and their upload.

    Two staging blocks alternate: `upload` starts a non-blocking copy of the block the host just
    filled and the host fills the other one next round. On CUDA the host's next write into a block
    first waits for the event recorded after that block's copy two uploads earlier (long finished
    by then: the overlap scheduler runs the host one round ahead of the device), so an in-flight
    copy never reads rows the host is rewriting.

    Args:
        max_batch: rows (the engine's largest batch).
        width: M, candidates per request.
        device: the device the step runs on; the staging memory is pinned when it is a CUDA device.
    """

    def __init__(self, max_batch: int, width: int, device: torch.device | str = "cpu"):
        self.width, self.device = max(width, 0), torch.device(device)
        pin = self.device.type == "cuda"
        self._blocks = [torch.zeros(max(1, max_batch), 5, width + 1, dtype=torch.int64, pin_memory=pin)
                        for _ in range(2)]
        self._copied: list = [None, None]     # CUDA event after each block's last upload
        self._use(0)

    def _use(self, block: int) -> None:
        """Make ``block`` the one the host fills (waiting for its previous upload to finish)."""
        event = self._copied[block]
        if event is not None:
            event.synchronize()
        self._cur = block
        self.staging = self._blocks[block]
        self._np = self.staging.numpy()
        self._logp = self._np[:, 2, : self.width].view(np.float64)

    @property
    def max_batch(self) -> int:
        return self.staging.shape[0]

    def ensure(self, batch: int) -> None:
        """Grow the staging rows to at least ``batch`` (start-up sizing; not on the decode path)."""
        if batch > self.max_batch:
            self.__init__(batch, self.width, self.device)

    def clear(self, row: int, anchor_len: int, group: int = 0, speculate: bool = True) -> None:
        """Empty a row and set its anchor length, isolation group and opt-out flag."""
        r = self._np[row]
        r[3, :] = -1
        r[0, self.width] = anchor_len
        r[1, self.width] = group
        r[2, self.width] = int(speculate)

    def put(self, row: int, offset: int, member: int, proposal: Proposal) -> int:
        """Write a proposal at columns ``offset ..`` of ``row`` (parents re-based); returns the number
        of candidates written (truncated to the row's remaining width: a prefix of a best-first,
        topological proposal stays ancestor-closed)."""
        n = min(len(proposal), self.width - offset)
        if n <= 0:
            return 0
        r = self._np[row]
        sl = slice(offset, offset + n)
        r[0, sl] = proposal.tokens[:n]
        par = np.asarray(proposal.parents[:n], dtype=np.int64)
        r[1, sl] = np.where(par >= 0, par + offset, -1)
        self._logp[row, sl] = np.log(np.maximum(np.asarray(proposal.probs[:n], dtype=np.float64), 1e-30))
        r[3, sl] = member
        r[4, sl] = max(1, proposal.match_len)
        return n

    def upload(self, batch: int, out: Optional[torch.Tensor] = None) -> HostCandidates:
        """The first ``batch`` rows on the device: one (non-blocking, from pinned memory) copy, into
        ``out`` (``int64[batch, 5, M + 1]`` on the device, e.g. the captured step's input block,
        `graft_spec.graphs.StepGraphs.host_destination`) when given, else into a new tensor; the
        host then fills the other staging block."""
        if out is not None:
            dev = out.copy_(self.staging[:batch], non_blocking=True)
        else:
            dev = self.staging[:batch].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copied[self._cur] = event
        self._use(1 - self._cur)
        return HostCandidates.unpack(dev)
