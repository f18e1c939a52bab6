"""Cross-request output index on the device: earlier requests' outputs matched with no lag.

SuffixDecoding's global tree over previous outputs (arXiv 2411.04975 Sec. 3), kept where the graft
step runs so it matches the context the *device* has: under the overlap scheduler the host sees a
request's tokens a round late, and a host index proposes from that stale tail, most of which
re-anchoring then has to drop (a round after a rejection, nearly all of it).

Layout (all device tensors, fixed sizes):

* ``ring int64[C]``: the last C tokens inserted (prompt tail + output of each finished request,
  then a -1 separator), written at absolute positions ``0, 1, 2, ...`` modulo C; ``tag int64[C]``
  the isolation group of each position.
* ``table int64[K, H]``: for each match length m in `MATCH_LENGTHS` (<= ``max_match``), the latest
  absolute position of an m-gram whose hash falls in each of H slots (H = the power of two >= 2C);
  -1 = empty. An entry is trusted only after its m tokens and group are compared, so a hash
  collision or an overwritten position only loses a proposal.

`insert` runs when a request stops (host-driven, variable length, off the decode path; every rank of
a tensor-parallel group inserts the same requests in the same order). `propose` is part of the graft
step: for every row it hashes the last m tokens of the slot's history (history.py) for each m, reads
one slot per m, verifies it and takes the longest verified match; the continuation is the ring's
tokens after it, up to the separator (a chain, like the lookup source), and a second chain from the
longest match that continues differently; they are priced by the calibrator by depth and match
length, member ``outputs``. Static shapes, no host read, and a fixed number of ops whatever the
number of match lengths: every tail's hash comes from one prefix sum (`numerics.hashing.tail_hashes`)
and every match is verified by one gather.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ..kernels.chain_part import CHAINS, outputs_propose_reference
from ..kernels.views import RingView, Windows
from ..numerics.hashing import mgram_hash, wrap64
from ..tree import HASH_POW

__all__ = ["CHAINS", "MATCH_LENGTHS", "OutputRing"]

#: Context-tail lengths matched (those <= max_match are used); the longest verified one wins.
MATCH_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)



@dataclass
class _Live:
    """A live request's host-side record: the prompt tail and the output it will contribute (int32)."""

    group: int
    prompt_tail: array
    output: array


class OutputRing:
    """Earlier requests' outputs in a device ring with m-gram hash tables (see module docstring).

    Isolation (``retrieval.isolation``): every position carries its request's isolation group and a
    row matches only its own group's positions; ``shared`` is group 0 for all, ``tenant`` the
    tenant's group (`forget_group` when a group passes to another tenant), ``request`` does not
    build the index (nothing crosses requests).

    Args:
        capacity: C, tokens held (the newest), >= 64.
        max_match: longest context tail matched (>= 1).
        depth: D, continuation length proposed (>= 1).
        max_request_tokens: output tokens a request contributes (its first ones), >= 1.
        device: where the ring lives (the engine's device).
    Raises:
        ValueError: bounds above violated.
    """

    name = "outputs"   # memory_bytes_by_source key on /server_info
    MATCH_LENGTHS = MATCH_LENGTHS

    def __init__(self, capacity: int, max_match: int, depth: int, max_request_tokens: int = 2048,
                 device: torch.device | str = "cpu"):
        if capacity < 64 or max_match < 1 or depth < 1 or max_request_tokens < 1:
            raise ValueError("OutputRing needs capacity >= 64, max_match >= 1, depth >= 1, max_request_tokens >= 1")
        self.capacity, self.depth = capacity, depth
        self.max_request_tokens = min(max_request_tokens, capacity // 2)
        self.lengths = tuple(m for m in MATCH_LENGTHS if m <= max_match)
        self.max_match = self.lengths[-1]
        self._lengths = torch.tensor(self.lengths, dtype=torch.int64, device=device)
        self._pow_r = torch.tensor([wrap64(HASH_POW ** r) for r in range(self.max_match)], dtype=torch.int64,
                                   device=device)
        self._pow_m = torch.tensor([wrap64(HASH_POW ** m) for m in self.lengths], dtype=torch.int64, device=device)
        self.device = torch.device(device)
        self.slots = 1 << max(1, (2 * capacity - 1).bit_length())
        self.ring = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self.tag = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self.table = torch.full((len(self.lengths), self.slots), -1, dtype=torch.int64, device=self.device)
        self.total = torch.zeros((), dtype=torch.int64, device=self.device)   # absolute write position
        self._total = 0                                                        # its host copy
        self._live: dict[Hashable, _Live] = {}
        self.inserted = 0

    # ------------------------------------------------------------------ host lifecycle
    def start(self, req_id: Hashable, prompt_ids: Sequence[int], group: int = 0, keep: bool = True) -> None:
        """A new request (restarts it): its prompt tail is kept to precede its output in the ring.

        ``keep=False``: the request's output is not inserted (a request of a mode the index does not
        propose to; `GraftPlanner.start_request`)."""
        if not keep:
            self._live.pop(req_id, None)
            return
        self._live[req_id] = _Live(int(group), array("i", (int(t) for t in prompt_ids[-self.max_match:])), array("i"))

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        """Output tokens committed for ``req_id`` (host view, in order)."""
        live = self._live.get(req_id)
        if live is not None:
            room = self.max_request_tokens - len(live.output)
            if room > 0:
                live.output.extend(int(t) for t in list(new_tokens)[:room])

    def stop(self, req_id: Hashable) -> None:
        """Forget the request and insert its prompt tail + output (nothing when it has no output)."""
        live = self._live.pop(req_id, None)
        if live is not None and live.output:
            self.insert(live.prompt_tail.tolist() + live.output.tolist(), live.group)
            self.inserted += len(live.output)

    def live_requests(self) -> int:
        return len(self._live)

    def index_bytes(self) -> int:
        """Device bytes of the ring, its tags and the tables: fixed at construction,
        ``8 * (2 C + K H)`` with K match lengths and H <= 4 C slots each."""
        return 8 * (2 * self.capacity + self.table.numel())

    def memory_bytes(self) -> int:
        """`index_bytes` plus the live requests' host records (at most ``4 * (max_request_tokens +
        max_match) + 200`` bytes each)."""
        return self.index_bytes() + sum(4 * (len(v.prompt_tail) + len(v.output)) + 200 for v in self._live.values())

    # ------------------------------------------------------------------ device updates
    def insert(self, tokens: Sequence[int], group: int = 0) -> None:
        """Append ``tokens`` and a separator, and record the latest position of every m-gram.

        Host-driven (one upload of the tokens, fixed ops per match length); called at request stop.
        """
        toks = [int(t) for t in tokens][-(self.capacity // 2):]
        n = len(toks)
        if n == 0:
            return
        start = self._total
        seq = torch.tensor(toks + [-1], dtype=torch.int64, device=self.device)
        pos = start + torch.arange(n + 1, device=self.device)
        self.ring.index_copy_(0, pos % self.capacity, seq)
        self.tag.index_copy_(0, pos % self.capacity, torch.full_like(seq, int(group)))
        for k, m in enumerate(self.lengths):
            if m > n:
                break
            windows = seq[:n].unfold(0, m, 1)                                     # [n - m + 1, m]
            slot = mgram_hash(windows, torch.full((windows.shape[0],), int(group), device=self.device)) \
                & (self.slots - 1)
            self.table[k].scatter_reduce_(0, slot, pos[m - 1:n], reduce="amax", include_self=True)
        self._total = start + n + 1
        self.total.fill_(self._total)

    def clear(self) -> None:
        """Forget every earlier output (SGLang's ``/flush_cache``): the ring, tags and tables are
        emptied in place (CUDA graphs keep their addresses); live requests keep their records."""
        for t in (self.ring, self.tag, self.table):
            t.fill_(-1)
        self.total.zero_()
        self._total = 0

    def forget_group(self, group: int) -> None:
        """Drop every position of ``group`` (its isolation group was handed to another tenant)."""
        self.tag.masked_fill_(self.tag == int(group), -1)

    # ------------------------------------------------------------------ the step
    def propose(self, hist: torch.Tensor, count: torch.Tensor, groups: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Continuations of every row's context tail from the ring (static shapes, no host read).

        Chain 0 continues the longest verified match; chain 1 the longest verified match whose next
        token differs from chain 0's (a shorter tail's latest occurrence elsewhere: the branch a
        count trie would also offer). Both are priced by their own match length.

        Args:
            hist: ``int64[B, L]`` right-aligned windows ending with the root; count: ``int64[B]``
                valid tokens at their right end; groups: ``int64[B]`` isolation groups.
        Returns:
            ``(tokens int64[B, CHAINS, D], valid bool[B, CHAINS, D], match int64[B, CHAINS])``: node t
            of a chain at depth t + 1 (its parent is node t - 1, the root for t = 0); ``match`` = the
            matched tail length (0 = no match, nothing valid).
        """
        return outputs_propose_reference(Windows(hist, count), groups, self.view, self.depth)

    @property
    def view(self) -> RingView:
        """The ring's device tensors as the fused ops read them (`RingView`)."""
        return RingView(self.ring, self.tag, self.table, self.total, self._lengths, self._pow_r, self._pow_m,
                        list(self.lengths))
