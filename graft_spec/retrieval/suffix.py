"""Per-request suffix index over prompt + generated tokens (SuffixDecoding-style, host side).

Each live request owns a `CountTrie` of depth ``max_depth`` over its own token stream. After
``extend`` the trie's live suffixes end at the newest token; the longest of them (<= ``max_match``
tokens) that occurred earlier *with a continuation* is the match, found by scanning at most
``max_match`` live nodes (O(match) per step, no walk). The continuation subtree is expanded
best-first by count ratios (`CountTrie.expand`) up to the budget, so a long, repeated match yields a
deep chain (up to ``max_depth - match`` tokens): how deep the graft step takes it is decided by its
calibrated estimates (SuffixDecoding, arXiv 2411.04975, lets its budget grow with match length).

Memory bound and eviction: a request's trie holds at most ``max_nodes`` nodes and ``max_nodes``
history tokens (+ one append). When an append crosses either cap, the trie is rebuilt from the most
recent ``max_nodes // (2 * max_depth)`` tokens (older context is forgotten, newest kept), so the
rebuild cost amortises to O(max_depth) per token. A call with more than ``max_nodes // max_depth``
new tokens (a long prompt) inserts only the newest that many, so no call costs more than
``max_nodes`` node updates. ``stop`` frees everything.

Reference: ArcticInference suffix decoding (per-request tree over prompt + output, count-ratio
scores, min_token_prob pruning) — docs/suffix-decoding.rst.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

from ..sources import SOURCE_SUFFIX
from .base import HostSource, Proposal
from .trie import CountTrie

__all__ = ["SuffixIndex"]


class SuffixIndex(HostSource):
    """Per-request suffix tries.

    Args:
        max_depth: trie depth (match + continuation length), >= 2.
        max_match: longest context suffix used for matching, < max_depth.
        min_prob: drop continuation nodes whose path count-ratio product is below this.
        max_nodes: per-request node cap (eviction described in the module docstring).
    """

    name = "suffix"
    member = SOURCE_SUFFIX

    def __init__(self, max_depth: int = 64, max_match: int = 16, min_prob: float = 0.1,
                 max_nodes: int = 200_000):
        if not 1 <= max_match < max_depth:
            raise ValueError("SuffixIndex needs 1 <= max_match < max_depth")
        if max_nodes < 4 * max_depth:
            raise ValueError("SuffixIndex max_nodes must be >= 4 * max_depth")
        self.max_depth, self.max_match, self.min_prob = max_depth, max_match, min_prob
        self.max_nodes = max_nodes
        self._tries: dict[Hashable, CountTrie] = {}
        self.rebuilds = 0

    @property
    def window(self) -> int:
        """Tokens a rebuild keeps: ``max_nodes // (2 * max_depth)``, at least 2."""
        return max(2, self.max_nodes // (2 * self.max_depth))

    @property
    def max_insert(self) -> int:
        """The most tokens one call inserts (``max_nodes // max_depth``: a call that inserts more could
        not stay under the node cap in the worst case): a longer prompt keeps its newest ones, so no
        call costs more than ``max_nodes`` node updates."""
        return max(self.window, self.max_nodes // self.max_depth)

    def start(self, req_id: Hashable, prompt_ids: Sequence[int], tenant: Optional[Hashable] = None) -> None:
        self._tries[req_id] = CountTrie(self.max_depth)
        self.extend(req_id, prompt_ids)

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        trie = self._tries.get(req_id)
        if trie is None or len(new_tokens) == 0:
            return
        if len(new_tokens) > self.max_insert:
            # a long prompt (or a long catch-up): inserting it all would take len * max_depth node
            # updates on the decode path; its newest max_insert tokens start a fresh trie instead
            fresh = CountTrie(self.max_depth)
            fresh.extend(list(new_tokens[-self.max_insert:]))
            self._tries[req_id] = fresh
            self.rebuilds += 1
            trie = fresh
        else:
            trie.extend(new_tokens)
        if trie.num_nodes > self.max_nodes or len(trie.hist) > self.max_nodes:
            fresh = CountTrie(self.max_depth)
            fresh.extend(trie.hist[-self.window:])
            self._tries[req_id] = fresh
            self.rebuilds += 1

    def stop(self, req_id: Hashable) -> None:
        self._tries.pop(req_id, None)

    def live_requests(self) -> int:
        return len(self._tries)

    def memory_bytes(self) -> int:
        return sum(t.memory_bytes() + 64 for t in self._tries.values())

    def num_nodes(self, req_id: Hashable) -> int:
        """Trie nodes held for ``req_id`` (0 if unknown)."""
        trie = self._tries.get(req_id)
        return trie.num_nodes if trie else 0

    def propose(self, req_id: Hashable, budget: int) -> Proposal:
        """Longest match of the request's context tail, then its best-first continuation."""
        trie = self._tries.get(req_id)
        if trie is None or budget <= 0:
            return Proposal()
        loc, length = trie.active_match(self.max_match)
        if loc is None:
            return Proposal()
        toks, pars, probs = trie.expand(loc, budget, self.min_prob)
        return Proposal(toks, pars, probs, length)
