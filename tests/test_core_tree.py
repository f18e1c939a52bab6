"""Tree structure: masks, depths, links, paths and the EAGLE rerank against references."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_spec.tree import (DraftTree, ancestor_mask, eagle_rerank, eagle_step, has_duplicate_siblings,
                             tree_from_selection, leaf_mask, node_depths, node_paths, parents_from_mask, path_min, sibling_links,
                             pointer_jumps, pointer_rounds, validate_parents)
from test_core_reference import ref_ancestors, ref_depths, ref_links, ref_mask, random_tree


def batch_of_trees(seed: int, b: int, n: int, vocab: int = 16):
    rng = random.Random(seed)
    rows = [random_tree(rng, n, vocab) for _ in range(b)]
    return (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), n=st.integers(1, 40))
def test_derived_structures_match_reference(seed, b, n):
    tokens, parents = batch_of_trees(seed, b, n)
    mask = ancestor_mask(parents)
    depths = node_depths(parents)
    first, nxt = sibling_links(parents)
    paths = node_paths(parents)
    for r in range(b):
        pr = parents[r].tolist()
        assert mask[r].tolist() == ref_mask(pr)
        assert depths[r].tolist() == ref_depths(pr)
        f, x = ref_links(pr)
        assert first[r].tolist() == f and nxt[r].tolist() == x
        for i in range(n):
            anc = ref_ancestors(pr, i)
            assert paths[r, i, : len(anc)].tolist() == anc
            assert (paths[r, i, len(anc):] == -1).all()
    # the structures agree with each other
    assert torch.equal(parents_from_mask(mask), parents)
    assert torch.equal(mask.sum(dim=2) - 1, depths)
    assert torch.equal(leaf_mask(parents), first == -1)
    seq = torch.arange(b) * 7 + 3
    tree = DraftTree(tokens, parents, torch.zeros(b, n), torch.zeros(b, n, dtype=torch.int64))
    assert torch.equal(tree.positions(seq), seq[:, None] + depths)
    tree.validate()
    assert not has_duplicate_siblings(tokens, parents).any()


def test_duplicate_siblings_detected_and_rejected():
    tokens = torch.tensor([[5, 1, 2, 1]])
    parents = torch.tensor([[-1, 0, 0, 0]])
    assert has_duplicate_siblings(tokens, parents).tolist() == [True]
    assert has_duplicate_siblings(tokens, torch.tensor([[-1, 0, 0, 1]])).tolist() == [False]
    tree = DraftTree(tokens, parents, torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="duplicate"):
        tree.validate()


@pytest.mark.parametrize("bad", [[[0, 0, 0]], [[-1, 1, 0]], [[-1, 0, 2]], [[-1, -1, 0]]])
def test_validate_parents_rejects_non_topological(bad):
    with pytest.raises(ValueError):
        validate_parents(torch.tensor(bad))


def test_path_min():
    parents = torch.tensor([[-1, 0, 1, 0, 3]])
    vals = torch.tensor([[0.0, -2.0, -1.0, -0.5, -3.0]])
    assert path_min(vals, parents).tolist() == [[0.0, -2.0, -2.0, -0.5, -3.0]]


def test_path_min_of_stacked_value_sets_equals_one_call_each():
    """Value sets stacked on leading dimensions share one pointer jumping and give each set's own
    path minimum (merge_select and reanchor price two sets over one tree this way)."""
    g = torch.Generator().manual_seed(3)
    b, n = 4, 40
    parents = torch.cat([torch.full((b, 1), -1), torch.stack([torch.randint(0, i, (b,), generator=g)
                                                              for i in range(1, n)], 1)], 1)
    vals = torch.randn(2, 3, b, n, generator=g)
    vals[0, 1, :, 5] = math.inf
    got = path_min(vals, parents)
    assert got.shape == vals.shape
    for i in range(2):
        for j in range(3):
            assert torch.equal(got[i, j], path_min(vals[i, j], parents))
    assert not torch.equal(got[0, 0], vals[0, 0])      # the minimum does move values down the paths


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 15, 16, 31, 33, 63])
def test_pointer_jumps_shared_by_depths_path_min_and_mask(n):
    """One `pointer_jumps` serves node_depths, path_min and ancestor_mask over a tree: each gives
    the reference result. Chains are the deepest trees; at N = 7, 15, 31, 63 (2**R = N + 1) the
    mask's R - 1 doubling rounds just cover the deepest path."""
    rng = random.Random(n)
    chain = torch.arange(-1, n - 1)[None]
    _, rand = batch_of_trees(n, 3, n)
    for parents in (chain, rand):
        jumps = pointer_jumps(parents)
        assert len(jumps) == pointer_rounds(n + 1)
        depths, mask = node_depths(parents, jumps), ancestor_mask(parents, jumps)
        vals = torch.tensor([[rng.uniform(-3, 0) for _ in range(n)] for _ in range(parents.shape[0])])
        mins = path_min(vals, parents, jumps)
        for r in range(parents.shape[0]):
            pr = parents[r].tolist()
            assert depths[r].tolist() == ref_depths(pr)
            assert mask[r].tolist() == ref_mask(pr)
            for i in range(n):
                assert mins[r, i].item() == min(vals[r, j].item() for j in ref_ancestors(pr, i))
        assert torch.equal(depths, node_depths(parents)) and torch.equal(mask, ancestor_mask(parents))
    assert node_depths(chain).tolist() == [list(range(n))]
    assert torch.equal(ancestor_mask(chain)[0], torch.ones(n, n, dtype=torch.bool).tril())


# ----------------------------------------------------------------------------- EAGLE

def fake_eagle_lists(b, topk, steps, vocab, gen, ties=False):
    """Per-step lists in SGLang's select_top_k_tokens format, from a random drafter."""
    sl, tl, pl = [], [], []
    fs = None
    for i in range(steps):
        shape = (b, topk) if i == 0 else (b, topk, topk)
        if ties:
            # probabilities that are exactly 1.0 / repeated create score ties
            p = torch.full((*shape, ), 0.5)
            p[..., 0] = 1.0
            ids = torch.stack([torch.randperm(vocab, generator=gen)[:topk] for _ in range(math.prod(shape[:-1]))])
            ids = ids.reshape(shape)
        else:
            logits = torch.randn(*shape[:-1], vocab, generator=gen) * 2
            p, ids = torch.softmax(logits, -1).topk(topk, dim=-1)
        (s, t, pa), fs, _ = eagle_step(i, p, ids, fs)
        sl.append(s)
        tl.append(t)
        pl.append(pa)
    return sl, tl, pl


def ref_rerank(sl, tl, pl, root, n, topk):
    """SGLang's organize_draft_results + build_tree parent rule, one request at a time."""
    b = root.shape[0]
    scores = torch.cat([s.reshape(b, -1) for s in sl], 1)
    toks = torch.cat([t.reshape(b, -1) for t in tl], 1)
    plist = torch.cat([p.reshape(b, -1) for p in pl[:-1]], 1) if len(pl) > 1 else torch.empty(b, 0)
    out_t, out_p, out_s = [], [], []
    for r in range(b):
        sel = sorted(torch.topk(scores[r], n - 1).indices.tolist())
        par = [-1]
        for j, g in enumerate(sel):
            tb = g // topk
            if tb == 0:
                par.append(0)
            else:
                par.append(1 + sel.index(int(plist[r, tb])))
        out_t.append([int(root[r])] + [int(toks[r, g]) for g in sel])
        out_p.append(par)
        out_s.append([1.0] + [float(scores[r, g]) for g in sel])
    return out_t, out_p, out_s


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), topk=st.integers(2, 5), steps=st.integers(1, 5), frac=st.floats(0.0, 1.0))
def test_eagle_rerank_matches_sglang_rule(seed, topk, steps, frac):
    gen = torch.Generator().manual_seed(seed)
    b, vocab = 3, 50
    sl, tl, pl = fake_eagle_lists(b, topk, steps, vocab, gen)
    space = topk + (steps - 1) * topk * topk
    n = 2 + int(frac * (space - 1))
    root = torch.randint(0, vocab, (b,), generator=gen)
    tree = eagle_rerank(sl, tl, pl, root, n)
    rt, rp, rs = ref_rerank(sl, tl, pl, root, n, topk)
    assert tree.tokens.tolist() == rt
    assert tree.parents.tolist() == rp
    assert torch.allclose(tree.logp.exp(), torch.tensor(rs), rtol=1e-5)
    tree.validate()


def test_eagle_rerank_paths_follow_the_drafter():
    """Node tokens along every tree path are the tokens the drafter expanded, in order."""
    gen = torch.Generator().manual_seed(1)
    b, topk, steps, vocab = 2, 3, 4, 40
    sl, tl, pl = fake_eagle_lists(b, topk, steps, vocab, gen)
    tree = eagle_rerank(sl, tl, pl, torch.tensor([7, 8]), 20)
    depths = node_depths(tree.parents)
    # a node at depth d must come from step d-1's score block
    scores = torch.cat([s.reshape(b, -1) for s in sl], 1)
    for r in range(b):
        for i in range(1, 20):
            d = int(depths[r, i])
            lo = 0 if d == 1 else topk + (d - 2) * topk * topk
            hi = topk if d == 1 else lo + topk * topk
            block = scores[r, lo:hi]
            assert torch.isclose(block, tree.logp[r, i].exp()).any()
    # cumulative scores never increase along a path
    par_logp = tree.logp.gather(1, tree.parents.clamp(min=0))
    assert (tree.logp[:, 1:] <= par_logp[:, 1:] + 1e-6).all()


def test_eagle_rerank_ties_stay_ancestor_closed():
    gen = torch.Generator().manual_seed(2)
    for n in range(2, 30):
        sl, tl, pl = fake_eagle_lists(2, 3, 4, 30, gen, ties=True)
        tree = eagle_rerank(sl, tl, pl, torch.tensor([1, 2]), n)
        tree.validate()


def test_eagle_rerank_rejects_bad_budget():
    gen = torch.Generator().manual_seed(3)
    sl, tl, pl = fake_eagle_lists(1, 2, 2, 10, gen)
    with pytest.raises(ValueError):
        eagle_rerank(sl, tl, pl, torch.tensor([0]), 8)  # space = 2 + 4 = 6 -> N <= 7
    with pytest.raises(ValueError):
        eagle_rerank(sl, tl, pl, torch.tensor([0]), 1)


@pytest.mark.parametrize("seed, topk, steps, n", [(0, 3, 4, 20), (1, 2, 1, 3), (2, 4, 3, 30), (3, 10, 7, 60)])
def test_tree_from_selection_matches_rerank(seed, topk, steps, n):
    """Hooking after SGLang's organize_draft_results gives the same tree as eagle_rerank."""
    gen = torch.Generator().manual_seed(seed)
    b = 3
    sl, tl, pl = fake_eagle_lists(b, topk, steps, 200, gen)
    root = torch.randint(0, 200, (b,), generator=gen)
    scores = torch.cat([s.reshape(b, -1) for s in sl], 1)
    toks = torch.cat([t.reshape(b, -1) for t in tl], 1)
    idx = torch.sort(torch.topk(scores, n - 1, dim=-1).indices).values       # organize_draft_results
    plist = torch.cat(pl[:-1], 1) if len(pl) > 1 else torch.empty(b, 0, dtype=torch.int64)
    ref = eagle_rerank(sl, tl, pl, root, n)
    got = tree_from_selection(plist, idx, toks.gather(1, idx), root, topk, scores.gather(1, idx))
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.parents, ref.parents)
    assert torch.allclose(got.logp, ref.logp)
    noscore = tree_from_selection(plist, idx, toks.gather(1, idx), root, topk)
    assert torch.equal(noscore.parents, ref.parents)
    assert (noscore.logp[:, 1:] <= noscore.logp.gather(1, noscore.parents.clamp(min=0))[:, 1:]).all()
    bad = idx.clone()
    if steps > 1:
        deep = (bad // topk > 0).nonzero()
        r, c = deep[0].tolist()
        plist_bad = plist.clone()
        plist_bad[r, bad[r, c] // topk] = 10 ** 6  # parent index that was never selected
        with pytest.raises(ValueError):
            tree_from_selection(plist_bad, bad, toks.gather(1, idx), root, topk)
