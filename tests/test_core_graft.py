"""Pruning and grafting: budgets, ancestor closure, distinct siblings, path provenance, member bins."""

import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_spec.config import GraftPolicy, PruneStage
from graft_spec.kernels.views import Candidates
from graft_spec.merge import merge_select, path_hashes
from graft_spec.prune import DraftStopGate, prune
from graft_spec.sources import NUM_MEMBERS, SOURCE_AGREE, SOURCE_DRAFT, SOURCE_PADDING, SOURCE_SUFFIX
from graft_spec.tree import (DraftTree, eagle_rerank,
                             has_duplicate_siblings, node_depths, validate_parents)
from test_core_reference import ref_ancestors, ref_depths, ref_paths, random_tree
from test_core_tree import fake_eagle_lists


@dataclass
class Cands:
    """Retrieved candidates ``[B, M]`` (parents -1 = child of the root), as the tests build them."""

    tokens: torch.Tensor
    parents: torch.Tensor
    score: torch.Tensor
    valid: torch.Tensor


def graft(d: DraftTree, keep, cands, n, policy=None):
    """The paper-mode stacking of graft_spec.step (kept draft nodes always in, pruned ones refill
    below every retrieved node, retrieved nodes by score) over `merge_select`."""
    policy = policy or GraftPolicy()
    b, nd = d.tokens.shape
    est_d = d.logp.exp().clamp(max=1.0)
    refill = est_d - 2.0 if policy.refill_with_draft else torch.full_like(est_d, -math.inf)
    key_d = torch.where(keep, math.inf, refill)
    valid_d = (d.source == SOURCE_DRAFT) & torch.isfinite(d.logp)
    toks, pars, key, est, valid = [d.tokens], [d.parents], [key_d], [est_d], [valid_d]
    member = [torch.full_like(d.tokens, SOURCE_DRAFT)]
    if cands is not None and cands.tokens.shape[1] > 0:
        toks.append(cands.tokens)
        pars.append(torch.where(cands.parents < 0, 0, cands.parents + nd))
        key.append(cands.score)
        est.append(cands.score)
        valid.append(cands.valid)
        member.append(torch.full_like(cands.tokens, SOURCE_SUFFIX))
    cat = lambda xs: torch.cat(xs, 1)  # noqa: E731
    bins = torch.full_like(cat(toks), -1)
    cands = Candidates(cat(toks), cat(pars), cat(est), cat(valid), bins, cat(member), cat(key))
    tree, _, _ = merge_select(cands, n, policy)
    return tree


def random_candidates(rng: random.Random, roots: list[int], m: int, vocab: int) -> Cands:
    b = len(roots)
    tok = torch.zeros(b, m, dtype=torch.int64)
    par = torch.full((b, m), -1, dtype=torch.int64)
    score = torch.zeros(b, m)
    for r in range(b):
        toks, pars = random_tree(rng, m + 1, vocab, distinct=rng.random() < 0.7)
        edge = [1.0] + [rng.uniform(0.05, 1.0) for _ in range(m)]
        for i in range(1, m + 1):
            tok[r, i - 1] = toks[i]
            par[r, i - 1] = pars[i] - 1
            score[r, i - 1] = math.prod(edge[j] for j in ref_ancestors(pars, i))
    valid = torch.ones(b, m, dtype=torch.bool)
    # knock out a random ancestor-closed part
    for r in range(b):
        for i in range(m):
            if rng.random() < 0.15 or (par[r, i] >= 0 and not valid[r, par[r, i]]):
                valid[r, i] = False
    return Cands(tok, par, score, valid)


def cand_paths(c: Cands, r: int, root: int) -> set:
    toks = [root] + c.tokens[r].tolist()
    pars = [-1] + [p + 1 for p in c.parents[r].tolist()]
    val = [True] + c.valid[r].tolist()
    return {tuple(toks[j] for j in ref_ancestors(pars, i)) for i in range(len(toks)) if val[i]}


def draft_tree(seed, b, topk, steps, n, vocab):
    gen = torch.Generator().manual_seed(seed)
    sl, tl, pl = fake_eagle_lists(b, topk, steps, vocab, gen)
    return eagle_rerank(sl, tl, pl, torch.randint(0, vocab, (b,), generator=gen), n)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(2, 40), m=st.integers(0, 50),
       refill=st.booleans(), root_width=st.sampled_from([None, 1, 3]), min_score=st.sampled_from([0.0, 0.2]))
def test_graft_invariants(seed, n, m, refill, root_width, min_score):
    rng = random.Random(seed)
    b, vocab, topk, steps = 3, 12, 3, 4
    nd = rng.randint(2, 1 + topk + (steps - 1) * topk * topk)
    d = draft_tree(seed, b, topk, steps, nd, vocab)
    stages = [PruneStage(depth=1, threshold=0.9, keep=1), PruneStage(depth=2, threshold=0.5, keep=3)]
    stages = [s for s in stages if s.keep < n]
    pr = prune(d, stages, n)
    cands = random_candidates(rng, d.tokens[:, 0].tolist(), m, vocab)
    pol = GraftPolicy(refill_with_draft=refill, root_width=root_width, min_score=min_score)
    out = graft(d, pr.keep, cands, n, pol)

    assert out.tokens.shape == (b, n)
    validate_parents(out.parents)
    assert not has_duplicate_siblings(out.tokens, out.parents).any()
    assert torch.equal(out.tokens[:, 0], d.tokens[:, 0])
    for r in range(b):
        toks, pars, src = out.tokens[r].tolist(), out.parents[r].tolist(), out.source[r].tolist()
        dpaths = ref_paths(d.tokens[r].tolist(), d.parents[r].tolist())
        kept_paths = {tuple(d.tokens[r, j].item() for j in ref_ancestors(d.parents[r].tolist(), i))
                      for i in range(nd) if pr.keep[r, i]}
        cpaths = cand_paths(cands, r, toks[0])
        out_paths = {}
        n_pad = 0
        for i in range(n):
            path = tuple(toks[j] for j in ref_ancestors(pars, i))
            if src[i] == SOURCE_PADDING:
                n_pad += 1
                assert pars[i] == 0
                continue
            assert n_pad == 0, "padding must come after every real node"
            out_paths[path] = src[i]
            if src[i] == SOURCE_DRAFT:
                assert path in dpaths
            else:
                assert src[i] == SOURCE_SUFFIX and path in cpaths
        assert kept_paths <= set(out_paths), "every kept draft node survives"
        assert len(out_paths) + n_pad == n
        # if everything available fits, nothing is dropped (modulo policy filters)
        if refill and root_width is None and min_score == 0.0 and len(dpaths | cpaths) <= n:
            assert set(out_paths) == dpaths | cpaths
        if root_width is not None:
            new_root_kids = [i for i in range(1, n) if pars[i] == 0 and src[i] == SOURCE_SUFFIX]
            assert len(new_root_kids) <= root_width
        if not refill:
            drafted = sum(1 for i in range(1, n) if src[i] == SOURCE_DRAFT)
            assert drafted <= int(pr.budget[r])


def test_retrieved_path_hangs_under_deepest_existing_node():
    # draft: root 9 -> 1 -> 2 ; retrieved: 9 -> 1 -> 2 -> 3 -> 4 and 9 -> 1 -> 5
    d = DraftTree(torch.tensor([[9, 1, 2]]), torch.tensor([[-1, 0, 1]]),
                  torch.tensor([[0.0, -0.1, -0.2]]), torch.zeros(1, 3, dtype=torch.int64))
    c = Cands(tokens=torch.tensor([[1, 2, 3, 4, 5]]), parents=torch.tensor([[-1, 0, 1, 2, 0]]),
              score=torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.1]]), valid=torch.ones(1, 5, dtype=torch.bool))
    out = graft(d, torch.ones(1, 3, dtype=torch.bool), c, 6)
    assert out.tokens.tolist() == [[9, 1, 2, 3, 4, 5]]
    assert out.parents.tolist() == [[-1, 0, 1, 2, 3, 1]]
    assert out.source.tolist() == [[SOURCE_DRAFT] * 3 + [SOURCE_SUFFIX] * 3]
    # with one slot fewer, the weakest retrieved node (score 0.1) is the one left out
    out = graft(d, torch.ones(1, 3, dtype=torch.bool), c, 5)
    assert out.tokens.tolist() == [[9, 1, 2, 3, 4]]


def test_freed_slots_go_to_best_scores_not_template_order():
    d = DraftTree(torch.tensor([[9, 1]]), torch.tensor([[-1, 0]]), torch.tensor([[0.0, -0.1]]),
                  torch.zeros(1, 2, dtype=torch.int64))
    # chain 5->6->7 with high scores listed *after* weak root children 2, 3
    c = Cands(tokens=torch.tensor([[2, 3, 5, 6, 7]]), parents=torch.tensor([[-1, -1, -1, 2, 3]]),
              score=torch.tensor([[0.05, 0.04, 0.9, 0.8, 0.7]]), valid=torch.ones(1, 5, dtype=torch.bool))
    out = graft(d, torch.ones(1, 2, dtype=torch.bool), c, 5)
    assert sorted(out.tokens[0, 2:].tolist()) == [5, 6, 7]
    out = graft(d, torch.ones(1, 2, dtype=torch.bool), c, 5, GraftPolicy(min_score=0.75))
    assert out.tokens[0].tolist()[:4] == [9, 1, 5, 6] and out.source[0, 4] == SOURCE_PADDING


def test_padding_tokens_distinct_from_root_children():
    d = DraftTree(torch.tensor([[9, 0, 1]]), torch.tensor([[-1, 0, 0]]), torch.tensor([[0.0, -0.1, -0.2]]),
                  torch.zeros(1, 3, dtype=torch.int64))
    out = graft(d, torch.ones(1, 3, dtype=torch.bool), None, 7)
    assert out.tokens.tolist() == [[9, 0, 1, 2, 3, 4, 5]]
    assert out.source.tolist() == [[SOURCE_DRAFT] * 3 + [SOURCE_PADDING] * 4]
    assert out.parents.tolist() == [[-1, 0, 0, 0, 0, 0, 0]]
    assert torch.isinf(out.logp[0, 3:]).all()


def test_member_bins_credit_every_proposing_source():
    """A path proposed by the draft and by the suffix index is one node carrying both members' bins;
    the node's estimate and source come from its best member."""
    toks = torch.tensor([[9, 1, 2, 1, 2, 3]])
    pars = torch.tensor([[-1, 0, 1, 0, 3, 4]])          # draft 9-1-2, suffix 9-1-2-3
    est = torch.tensor([[1.0, 0.5, 0.2, 0.6, 0.4, 0.3]])
    member = torch.tensor([[SOURCE_DRAFT] * 3 + [SOURCE_SUFFIX] * 3])
    bins = torch.tensor([[-1, 10, 11, 20, 21, 22]])
    tree, mb, _ = merge_select(Candidates(toks, pars, est, torch.ones(1, 6, dtype=torch.bool), bins, member), 5)
    assert tree.tokens.tolist() == [[9, 1, 2, 3, 0]]
    assert tree.source[0].tolist() == [SOURCE_DRAFT, SOURCE_SUFFIX, SOURCE_SUFFIX, SOURCE_SUFFIX,
                                       SOURCE_PADDING]
    assert torch.allclose(tree.logp[0, 1:4].exp(), torch.tensor([0.6, 0.4, 0.3]))
    assert mb.shape == (1, 5, NUM_MEMBERS)
    assert mb[0, 1, SOURCE_DRAFT] == 10 and mb[0, 1, SOURCE_SUFFIX] == 20
    assert mb[0, 2, SOURCE_DRAFT] == 11 and mb[0, 2, SOURCE_SUFFIX] == 21
    assert mb[0, 3].tolist() == [-1, -1, 22] + [-1] * (NUM_MEMBERS - 3)
    assert (mb[0, 0] == -1).all() and (mb[0, 4] == -1).all()


def test_agreement_nodes_get_their_own_bin_and_estimate():
    """With ``agreement``, a node the draft and the suffix index both proposed is priced by the larger
    of its best member's estimate and its agreement bin's (draft bin + offset), credits the agreement
    bin instead of the draft bin, and lifts its subtree's keys; a draft-only node keeps its draft bin."""
    toks = torch.tensor([[9, 1, 2, 5, 1, 2, 3]])
    pars = torch.tensor([[-1, 0, 1, 0, 0, 4, 5]])        # draft 9-1-2 and 9-5, suffix 9-1-2-3
    est = torch.tensor([[1.0, 0.5, 0.2, 0.45, 0.3, 0.25, 0.9]])
    member = torch.tensor([[SOURCE_DRAFT] * 4 + [SOURCE_SUFFIX] * 3])
    bins = torch.tensor([[-1, 10, 11, 12, 20, 21, 22]])
    table = torch.zeros(200)
    table[110], table[111], table[112] = 0.95, 0.1, 0.99     # agreement bins of draft bins 10, 11 (12 unused)
    cands = Candidates(toks, pars, est, torch.ones(1, 7, dtype=torch.bool), bins, member)
    tree, mb, _ = merge_select(cands, 4, agreement=(100, table))
    assert tree.tokens.tolist() == [[9, 1, 2, 3]]            # 9-5: capped at 1 - 0.95 by its agreed sibling
    assert torch.allclose(tree.logp[0, 1:].exp(), torch.tensor([0.95, 0.25, 0.25]))
    assert mb[0, 1, SOURCE_DRAFT] == -1 and mb[0, 1, SOURCE_AGREE] == 110 and mb[0, 1, SOURCE_SUFFIX] == 20
    assert mb[0, 2, SOURCE_DRAFT] == -1 and mb[0, 2, SOURCE_AGREE] == 111
    assert mb[0, 3, SOURCE_AGREE] == -1 and mb[0, 3, SOURCE_SUFFIX] == 22
    tree, mb, _ = merge_select(cands, 5, agreement=(100, table))
    assert tree.tokens.tolist() == [[9, 1, 2, 5, 3]]
    assert mb[0, 3, SOURCE_DRAFT] == 12 and mb[0, 3, SOURCE_AGREE] == -1


def test_path_hash_equal_iff_same_path():
    rng = random.Random(5)
    toks, pars = random_tree(rng, 60, 3, distinct=False)
    h = path_hashes(torch.tensor([toks]), torch.tensor([pars]))[0].tolist()
    paths = [tuple(toks[j] for j in ref_ancestors(pars, i)) for i in range(60)]
    for i in range(60):
        for j in range(60):
            assert (h[i] == h[j]) == (paths[i] == paths[j])


# ----------------------------------------------------------------------------- prune

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), thr=st.lists(st.floats(0.01, 0.99), min_size=3, max_size=3))
def test_prune_stage_and_closure(seed, thr):
    b, topk, steps, n = 4, 3, 4, 20
    d = draft_tree(seed, b, topk, steps, n, 30)
    stages = [PruneStage(depth=1, threshold=thr[0], keep=3), PruneStage(depth=2, threshold=thr[1], keep=7),
              PruneStage(depth=4, threshold=thr[2], keep=12)]
    pr = prune(d, stages, n)
    for r in range(b):
        pars = d.parents[r].tolist()
        dep = ref_depths(pars)
        expect_stage, budget = -1, n - 1
        for s, stg in enumerate(stages):
            best = max((d.logp[r, i].item() for i in range(1, n) if dep[i] == stg.depth), default=-math.inf)
            assert pr.confidence[r, s].item() == pytest.approx(math.exp(best), rel=1e-5)
            if math.exp(best) < stg.threshold:
                expect_stage, budget = s, stg.keep
                break
        assert pr.stage[r].item() == expect_stage and pr.budget[r].item() == budget
        kept = [i for i in range(1, n) if pr.keep[r, i]]
        assert len(kept) == budget == pr.num_kept[r].item()
        assert pr.keep[r, 0]
        for i in kept:
            assert pr.keep[r, pars[i]]
        # the kept nodes are the best-scoring ones
        worst_kept = min(d.logp[r, i].item() for i in kept)
        best_dropped = max((d.logp[r, i].item() for i in range(1, n) if not pr.keep[r, i]), default=-math.inf)
        assert worst_kept >= best_dropped


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("full", [False, True])
def test_stop_gate_truncated_tree_prunes_to_the_gate_stage(seed, full):
    """Drafting stopped by DraftStopGate, the never-drafted depths at probability 0 (what the
    SGLang worker does): prune picks a stage at or before the stop depth and keeps only drafted
    nodes; with every candidate in the tree (full) the stage is exactly the gate's first fired one."""
    gen = torch.Generator().manual_seed(seed)
    b, topk, steps = 6, 3, 5
    sl, tl, pl = fake_eagle_lists(b, topk, steps, 12, gen)
    stages = [PruneStage(depth=1, threshold=0.6, keep=3), PruneStage(depth=2, threshold=0.45, keep=7),
              PruneStage(depth=4, threshold=0.3, keep=12)]
    n = 1 + topk + (steps - 1) * topk * topk if full else 20
    gate = DraftStopGate(stages, b)
    best = [s.reshape(b, -1).amax(dim=1) for s in sl]
    for i in range(steps):
        if gate.observe(i + 1, best[i]):
            break
    stop = gate.stop_depth
    first = []
    for r in range(b):
        fired = [k for k, st_ in enumerate(stages) if best[st_.depth - 1][r] < st_.threshold]
        first.append(fired[0] if fired else -1)
    if stop is None:
        assert -1 in first
        return
    assert all(f >= 0 and stages[f].depth <= stop for f in first)
    assert stop == max(stages[f].depth for f in first)
    truncated = [x if i < stop else torch.zeros_like(x) for i, x in enumerate(sl)]
    d = eagle_rerank(truncated, tl, pl, torch.full((b,), 3, dtype=torch.int64), n)
    pr = prune(d, stages, n)
    dep = node_depths(d.parents)
    assert not (pr.keep & (dep > stop)).any(), "a never-drafted node was kept"
    for r in range(b):
        assert pr.stage[r] >= 0 and stages[int(pr.stage[r])].depth <= stop
        if full:
            assert int(pr.stage[r]) == first[r]


def test_stop_gate_waits_for_every_request():
    gate = DraftStopGate([PruneStage(depth=1, threshold=0.5, keep=2), PruneStage(depth=3, threshold=0.2, keep=5)], 2)
    assert not gate.observe(1, torch.tensor([0.4, 0.9]))   # request 1 is confident at depth 1
    assert not gate.observe(2, torch.tensor([0.1, 0.1]))   # no checkpoint at depth 2
    assert gate.observe(3, torch.tensor([0.3, 0.1])) and gate.stop_depth == 3
    assert gate.observe(4, torch.tensor([0.9, 0.9]))       # stays stopped
    never = DraftStopGate([PruneStage(depth=1, threshold=0.5, keep=2)], 2)
    assert not never.observe(1, torch.tensor([0.6, 0.7])) and never.stop_depth is None


def test_prune_missing_depth_fires():
    # a 1-level tree: nothing at depth 2, so a depth-2 checkpoint always fires
    d = DraftTree(torch.tensor([[5, 1, 2, 3]]), torch.tensor([[-1, 0, 0, 0]]),
                  torch.log(torch.tensor([[1.0, 0.9, 0.05, 0.05]])), torch.zeros(1, 4, dtype=torch.int64))
    pr = prune(d, [PruneStage(depth=2, threshold=0.01, keep=1)], 4)
    assert pr.stage.tolist() == [0] and pr.keep.tolist() == [[True, True, False, False]]
    pr = prune(d, [PruneStage(depth=1, threshold=0.5, keep=1)], 4)
    assert pr.stage.tolist() == [-1] and pr.keep.all()


@pytest.mark.parametrize("seed", range(8))
def test_everything_fits_means_union_of_paths(seed):
    rng = random.Random(seed)
    d = draft_tree(seed, 2, 3, 3, rng.randint(2, 15), 6)
    pr = prune(d, [PruneStage(depth=1, threshold=0.99, keep=2)], 40)
    cands = random_candidates(rng, d.tokens[:, 0].tolist(), rng.randint(1, 20), 6)
    out = graft(d, pr.keep, cands, 40)
    for r in range(2):
        dpaths = ref_paths(d.tokens[r].tolist(), d.parents[r].tolist())
        cpaths = cand_paths(cands, r, int(d.tokens[r, 0]))
        real = [i for i in range(40) if out.source[r, i] != SOURCE_PADDING]
        got = {tuple(out.tokens[r, j].item() for j in ref_ancestors(out.parents[r].tolist(), i)) for i in real}
        assert len(dpaths | cpaths) <= 40
        assert got == dpaths | cpaths and len(real) == len(got)
        # a path both drafted and kept is labelled draft; retrieval-only paths retrieved
        for i in real[1:]:
            path = tuple(out.tokens[r, j].item() for j in ref_ancestors(out.parents[r].tolist(), i))
            if path not in dpaths:
                assert out.source[r, i] == SOURCE_SUFFIX


def test_siblings_share_their_parents_mass():
    """At most one child of a node is accepted: a retrieved child that disagrees with a likelier draft
    child is worth at most what the draft child leaves, so the last slot goes one level deeper under
    the draft child instead (``GraftPolicy.exclusive_siblings``: greedy rows by default, sampled rows
    only with ``"always"``)."""
    # root 9; draft 9 -> 1 (0.8) -> 4 (0.5); retrieved 9 -> 2 (0.7) -> 3 (0.65)
    toks = torch.tensor([[9, 1, 4, 2, 3]])
    pars = torch.tensor([[-1, 0, 1, 0, 3]])
    est = torch.tensor([[1.0, 0.8, 0.5, 0.7, 0.65]])
    member = torch.tensor([[SOURCE_DRAFT] * 3 + [SOURCE_SUFFIX] * 2])
    bins = torch.full_like(toks, -1)
    valid = torch.ones(1, 5, dtype=torch.bool)
    greedy, sampled = torch.tensor([False]), torch.tensor([True])
    for policy, rows in [(GraftPolicy(), greedy), (GraftPolicy(), None),
                         (GraftPolicy(exclusive_siblings="always"), sampled)]:
        tree, _, gain = merge_select(Candidates(toks, pars, est, valid, bins, member), 3, policy, gain_nodes=5,
                                     sampled=rows)
        assert tree.tokens.tolist() == [[9, 1, 4]]
        # caps: 2 -> 1 - 0.8 = 0.2, and its child 3 with it; the gain curve sums the capped estimates
        assert torch.allclose(gain[0, :4], torch.tensor([0.8, 1.3, 1.5, 1.7]))
    for policy, rows in [(GraftPolicy(), sampled), (GraftPolicy(exclusive_siblings="never"), greedy)]:
        tree, _, gain = merge_select(Candidates(toks, pars, est, valid, bins, member), 3, policy, sampled=rows)
        assert tree.tokens.tolist() == [[9, 1, 2]]
        assert torch.allclose(gain[0, :2], torch.tensor([0.8, 1.5]))
    # a batch mixing both: each row as if alone
    rep = Candidates(*(x.repeat(2, 1) for x in (toks, pars, est, valid, bins, member)))
    tree, _, _ = merge_select(rep, 3, sampled=torch.tensor([True, False]))
    assert tree.tokens.tolist() == [[9, 1, 2], [9, 1, 4]]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), u=st.integers(2, 30))
def test_sibling_caps_match_a_direct_sum(seed, u):
    from graft_spec.merge import sibling_caps

    rng = random.Random(seed)
    _, pars = random_tree(rng, u, 50, distinct=False)
    est = torch.tensor([[1.0] + [rng.random() for _ in range(u - 1)]])
    key = torch.tensor([[math.inf] + [rng.choice([rng.random(), 0.5]) for _ in range(u - 1)]])
    live = torch.tensor([[True] + [rng.random() < 0.8 for _ in range(u - 1)]])
    cap = sibling_caps(est, key, torch.tensor([pars]), live)[0].tolist()
    assert cap[0] == math.inf
    for i in range(1, u):
        above = sum(est[0, j].item() for j in range(1, u) if j != i and pars[j] == pars[i] and live[0, j]
                    and (key[0, j] > key[0, i] or (key[0, j] == key[0, i] and j < i)))
        assert cap[i] == pytest.approx(max(0.0, est[0, pars[i]].item() - above), abs=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), u=st.integers(2, 30), n=st.integers(2, 34))
def test_selection_does_not_depend_on_the_gain_curve_length(seed, u, n):
    """The tree's N - 1 nodes are the first of the gain curve's ranking when the curve is at least as
    long (no second top-k), and the top-k of the keys when it is shorter: the same nodes either way."""
    rng = random.Random(seed)
    b = 2
    rows = [random_tree(rng, u, 6, distinct=False) for _ in range(b)]
    toks, pars = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
    est = torch.tensor([[1.0] + [rng.choice([rng.random(), 0.5, 0.0]) for _ in range(u - 1)] for _ in range(b)])
    valid = torch.tensor([[True] + [rng.random() < 0.85 for _ in range(u - 1)] for _ in range(b)])
    member = torch.full_like(toks, SOURCE_SUFFIX)
    bins = torch.full_like(toks, -1)
    outs = [merge_select(Candidates(toks, pars, est, valid, bins, member), n, gain_nodes=g) for g in (2, n, n + 7)]
    for tree, mb, _ in outs[1:]:
        assert torch.equal(tree.tokens, outs[0][0].tokens) and torch.equal(tree.parents, outs[0][0].parents)
        assert torch.equal(tree.logp, outs[0][0].logp) and torch.equal(mb, outs[0][1])
