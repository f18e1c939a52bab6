"""Depth-limited counting trie over token streams (shared by suffix.py and corpus.py).

Every substring of length <= ``depth`` of the appended streams is a path from the root;
a node's ``count`` is how many times that substring ended a stream position. Appending
one token costs <= ``depth`` dict operations (the stream's live suffixes are kept in
``active``); a node count therefore grows by at most ``depth`` per token.

Continuations are expanded best-first by the product of ``count(child) / count(node)``
(the empirical next-token frequency, as ArcticInference's suffix trees do), pruned below
``min_prob`` and capped at ``budget`` nodes, so proposing costs O(budget log budget).

Storage is flat: one dict ``(node << 32 | token) -> child`` plus ``array('q')`` columns
(count, first child, next sibling, token), roughly 100-150 bytes per node in CPython.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from typing import Optional, Sequence

__all__ = ["CountTrie"]

_SHIFT = 32


class CountTrie:
    """Counting trie of all substrings up to ``depth`` tokens.

    Args:
        depth: maximum substring length stored (>= 2).
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError("CountTrie depth must be >= 2")
        self.depth = depth
        self._edge: dict[int, int] = {}
        self._count = array("q", [0])
        self._first = array("q", [-1])
        self._next = array("q", [-1])
        self._token = array("q", [-1])
        self.active: list[int] = []  # nodes of the live suffixes, lengths 1 .. depth-1, short first

    @property
    def num_nodes(self) -> int:
        return len(self._count)

    def memory_bytes(self) -> int:
        """Approximate bytes: dict table + int objects for keys/values + array columns."""
        return (sys.getsizeof(self._edge) + 64 * len(self._edge)
                + sum(a.buffer_info()[1] * a.itemsize for a in
                      (self._count, self._first, self._next, self._token)))

    def reset_stream(self) -> None:
        """Start a new independent stream (no substring spans the boundary)."""
        self.active = []

    def append(self, token: int) -> None:
        """Append one token (0 <= token < 2**32) to the current stream."""
        self.extend((token,))

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; <= ``depth`` dict operations per token (hot path, kept flat)."""
        edge, count, first, nxt, tok_col = self._edge, self._count, self._first, self._next, self._token
        lim = self.depth - 1
        active = self.active
        for t in tokens:
            t = int(t)
            new = []
            for node in (0, *active):
                key = (node << _SHIFT) | t
                c = edge.get(key)
                if c is None:
                    c = len(count)
                    edge[key] = c
                    count.append(1)
                    nxt.append(first[node])
                    first.append(-1)
                    tok_col.append(t)
                    first[node] = c
                else:
                    count[c] += 1
                new.append(c)
            active = new[:lim] if len(new) > lim else new
        self.active = active

    def lookup(self, tokens: Sequence[int]) -> int:
        """Node of the substring ``tokens`` or -1."""
        node = 0
        edge = self._edge
        for t in tokens:
            node = edge.get((node << _SHIFT) | int(t), -1)
            if node < 0:
                return -1
        return node

    def has_children(self, node: int) -> bool:
        return self._first[node] >= 0

    def longest_match(self, tail: Sequence[int], max_len: int) -> tuple[int, int]:
        """Longest suffix of ``tail`` (<= max_len tokens) that occurred with a continuation.

        Binary search: if a suffix of length L has a continuation, so do the shorter ones.
        Returns ``(node, length)``; ``(-1, 0)`` when even the last token has none.
        """
        hi = min(max_len, len(tail), self.depth - 1)
        lo, best = 1, (-1, 0)
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.lookup(tail[len(tail) - mid:])
            if node >= 0 and self._first[node] >= 0:
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best

    def active_match(self, max_len: int) -> tuple[int, int]:
        """Like `longest_match` for the current stream's own tail, using ``active`` (no walk)."""
        for length in range(min(max_len, len(self.active)), 0, -1):
            node = self.active[length - 1]
            if self._first[node] >= 0:
                return node, length
        return -1, 0

    def expand(self, node: int, budget: int, min_prob: float, max_depth: Optional[int] = None
               ) -> tuple[list[int], list[int], list[float]]:
        """Best-first continuation subtree below ``node``.

        Returns:
            ``(tokens, parents, scores)``: parents index into the returned lists, -1 =
            child of ``node``; scores are path products of count ratios, non-increasing
            along paths; best-first order (topological).
        """
        toks: list[int] = []
        pars: list[int] = []
        scores: list[float] = []
        if node < 0 or budget <= 0:
            return toks, pars, scores
        count, first, nxt, token = self._count, self._first, self._next, self._token
        heap: list[tuple[float, int, int, int]] = []  # (-score, child_node, parent_out, depth)

        def push(parent_node: int, parent_out: int, base: float, depth: int) -> None:
            denom = count[parent_node]
            c = first[parent_node]
            while c >= 0:
                s = base * count[c] / denom
                if s >= min_prob:
                    heapq.heappush(heap, (-s, c, parent_out, depth))
                c = nxt[c]

        push(node, -1, 1.0, 1)
        while heap and len(toks) < budget:
            neg, c, p, d = heapq.heappop(heap)
            out = len(toks)
            toks.append(token[c])
            pars.append(p)
            scores.append(-neg)
            if max_depth is None or d < max_depth:
                push(c, out, -neg, d + 1)
        return toks, pars, scores
