"""Depth-limited counting trie over token streams (shared by suffix.py and corpus.py).

Semantics: every substring of length <= ``depth`` of the appended streams is a path
from the root, and its count is the number of positions where it ends. Continuations
are expanded best-first by the product of ``count(child) / count(node)`` (the empirical
next-token frequency, as ArcticInference's suffix trees do), pruned below ``min_prob``
and capped at ``budget`` nodes.

Storage is *lazy* for substrings seen once: a node is created explicitly only when its
parent substring has occurred at least twice; a node seen once (count 1) has no
children and its continuation is read from the token history at its single occurrence
(``end``). When a count-1 node is seen a second time, the continuation of its first
occurrence is materialised as an explicit child. This keeps the count semantics exact
(tests compare with brute-force substring counts) while appending a novel token costs
O(1) dict operations instead of O(depth); repeated text costs O(match length).

Locations are ``(node, pos, length)``: ``pos = -1`` for an explicit node, otherwise the
history index of the last matched token of a substring that continues lazily below the
count-1 explicit ``node``.

Columns are ``array('q')`` (count, first child, next sibling, token, end, depth) plus one
dict ``(node << 32 | token) -> child``; streams are separated by -1 in the history.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from typing import Optional, Sequence

__all__ = ["CountTrie", "Loc"]

_SHIFT = 32
Loc = tuple[int, int, int]  # (explicit node, lazy history position or -1, substring length)


class CountTrie:
    """Counting trie of all substrings up to ``depth`` tokens (see module docstring).

    Args:
        depth: maximum substring length represented (>= 2).
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
        self._end = array("q", [-1])
        self._dep = array("q", [0])
        self.hist: list[int] = []    # all appended tokens, -1 between streams
        self.active: list[int] = []  # explicit nodes of the live suffixes, short first

    # ------------------------------------------------------------------ size
    @property
    def num_nodes(self) -> int:
        return len(self._count)

    def memory_bytes(self) -> int:
        """Approximate bytes: dict table + int objects + array columns + history."""
        cols = (self._count, self._first, self._next, self._token, self._end, self._dep)
        return (sys.getsizeof(self._edge) + 64 * len(self._edge)
                + sum(a.buffer_info()[1] * a.itemsize for a in cols)
                + sys.getsizeof(self.hist) + 28 * len(self.hist))

    # ------------------------------------------------------------------ building
    def _new(self, parent: int, token: int, end: int) -> int:
        c = len(self._count)
        self._edge[(parent << _SHIFT) | token] = c
        self._count.append(1)
        self._next.append(self._first[parent])
        self._first.append(-1)
        self._token.append(token)
        self._end.append(end)
        self._dep.append(self._dep[parent] + 1)
        self._first[parent] = c
        return c

    def reset_stream(self) -> None:
        """Start a new independent stream (no substring spans the boundary)."""
        if self.hist and self.hist[-1] != -1:
            self.hist.append(-1)
        self.active = []

    def append(self, token: int) -> None:
        """Append one token (0 <= token < 2**32) to the current stream."""
        self.extend((token,))

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current stream (hot path, kept flat)."""
        edge, count, end, dep, hist = self._edge, self._count, self._end, self._dep, self.hist
        depth = self.depth
        active = self.active
        for t in tokens:
            t = int(t)
            i = len(hist)
            hist.append(t)
            new = []
            for x in (0, *active):
                if (x and count[x] < 2) or dep[x] >= depth:
                    break  # x seen once (children lazy) or full depth; longer suffixes too
                c = edge.get((x << _SHIFT) | t)
                if c is None:
                    c = self._new(x, t, i)
                else:
                    n = count[c] + 1
                    count[c] = n
                    if n == 2 and dep[c] < depth:
                        e = end[c] + 1  # continuation of the first occurrence
                        if e < i and hist[e] >= 0:
                            self._new(c, hist[e], e)
                    end[c] = i
                new.append(c)
            active = new
        self.active = active

    # ------------------------------------------------------------------ queries
    def _cont_pos(self, loc: Loc) -> int:
        """History position of the lazy continuation token, or -1."""
        node, pos, length = loc
        if length >= self.depth:
            return -1
        p = (self._end[node] if pos < 0 else pos) + 1
        return p if p < len(self.hist) and self.hist[p] >= 0 else -1

    def _explicit(self, loc: Loc) -> bool:
        node, pos, _ = loc
        return pos < 0 and (node == 0 or self._count[node] >= 2)

    def locate(self, tokens: Sequence[int]) -> Optional[Loc]:
        """Location of the substring ``tokens`` (None if it never occurred)."""
        edge, hist = self._edge, self.hist
        node, pos, length = 0, -1, 0
        for t in tokens:
            t = int(t)
            if length >= self.depth:
                return None
            if self._explicit((node, pos, length)):
                c = edge.get((node << _SHIFT) | t)
                if c is None:
                    return None
                node, length = c, length + 1
                continue
            p = self._cont_pos((node, pos, length))
            if p < 0 or hist[p] != t:
                return None
            pos, length = p, length + 1
        return node, pos, length

    def count(self, loc: Loc) -> int:
        """Occurrences of the substring at ``loc`` (1 below a count-1 node)."""
        node, pos, _ = loc
        return self._count[node] if pos < 0 else 1

    def has_continuation(self, loc: Loc) -> bool:
        """True if some occurrence of the substring is followed by a token."""
        if loc[2] >= self.depth:
            return False
        if self._explicit(loc):
            return self._first[loc[0]] >= 0
        return self._cont_pos(loc) >= 0

    def longest_match(self, tail: Sequence[int], max_len: int) -> tuple[Optional[Loc], int]:
        """Longest suffix of ``tail`` (<= max_len tokens) that occurred with a continuation.

        Binary search: if a suffix of length L has a continuation, so do the shorter ones.
        Returns ``(loc, length)``; ``(None, 0)`` when even the last token has none.
        """
        hi = min(max_len, len(tail), self.depth - 1)
        lo, best = 1, (None, 0)
        while lo <= hi:
            mid = (lo + hi) // 2
            loc = self.locate(tail[len(tail) - mid:])
            if loc is not None and self.has_continuation(loc):
                best, lo = (loc, mid), mid + 1
            else:
                hi = mid - 1
        return best

    def active_match(self, max_len: int) -> tuple[Optional[Loc], int]:
        """Like `longest_match` for the current stream's own tail, from ``active`` (no walk).

        A live suffix seen before (count >= 2) has the continuation of an earlier
        occurrence as an explicit child.
        """
        for length in range(min(max_len, len(self.active)), 0, -1):
            node = self.active[length - 1]
            if self._count[node] >= 2 and self._first[node] >= 0:
                return (node, -1, length), length
        return None, 0

    def expand(self, loc: Optional[Loc], budget: int, min_prob: float
               ) -> tuple[list[int], list[int], list[float]]:
        """Best-first continuation subtree below ``loc``.

        Returns:
            ``(tokens, parents, scores)``: parents index into the returned lists, -1 =
            child of ``loc``; scores are path products of count ratios (lazy count-1
            chains continue with ratio 1; an occurrence that ends the current stream is not
            counted, it has no continuation yet), non-increasing along paths; best-first order
            (topological).
        """
        toks: list[int] = []
        pars: list[int] = []
        scores: list[float] = []
        if loc is None or budget <= 0:
            return toks, pars, scores
        count, first, nxt, token, dep, hist = \
            self._count, self._first, self._next, self._token, self._dep, self.hist
        heap: list[tuple[float, int, int, int, int, int]] = []  # (-score, tie, node, pos, len, parent_out)
        tie = 0
        # a substring that ends the current stream has one occurrence that cannot continue yet:
        # it does not count in the continuation frequencies
        live = set(self.active)

        def push(at: Loc, parent_out: int, base: float) -> None:
            nonlocal tie
            node, pos, length = at
            if length >= self.depth:
                return
            if self._explicit(at):
                denom = count[node] - (node in live)
                c = first[node]
                while c >= 0:
                    s = base * count[c] / denom if denom else base
                    if s >= min_prob:
                        heapq.heappush(heap, (-s, tie, c, -1, dep[c], parent_out))
                        tie += 1
                    c = nxt[c]
            else:
                p = self._cont_pos(at)
                if p >= 0 and base >= min_prob:
                    heapq.heappush(heap, (-base, tie, node, p, length + 1, parent_out))
                    tie += 1

        push(loc, -1, 1.0)
        while heap and len(toks) < budget:
            neg, _, node, pos, length, p = heapq.heappop(heap)
            out = len(toks)
            toks.append(token[node] if pos < 0 else hist[pos])
            pars.append(p)
            scores.append(-neg)
            push((node, pos, length), out, -neg)
        return toks, pars, scores
