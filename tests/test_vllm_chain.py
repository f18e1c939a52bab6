"""`graft_spec.chain.ChainPricer`: the vLLM adapter's chain choice, on hand-made CPU trees.

Expected values are recomputed by plain Python walks over the parents array from the pricer's
factors, never copied from the implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from graft_spec.chain import ChainPricer
from graft_spec.sources import SOURCE_DRAFT, SOURCE_PADDING, SOURCE_SUFFIX
from graft_spec.tree import DraftTree

K = 3


def _levels(spine: list[int], q: list[float], sib: list[int], qs: list[float]):
    """Draft levels ``[1, K, 2]``: the spine token (rank 0) and one sibling per depth."""
    lp = torch.log(torch.tensor([[[a, b] for a, b in zip(q, qs)]]))
    ids = torch.tensor([[[a, b] for a, b in zip(spine, sib)]])
    return lp, ids


def _tree(tokens, parents, est, source) -> DraftTree:
    return DraftTree(torch.tensor([tokens]), torch.tensor([parents]),
                     torch.log(torch.tensor([est], dtype=torch.float32)), torch.tensor([source]))


# spine 10 -> 11 -> 12 (q 0.6 each); a retrieved chain 50 -> 51 -> 52 under the root priced 0.9 / 0.85 /
# 0.8 by the tree, the draft's top-1 left 0.1 by a sibling cap (what the tree did in vLLM)
SPINE, Q = [10, 11, 12], [0.6, 0.6, 0.6]
LEVELS = _levels(SPINE, Q, [20, 21, 22], [0.2, 0.2, 0.2])
TREE = _tree([0, 10, 11, 12, 50, 51, 52, 20],
             [-1, 0, 1, 2, 0, 4, 5, 0],
             [1.0, 0.1, 0.06, 0.036, 0.9, 0.85, 0.8, 0.05],
             [SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_SUFFIX, SOURCE_SUFFIX, SOURCE_SUFFIX,
              SOURCE_DRAFT])
GREEDY = torch.tensor([False])


def _chain(pricer, tree=TREE, levels=LEVELS, sampled=GREEDY):
    c = pricer.choose(tree, *levels, sampled, K)
    assert c.source[0, int(c.length[0]):].eq(-1).all()
    return c.tokens[0, : int(c.length[0])].tolist(), float(c.expected[0])


def test_fresh_pricer_prices_the_draft_by_its_own_probability_not_the_capped_estimate():
    # spine: 0.6 + 0.36 + 0.216 = 1.176; retrieved: 0.9 + 0.85 + 0.8 (ratios of the tree's estimates)
    pricer = ChainPricer(max_depth=K)
    chain, value = _chain(pricer)
    assert chain == [50, 51, 52] and value == pytest.approx(0.9 + 0.85 + 0.8, rel=1e-5)
    assert pricer.choose(TREE, *LEVELS, GREEDY, K).source[0].tolist() == [SOURCE_SUFFIX] * 3


def test_learns_that_a_retrieved_fork_token_is_rarely_accepted_and_keeps_the_spine():
    pricer = ChainPricer(max_depth=K)
    for _ in range(12):            # the target follows the draft's top-1 path every time
        pricer.choose(TREE, *LEVELS, GREEDY, K)
        pricer.observe(torch.tensor([[10, 11, 12, 13]]), torch.tensor([4]))
    s = pricer.summary()
    assert s["greedy/fork/suffix"]["observed"] == 0.0 and s["greedy/fork/suffix"]["trials"] == 12
    assert s["greedy/fork/spine"]["observed"] == 1.0 and s["greedy/fork/spine"]["trials"] == 36
    assert s["greedy/fork/draft"]["trials"] == 12   # node 20 only: no deeper sibling is in the tree
    chain, _ = _chain(pricer)
    assert chain == SPINE
    # sampled rows have their own cells: still the prior there
    assert _chain(pricer, sampled=torch.tensor([True]))[0] == [50, 51, 52]


def test_unchosen_siblings_and_nodes_below_a_miss():
    pricer = ChainPricer(max_depth=K)
    pricer.choose(TREE, *LEVELS, GREEDY, K)
    # the target took 20 (the draft's sibling), then 7: only the root's children were trials
    pricer.observe(torch.tensor([[20, 7]]), torch.tensor([2]))
    s = pricer.summary()
    assert s["greedy/fork/draft"] == {"trials": 1.0, "priced": pytest.approx(0.2), "observed": 1.0}
    assert s["greedy/fork/suffix"]["trials"] == 1 and s["greedy/fork/suffix"]["observed"] == 0.0
    assert s["greedy/fork/spine"]["trials"] == 1 and "greedy/continuation/suffix" not in s
    # an unverified row (lens 0) counts nothing
    pricer.choose(TREE, *LEVELS, GREEDY, K)
    pricer.observe(torch.tensor([[0, 0]]), torch.tensor([0]))
    assert pricer.summary()["greedy/fork/draft"]["trials"] == 1.0


def test_full_spine_is_a_candidate_where_the_tree_dropped_its_tail():
    # the tree keeps only the spine's first token, and a weak retrieved chain
    tree = _tree([0, 10, 50, 51], [-1, 0, 0, 2], [1.0, 0.6, 0.3, 0.3],
                 [SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_SUFFIX, SOURCE_SUFFIX])
    pricer = ChainPricer(max_depth=K)
    chain, value = _chain(pricer, tree=tree)
    assert chain == SPINE and value == pytest.approx(0.6 + 0.36 + 0.216, rel=1e-5)
    assert pricer.choose(tree, *LEVELS, GREEDY, K).source[0].tolist() == [SOURCE_DRAFT] * 3


def _brute(pricer: ChainPricer, tree: DraftTree, lp: torch.Tensor, ids: torch.Tensor, sampled: bool) -> float:
    """Best chain value by walking every root path (and the whole spine) with the pricer's factors."""
    f = pricer.factors()
    m = int(sampled)
    tok, par = tree.tokens[0].tolist(), tree.parents[0].tolist()
    est, src = tree.logp[0].exp().tolist(), tree.source[0].tolist()
    spine = ids[0, :, 0].tolist()
    cumq = [1.0]
    for d in range(K):
        cumq.append(cumq[-1] * math.exp(lp[0, d, 0]))

    def path(v):
        out = []
        while v > 0:
            out.append(v)
            v = par[v]
        return out[::-1]

    def on_spine(v):
        p = path(v)
        return len(p) <= K and all(tok[u] == spine[i] for i, u in enumerate(p))

    best = 0.0
    for v in range(1, len(tok)):
        p = path(v)
        if len(p) > K or any(src[u] == SOURCE_PADDING for u in p):
            continue
        run, tot = 1.0, 0.0
        for i, u in enumerate(p):
            d, parent = i + 1, par[u]
            fork = on_spine(parent) if parent > 0 else True
            drafted = tok[u] in ids[0, d - 1].tolist()
            if on_spine(u):
                c, cls = math.exp(lp[0, d - 1, 0]), ChainPricer.SPINE
            elif fork and drafted:
                c, cls = math.exp(lp[0, d - 1, ids[0, d - 1].tolist().index(tok[u])]), src[u]
            else:
                pe = est[parent] if parent > 0 else 1.0
                if parent > 0 and on_spine(parent):
                    pe = max(pe, cumq[d - 1])
                c, cls = min(1.0, est[u] / pe) if pe > 0 else (est[u] and 1.0), src[u]
            c = min(1.0, c * float(f[m, int(fork or on_spine(u)), cls, min(d, pricer.max_depth) - 1]))
            run *= c
            tot += run
        best = max(best, tot)
    run, tot = 1.0, 0.0
    for d in range(K):
        run *= min(1.0, math.exp(lp[0, d, 0]) * float(f[m, 1, ChainPricer.SPINE, d]))
        tot += run
    return max(best, tot)


@pytest.mark.parametrize("seed", range(6))
def test_choice_is_the_best_of_every_tree_path_and_the_spine(seed):
    g = torch.Generator().manual_seed(seed)
    pricer = ChainPricer(max_depth=K)
    # random factors through random counts
    pricer.expected.copy_(torch.rand(pricer.expected.shape, generator=g) * 20)
    pricer.hits.copy_(pricer.expected * torch.rand(pricer.expected.shape, generator=g) * 1.5)
    n = 14
    parents, tokens, est, src = [-1], [0], [1.0], [SOURCE_DRAFT]
    spine = [100, 101, 102]
    sib = [200, 201, 202]
    for v in range(1, n):
        p = int(torch.randint(0, v, (1,), generator=g))
        depth = 1
        u = p
        while u > 0:
            depth += 1
            u = parents[u]
        used = {tokens[w] for w in range(1, v) if parents[w] == p}
        choices = [t for t in (spine[min(depth, K) - 1], sib[min(depth, K) - 1], 300 + v) if t not in used]
        tokens.append(choices[int(torch.randint(0, len(choices), (1,), generator=g))])
        parents.append(p)
        est.append(est[p] * float(torch.rand(1, generator=g)))
        src.append(int(torch.randint(0, 7, (1,), generator=g)))
    tree = _tree(tokens, parents, est, src)
    lp = torch.log(torch.rand(1, K, 2, generator=g).sort(dim=2, descending=True).values)
    ids = torch.tensor([[[a, b] for a, b in zip(spine, sib)]])
    for sampled in (False, True):
        tok, length, value, _ = pricer.choose(tree, lp, ids, torch.tensor([sampled]), K)
        assert float(value[0]) == pytest.approx(_brute(pricer, tree, lp, ids, sampled), rel=1e-4, abs=1e-6)
        assert 0 < int(length[0]) <= K
