"""Cross-request output index: what earlier requests generated, as a retrieval source (host side).

SuffixDecoding's *global* suffix tree (arXiv 2411.04975 Sec. 3: one tree over previous outputs,
beside the per-request tree over the prompt): when a request stops, the tail of its prompt
(``max_match`` tokens, the context its first output tokens continue) and its output tokens are
inserted into a shared `CountTrie`; a live request matches its own context tail against it exactly
as the corpus does (`CorpusIndex`, longest match then a best-first continuation). A live request's
own tokens are never in the index (its output goes in when it stops), so this source and the
per-request suffix index do not propose the same evidence twice. SGLang's NGRAM keeps one trie of
all requests' tokens for the same reason (reference sglang-0.5.23 §3).

Isolation follows ``retrieval.isolation``: ``shared`` = one index for all traffic; ``tenant`` = one
index per tenant (SGLang: the request's ``extra_key``), at most ``max_tenants`` at once, the least
recently used one dropped when a new tenant needs room; ``request`` = nothing crosses requests and
the source is not built (`Retriever.from_config`).

Memory bound and eviction, with no rebuild stall: each index holds two generations of trie. Outputs
go into the young one; once it holds ``max_nodes // 2`` trie nodes or history tokens, the old
generation is dropped and the young one becomes old. So a group holds at most ``max_nodes`` nodes
and ``max_nodes`` tokens of the most recent outputs, plus the last insert (one request: at most
``max_request_tokens + max_match`` tokens and ``max_depth`` nodes per token) in each generation, as
the suffix index bounds a request by ``suffix_max_nodes``; every insert is O(length) amortised and a
proposal takes the longer of the two generations' matches (the young one on a tie). Inserting costs
about 2 us per token on a 2-core CPU, at request stop.

Every rank of a tensor-parallel group sees the same requests start, extend and stop in the same
order (the scheduler runs in lockstep), so the index and its proposals are identical across ranks.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from ..calibration import MEMBER_OUTPUTS
from .base import HostSource, Proposal, longest_match_proposal
from .trie import CountTrie

__all__ = ["OutputIndex"]


@dataclass
class _Generations:
    """The two trie generations of one isolation group."""

    depth: int
    old: Optional[CountTrie] = None
    young: CountTrie = field(init=False)
    young_tokens: int = 0

    def __post_init__(self) -> None:
        self.young = CountTrie(self.depth)

    def tries(self) -> list[CountTrie]:
        """Young first (it wins ties)."""
        return [self.young] + ([self.old] if self.old is not None else [])


@dataclass
class _Live:
    """A live request: its matching tail, the prompt tail and the output it will contribute
    (int32, at most ``max_request_tokens``)."""

    group: Hashable
    tail: deque
    prompt_tail: list[int]
    output: array


class OutputIndex(HostSource):
    """Earlier requests' outputs, per isolation group (see module docstring).

    Args:
        max_depth: trie depth (match + continuation), >= 2.
        max_match: longest context tail matched, < max_depth.
        min_prob: drop continuation nodes whose count-ratio path product is below this.
        max_nodes: trie nodes (and history tokens) held per group, two generations of ``max_nodes // 2``,
            >= 4 * max_depth.
        max_groups: isolation groups held at once (least recently used dropped).
        max_request_tokens: output tokens a request contributes (its first ones), >= 1; this is
            the only per-request memory of the index (4 bytes per token while the request lives).
    Raises:
        ValueError: bounds above violated.
    """

    name = "outputs"
    member = MEMBER_OUTPUTS

    def __init__(self, max_depth: int = 64, max_match: int = 16, min_prob: float = 0.1,
                 max_nodes: int = 262_144, max_groups: int = 1, max_request_tokens: int = 2048):
        if not 1 <= max_match < max_depth:
            raise ValueError("OutputIndex needs 1 <= max_match < max_depth")
        if max_nodes < 4 * max_depth:
            raise ValueError("OutputIndex max_nodes must be >= 4 * max_depth")
        if max_groups < 1 or max_request_tokens < 1:
            raise ValueError("OutputIndex max_groups and max_request_tokens must be >= 1")
        self.max_depth, self.max_match, self.min_prob = max_depth, max_match, min_prob
        self.max_nodes, self.max_groups = max_nodes, max_groups
        self.max_request_tokens = min(max_request_tokens, max_nodes // 2)
        self._groups: OrderedDict[Hashable, _Generations] = OrderedDict()
        self._live: dict[Hashable, _Live] = {}
        self.inserted = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self, req_id: Hashable, prompt_ids: Sequence[int], tenant: Optional[Hashable] = None) -> None:
        tail = [int(t) for t in prompt_ids[-self.max_match:]]
        self._live[req_id] = _Live(tenant, deque(tail, maxlen=self.max_match), tail, array("i"))

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        live = self._live.get(req_id)
        if live is None:
            return
        toks = [int(t) for t in new_tokens]
        live.tail.extend(toks[-self.max_match:])
        room = self.max_request_tokens - len(live.output)
        if room > 0:
            live.output.extend(toks[:room])

    def stop(self, req_id: Hashable) -> None:
        """Forget the request and insert its prompt tail + output into its group's index."""
        live = self._live.pop(req_id, None)
        if live is None or not live.output:
            return
        gen = self._group_to_insert(live.group)
        if max(gen.young_tokens, gen.young.num_nodes) >= self.max_nodes // 2:
            gen.old, gen.young, gen.young_tokens = gen.young, CountTrie(self.max_depth), 0
        gen.young.reset_stream()
        gen.young.extend(live.prompt_tail + live.output.tolist())
        gen.young.reset_stream()
        gen.young_tokens += len(live.prompt_tail) + len(live.output)
        self.inserted += len(live.output)

    def _group_to_insert(self, key: Hashable) -> _Generations:
        """The group's generations, made most recently used (created, evicting the least recently
        used group, when new)."""
        gen = self._groups.get(key)
        if gen is not None:
            self._groups.move_to_end(key)
            return gen
        if len(self._groups) >= self.max_groups:
            self._groups.popitem(last=False)
        gen = self._groups[key] = _Generations(self.max_depth)
        return gen

    # ------------------------------------------------------------------ queries
    def live_requests(self) -> int:
        return len(self._live)

    def index_bytes(self) -> int:
        """Bytes of the tries (shared, bounded by ``max_nodes`` per group, kept after requests stop)."""
        return sum(t.memory_bytes() for g in self._groups.values() for t in g.tries())

    def memory_bytes(self) -> int:
        """`index_bytes` plus the live requests' buffers (``4 * max_request_tokens + 72 * max_match
        + 64`` bytes each at most)."""
        return self.index_bytes() + sum(64 + 4 * len(v.output) + 72 * self.max_match for v in self._live.values())

    def propose(self, req_id: Hashable, budget: int) -> Proposal:
        """Longest match of the request's context tail in its group's index, then its continuation."""
        live = self._live.get(req_id)
        gen = self._groups.get(live.group) if live is not None else None
        if gen is None or budget <= 0:
            return Proposal()
        return longest_match_proposal(gen.tries(), list(live.tail), self.max_match, budget, self.min_prob)
