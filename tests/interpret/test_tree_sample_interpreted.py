"""The tree sampling kernel (graft_spec/kernels/tree_sample.py) against its torch reference, bit for
bit in every output, run by Triton's interpreter.

Collected in the main test run, these tests skip unless ``TRITON_INTERPRET=1`` was set before
Triton was imported; tests/test_kernels.py runs this file in a subprocess with it set.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported (tests/test_kernels.py)")

MAX_COIN = 1.0 - 2.0 ** -24


def _links(rng: random.Random, n: int, shuffle: bool, unlinked: float):
    """One tree as SGLang links: random parents (parent < child), sibling chains in index order or
    shuffled, some nodes left out of every chain (padding)."""
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    linked = [True] + [rng.random() >= unlinked for _ in range(1, n)]
    for i in range(1, n):  # a node below an unlinked one is unreachable as well
        linked[i] = linked[i] and linked[parents[i]]
    nt, ns = [-1] * n, [-1] * n
    for p in range(n):
        kids = [c for c in range(1, n) if parents[c] == p and linked[c]]
        if shuffle:
            rng.shuffle(kids)
        if kids:
            nt[p] = kids[0]
            for a, c in zip(kids, kids[1:]):
                ns[a] = c
    return parents, nt, ns


def _case(seed: int, b: int, n: int, v: int, d: int, shuffle: bool):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    nts, nss, toks, pars = [], [], [], []
    for _ in range(b):
        parents, nt, ns = _links(rng, n, shuffle, unlinked=rng.choice([0.0, 0.2]))
        # distinct sibling tokens, sometimes out of the vocabulary (read at the nearest id)
        tok = [rng.randrange(v)]
        for i in range(1, n):
            used = {tok[c] for c in range(1, i) if parents[c] == parents[i]}
            free = [t for t in range(v) if t not in used] or [v + 3]
            tok.append(rng.choice(free))
        toks.append(tok)
        nts.append(nt)
        nss.append(ns)
        pars.append(parents)
    cand = torch.tensor(toks, dtype=torch.int64)
    # rows: softmax with a temperature, mass pushed onto the node's children (rejections and
    # acceptance both happen), some one-hot rows and some rows holding only children's mass
    logits = torch.randn(b, n, v, generator=g) * rng.choice([0.5, 2.0, 6.0])
    for bi in range(b):
        for i in range(n):
            kids = [c for c in range(1, n) if pars[bi][c] == i and 0 <= toks[bi][c] < v]
            if kids and rng.random() < 0.6:
                logits[bi, i, [toks[bi][c] for c in kids]] += rng.choice([1.0, 4.0])
            if kids and rng.random() < 0.1:   # all mass on the children
                keep = torch.full((v,), float("-inf"))
                keep[[toks[bi][c] for c in kids]] = 0.0
                logits[bi, i] += keep
    probs = torch.softmax(logits, dim=-1)
    onehot = torch.rand(b, n, generator=g) < 0.15
    probs[onehot] = torch.nn.functional.one_hot(probs[onehot].argmax(-1), v).float()
    coins = torch.rand(b, n, generator=g)
    coins[torch.rand(b, n, generator=g) < 0.1] = 0.0
    coins[torch.rand(b, n, generator=g) < 0.1] = MAX_COIN
    final = torch.rand(b, generator=g)
    final[torch.rand(b, generator=g) < 0.2] = MAX_COIN
    glob = torch.arange(b * n).view(b, n)
    return (cand, glob, torch.tensor(nts), torch.tensor(nss), coins, final, probs, d)


def _run(fn, case, dtype=torch.int64):
    cand, glob, nt, ns, coins, final, probs, d = case
    b, n = cand.shape
    predicts = torch.full((b * n,), -7, dtype=torch.int32)
    accept = torch.full((b, d), -5, dtype=torch.int32)
    num = torch.full((b,), -3, dtype=torch.int32)
    fn(predicts, accept, num, cand.to(dtype), glob.to(dtype), nt.to(dtype), ns.to(dtype), coins, final, probs)
    return predicts, accept, num


@st.composite
def cases(draw):
    n = draw(st.sampled_from([1, 2, 5, 24, 60]))
    return (draw(st.integers(0, 2 ** 31 - 1)), draw(st.sampled_from([1, 3, 16, 64])), n,
            draw(st.sampled_from([3, 17, 1500])), draw(st.sampled_from([1, 2, 4, n, n + 1])), draw(st.booleans()),
            draw(st.sampled_from([torch.int64, torch.int32])))


@settings(max_examples=16, deadline=None)
@given(spec=cases())
def test_tree_sample_kernel_equals_reference(spec):
    from graft_spec.kernels.tree_sample import tree_sample_reference, tree_sample_triton

    seed, b, n, v, d, shuffle, dtype = spec
    case = _case(seed, b, n, v, d, shuffle)
    want = _run(tree_sample_reference, case, dtype)
    got = _run(tree_sample_triton, case, dtype)
    for name, w, g in zip(("predicts", "accept_index", "accept_token_num"), want, got):
        assert torch.equal(w, g), (name, w, g)


def test_tree_sample_kernel_follows_the_reference_on_a_hand_tree():
    """root -> {a, b}; a -> {c}; every outcome of the coins (accept a, accept b, reject both; accept
    c or not) in one batch, checked against the reference and against the rule by hand."""
    from graft_spec.kernels.tree_sample import tree_sample_reference, tree_sample_triton

    v = 6
    cand = torch.tensor([[0, 1, 2, 3]]).expand(5, 4).contiguous()
    nt = torch.tensor([[1, 3, -1, -1]]).expand(5, 4).contiguous()
    ns = torch.tensor([[-1, 2, -1, -1]]).expand(5, 4).contiguous()
    rows = torch.tensor([[0.1, 0.3, 0.2, 0.2, 0.2, 0.0],      # after the root: a=1 0.3, b=2 0.2
                         [0.0, 0.0, 0.0, 0.5, 0.5, 0.0],      # after a: c=3 0.5
                         [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    probs = rows.expand(5, 4, v).contiguous()
    coins = torch.tensor([[0.1, 0.2, 0.0, 0.0],    # accept a (0.1 < 0.3), then c (0.2 < 0.5)
                          [0.1, 0.7, 0.0, 0.0],    # accept a, reject c: bonus from row a without c -> 4
                          [0.4, 0.0, 0.0, 0.0],    # reject a, accept b (0.4 < 0.5); b is a leaf -> 4
                          [0.9, 0.0, 0.0, 0.0],    # reject both: bonus from root row without 1, 2
                          [0.1, 0.2, 0.0, 0.0]])
    final = torch.tensor([0.5, 0.5, 0.5, 0.0, 0.99])
    case = (cand, torch.arange(20).view(5, 4), nt, ns, coins, final, probs, 3)
    want = _run(tree_sample_reference, case)
    got = _run(tree_sample_triton, case)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    predicts, accept, num = want
    assert num.tolist() == [2, 1, 1, 0, 2]
    assert accept.tolist() == [[0, 1, 3], [4, 5, -1], [8, 10, -1], [12, -1, -1], [16, 17, 19]]
    # request 3: residual of the root row without 1 and 2 is {0: 0.1, 3: 0.2, 4: 0.2}; coin 0 -> token 0
    assert [int(predicts[i]) for i in (0, 1, 3, 4, 5, 8, 10, 12)] == [1, 3, 5, 1, 4, 2, 4, 0]
