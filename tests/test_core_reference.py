"""Slow, obviously-correct per-node reference implementations used by the core tests.

Other test_core_* files import these; the tests at the bottom pin the references to
hand-worked examples so they cannot silently drift.
"""

from __future__ import annotations

import random

import torch


def ref_depths(parents: list[int]) -> list[int]:
    d = []
    for i, p in enumerate(parents):
        d.append(0 if p < 0 else d[p] + 1)
    return d


def ref_ancestors(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]  # root first


def ref_mask(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    m = [[False] * n for _ in range(n)]
    for i in range(n):
        for j in ref_ancestors(parents, i):
            m[i][j] = True
    return m


def ref_links(parents: list[int]) -> tuple[list[int], list[int]]:
    n = len(parents)
    kids = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parents[i]].append(i)
    first = [k[0] if k else -1 for k in kids]
    nxt = [-1] * n
    for k in kids:
        for a, b in zip(k, k[1:]):
            nxt[a] = b
    return first, nxt


def ref_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Token paths from (and including) the root, one per node."""
    return {tuple(tokens[j] for j in ref_ancestors(parents, i)) for i in range(len(parents))}


def ref_greedy(tokens: list[int], parents: list[int], target_ids: list[int]) -> tuple[list[int], int]:
    """Accepted index path (root first) and bonus, walking children in index order."""
    first, nxt = ref_links(parents)
    path = [0]
    cur = 0
    while True:
        c = first[cur]
        while c >= 0 and tokens[c] != target_ids[cur]:
            c = nxt[c]
        if c < 0:
            return path, target_ids[cur]
        path.append(c)
        cur = c


def random_tree(rng: random.Random, n: int, vocab: int, distinct: bool = True,
                max_children: int = 4) -> tuple[list[int], list[int]]:
    """Random topological tree with (optionally) distinct sibling tokens."""
    parents = [-1]
    tokens = [rng.randrange(vocab)]
    used: dict[int, set] = {0: set()}
    for i in range(1, n):
        opts = [p for p in range(i) if len(used[p]) < min(max_children, vocab)]
        p = rng.choice(opts)
        if distinct:
            t = rng.choice([x for x in range(vocab) if x not in used[p]])
        else:
            t = rng.randrange(vocab)
        used[p].add(t)
        used[i] = set()
        parents.append(p)
        tokens.append(t)
    return tokens, parents


def test_reference_examples():
    parents = [-1, 0, 0, 1, 3, 2]
    tokens = [9, 1, 2, 3, 4, 5]
    assert ref_depths(parents) == [0, 1, 1, 2, 3, 2]
    assert ref_ancestors(parents, 4) == [0, 1, 3, 4]
    assert ref_links(parents) == ([1, 3, 5, 4, -1, -1], [-1, 2, -1, -1, -1, -1])
    assert ref_greedy(tokens, parents, [2, 0, 5, 0, 0, 7]) == ([0, 2, 5], 7)
    assert ref_greedy(tokens, parents, [1, 3, 0, 4, 8, 0]) == ([0, 1, 3, 4], 8)
    assert (9, 1, 3, 4) in ref_paths(tokens, parents)


def test_random_tree_is_topological_and_distinct():
    rng = random.Random(0)
    for _ in range(20):
        toks, pars = random_tree(rng, 30, 8)
        assert all(0 <= p < i for i, p in enumerate(pars) if i)
        sib = {}
        for i in range(1, 30):
            assert toks[i] not in sib.setdefault(pars[i], set())
            sib[pars[i]].add(toks[i])
    t = torch.tensor(toks)
    assert t.dtype == torch.int64
