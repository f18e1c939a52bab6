"""Tree -> chain logic of the vLLM adapter (graft_spec/chain.py), on CPU tensors.

No vLLM needed: these are the pure functions the proposer applies after vLLM's EAGLE loop.
Expected values are recomputed independently (plain Python walks over the parents array,
or the fake target's own probabilities), never copied from the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from graft_spec.config import GraftConfig
from graft_spec.step import tree_draft_candidates
from graft_spec.pipeline import GraftPlanner
from graft_spec.sources import GRAFTED_SOURCES, grafted
from graft_spec.chain import best_chain, spine_tree


def _path(parents: list[int], v: int) -> list[int]:
    out = []
    while v > 0:
        out.append(v)
        v = parents[v]
    return out[::-1]


def _brute_expected(tree, b: int, max_len: int) -> list[float]:
    """E[accepted] of the chain ending at each node: sum of exp(running-min logp) along the path."""
    par = tree.parents[b].tolist()
    lp = tree.logp[b].tolist()
    out = []
    for v in range(len(par)):
        path = _path(par, v)
        if len(path) > max_len:
            out.append(-1.0)
            continue
        run, tot = 0.0, 0.0
        for u in path:
            run = min(run, lp[u])
            tot += math.exp(run) if run > -math.inf else 0.0
        out.append(tot)
    return out


def _fake_target(vocab: int, seed: int, sharp: float = 2.5) -> torch.Tensor:
    """Bigram fake target: log p(next | last) = log_softmax(W[last])."""
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(vocab, vocab, generator=g) * sharp, dim=-1)


def _draft_levels(logp_table: torch.Tensor, roots: torch.Tensor, depth: int, k: int):
    """What the EAGLE loop produces: top-k at each depth along the top-1 spine."""
    lvl_lp, lvl_id = [], []
    cur = roots
    for _ in range(depth):
        top = logp_table[cur].topk(k, dim=-1)
        lvl_lp.append(top.values)
        lvl_id.append(top.indices)
        cur = top.indices[:, 0]
    return torch.stack(lvl_lp, 1), torch.stack(lvl_id, 1)


def test_spine_tree_layout():
    lp = torch.log(torch.tensor([[[0.6, 0.3], [0.5, 0.2], [0.9, 0.05]]]))
    ids = torch.tensor([[[5, 6], [7, 8], [9, 10]]])
    t = spine_tree(torch.tensor([4]), lp, ids)
    t.validate()
    assert t.tokens.tolist() == [[4, 5, 6, 7, 8, 9, 10]]
    # depth-1 nodes hang under the root, depth-d nodes under the depth-(d-1) top-1 node
    assert t.parents.tolist() == [[-1, 0, 0, 1, 1, 3, 3]]
    want = [0.0, math.log(0.6), math.log(0.3), math.log(0.6 * 0.5), math.log(0.6 * 0.2),
            math.log(0.6 * 0.5 * 0.9), math.log(0.6 * 0.5 * 0.05)]
    assert t.logp[0].tolist() == pytest.approx(want, abs=1e-5)


def test_spine_tree_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must both be"):
        spine_tree(torch.tensor([1]), torch.zeros(1, 2, 3), torch.zeros(1, 2, 2, dtype=torch.int64))


def build_hybrid(planner: GraftPlanner, spine, req_ids):
    """The planner's hybrid tree for a spine draft, the host sources anchored at the root."""
    b = len(req_ids)
    host = planner.host_candidates(req_ids)
    planner.ensure_slots(b)   # empty: no lookup; the host sources are anchored at the root
    seq = torch.tensor([planner.seen(r) - 1 for r in req_ids])
    return planner.build(tree_draft_candidates(spine), spine.tokens[:, 0], host, torch.arange(b), seq,
                         torch.zeros(b, dtype=torch.bool)).tree


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_chain_maximises_true_expected_length_under_fake_target(seed):
    """Perfect drafter (draft == fake target), no retrieval: every draft node's logp is the
    true log P(path accepted) under one-hot-q rejection sampling, so the chain picked must
    maximise the *target's* expected accepted length over all root-to-node paths."""
    vocab, depth, k, b = 48, 4, 3, 5
    target = _fake_target(vocab, seed)
    roots = torch.randint(0, vocab, (b,), generator=torch.Generator().manual_seed(seed + 10))
    lp, ids = _draft_levels(target, roots, depth, k)
    hybrid = spine_tree(roots, lp, ids)   # logp = the drafter's = the target's path probability
    for max_len in (depth, 2):
        tokens, length, expected = best_chain(hybrid, max_len)
        for i in range(b):
            par, tok = hybrid.parents[i].tolist(), hybrid.tokens[i].tolist()
            true_e = []
            for v in range(len(par)):
                path = _path(par, v)
                if len(path) > max_len:
                    continue
                prev, prob, e = tok[0], 1.0, 0.0
                for u in path:
                    prob *= math.exp(target[prev, tok[u]].item())
                    e += prob
                    prev = tok[u]
                true_e.append(e)
            chain = tokens[i, : length[i]].tolist()
            prev, prob, e_chain = int(roots[i]), 1.0, 0.0
            for t in chain:
                prob *= math.exp(target[prev, t].item())
                e_chain += prob
                prev = t
            assert e_chain == pytest.approx(max(true_e), rel=1e-4)
            assert float(expected[i]) == pytest.approx(e_chain, rel=1e-4)
            assert (tokens[i, length[i]:] == -1).all()


def test_best_chain_matches_brute_force_on_hybrid_trees_with_retrieved_nodes():
    """Hybrid trees from the real planner (suffix retrieval over a repetitive history, a
    weak drafter): the chain is the argmax of the brute-force expected length, ties to
    the lowest node index, and it may end on a retrieved node."""
    vocab, depth, k = 40, 3, 2
    cfg = GraftConfig(num_draft_tokens=10, topk=k, depth=depth,
                      checkpoints=[{"depth": 1, "threshold": 0.5, "keep": 2}])
    planner = GraftPlanner(cfg, vocab)
    rng = np.random.default_rng(0)
    cycle = [3, 17, 8, 25, 11, 30]
    ids = [f"q{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        planner.start_request(rid, (cycle * 4)[i:] + cycle[:2])
    roots = torch.tensor([cycle[1]] * 4)
    weak = torch.log_softmax(torch.tensor(rng.normal(size=(vocab, vocab)), dtype=torch.float32), -1)
    lp, tok = _draft_levels(weak, roots, depth, k)
    hybrid = build_hybrid(planner, spine_tree(roots, lp, tok), ids)
    assert grafted(hybrid.source).any(), "test needs retrieved nodes in the tree"
    picked_retrieved = False
    for max_len in (depth, 5):
        tokens, length, expected = best_chain(hybrid, max_len)
        for i in range(len(ids)):
            brute = _brute_expected(hybrid, i, max_len)
            best = int(np.argmax(brute))  # first maximum = lowest index
            want = [hybrid.tokens[i, u].item() for u in _path(hybrid.parents[i].tolist(), best)]
            assert tokens[i, : length[i]].tolist() == want
            assert float(expected[i]) == pytest.approx(brute[best], rel=1e-5)
            end = _path(hybrid.parents[i].tolist(), best)
            picked_retrieved |= bool(end) and hybrid.source[i, end[-1]].item() in GRAFTED_SOURCES
    assert picked_retrieved, "the suffix continuation should beat a random drafter somewhere"


def test_best_chain_empty_when_nothing_can_be_verified():
    lp, ids = torch.full((2, 2, 2), -math.inf), torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])
    t = spine_tree(torch.tensor([0, 0]), lp, ids)
    tokens, length, expected = best_chain(t, 2)
    assert length.tolist() == [0, 0] and expected.tolist() == [0.0, 0.0]
    assert (tokens == -1).all()
    tokens, length, _ = best_chain(t, 0)
    assert tokens.shape == (2, 0) and length.tolist() == [0, 0]
