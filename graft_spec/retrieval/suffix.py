"""Per-request suffix index over prompt + generated tokens (SuffixDecoding-style).

Each live request owns a `CountTrie` of depth ``max_depth`` over its own token stream.
After ``extend`` the trie's live suffixes end at the newest token, which by the
contract in base.py is the next root; the longest of them (<= ``max_match`` tokens) that
occurred earlier *with a continuation* is the match, found by scanning at most
``max_match`` live nodes (O(match) per step, no walk). The continuation subtree is
expanded best-first by count ratios (`CountTrie.expand`).

Memory bound and eviction: a request's trie holds at most ``max_nodes`` nodes and
``max_nodes`` history tokens (+ one append). When an append crosses either cap, the
trie is rebuilt from the most recent ``max_nodes // (2 * max_depth)`` tokens (older
context is forgotten, newest kept), so the rebuild cost amortises to O(max_depth) per
token. ``stop`` frees everything.

Reference: ArcticInference suffix decoding (per-request tree over prompt + output,
count-ratio scores, min_token_prob pruning) — docs/suffix-decoding.rst.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from .base import Candidates, RetrievalSource
from .trie import CountTrie, Loc

__all__ = ["SuffixIndex"]


class _Req:
    __slots__ = ("trie", "last")

    def __init__(self, depth: int):
        self.trie = CountTrie(depth)
        self.last = -1


class SuffixIndex(RetrievalSource):
    """Per-request suffix tries.

    Args:
        max_depth: trie depth (match + continuation length), >= 2.
        max_match: longest context suffix used for matching, < max_depth.
        min_prob: drop continuation nodes whose path frequency product is below this.
        max_nodes: per-request node cap (eviction described in the module docstring).
        max_candidates: cap on proposed nodes per request.
        device: device of the returned tensors.
    """

    name = "suffix"

    def __init__(self, max_depth: int = 16, max_match: int = 8, min_prob: float = 0.1,
                 max_nodes: int = 200_000, max_candidates: int = 64,
                 device: torch.device | str = "cpu"):
        if not 1 <= max_match < max_depth:
            raise ValueError("SuffixIndex needs 1 <= max_match < max_depth")
        if max_nodes < 4 * max_depth:
            raise ValueError("SuffixIndex max_nodes must be >= 4 * max_depth")
        self.max_depth, self.max_match, self.min_prob = max_depth, max_match, min_prob
        self.max_nodes, self.max_candidates = max_nodes, max_candidates
        self.device = torch.device(device)
        self._reqs: dict[Hashable, _Req] = {}
        self.rebuilds = 0

    def start(self, req_id: Hashable, prompt_ids: Sequence[int]) -> None:
        self._reqs[req_id] = _Req(self.max_depth)
        self.extend(req_id, prompt_ids)

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        st = self._reqs.get(req_id)
        if st is None or len(new_tokens) == 0:
            return
        st.trie.extend(new_tokens)
        st.last = int(new_tokens[-1])
        if st.trie.num_nodes > self.max_nodes or len(st.trie.hist) > self.max_nodes:
            self._rebuild(st)

    def _rebuild(self, st: _Req) -> None:
        keep = max(2, self.max_nodes // (2 * self.max_depth))
        recent = st.trie.hist[-keep:]
        st.trie = CountTrie(self.max_depth)
        st.trie.extend(recent)
        self.rebuilds += 1

    def stop(self, req_id: Hashable) -> None:
        self._reqs.pop(req_id, None)

    def live_requests(self) -> int:
        return len(self._reqs)

    def memory_bytes(self) -> int:
        return sum(st.trie.memory_bytes() + 64 for st in self._reqs.values())

    def num_nodes(self, req_id: Hashable) -> int:
        """Trie nodes held for ``req_id`` (0 if unknown)."""
        st = self._reqs.get(req_id)
        return st.trie.num_nodes if st else 0

    def match(self, req_id: Hashable, root: int) -> tuple[Optional[Loc], int]:
        """``(trie location, match length)`` for the request's context ending in ``root``."""
        st = self._reqs.get(req_id)
        if st is None:
            return None, 0
        if st.last == root:
            return st.trie.active_match(self.max_match)
        hist = st.trie.hist
        tail = hist[len(hist) - (self.max_match - 1):] + [root] if self.max_match > 1 else [root]
        return st.trie.longest_match(tail, self.max_match)

    def propose(self, req_ids: Sequence[Hashable], root_tokens: torch.Tensor, budget: int) -> Candidates:
        """Per request: longest match, then best-first continuation (<= budget nodes)."""
        b = len(req_ids)
        cap = min(budget, self.max_candidates)
        if cap <= 0 or not self._reqs:
            return Candidates.empty(b, self.device)
        roots = root_tokens.reshape(-1).tolist()
        rows = []
        for rid, root in zip(req_ids, roots):
            loc, _ = self.match(rid, int(root))
            rows.append(self._reqs[rid].trie.expand(loc, cap, self.min_prob) if loc is not None else None)
        return Candidates.from_lists(rows, self.device)
