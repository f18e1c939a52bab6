"""Verification: greedy vs a reference walk; sampling reproduces the target distribution.

The distribution test decodes 3 tokens with hybrid (draft + retrieved) trees and compares
the joint distribution of those tokens with the exact target model by a chi-square test
over 20k rows; two deliberately wrong verifiers must fail the very same test.
"""

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_spec.config import GraftPolicy, PruneStage
from graft_spec.metrics import AcceptanceStats
from graft_spec.prune import prune
from graft_spec.sources import GRAFTED_SOURCES, NUM_SOURCES, SOURCE_DRAFT, SOURCE_SUFFIX
from graft_spec.tree import DraftTree, eagle_rerank, eagle_step, has_duplicate_siblings, sibling_links
from graft_spec.verify import VerifyResult, greedy_verify, logits_to_probs, sample_verify
from test_core_graft import Cands, graft  # the paper-mode stacking over merge_select
from test_core_reference import random_tree, ref_greedy


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 30), vocab=st.integers(2, 8))
def test_greedy_matches_reference(seed, n, vocab):
    rng = random.Random(seed)
    b = 4
    rows = [random_tree(rng, n, vocab, distinct=rng.random() < 0.8) for _ in range(b)]
    tokens = torch.tensor([r[0] for r in rows])
    parents = torch.tensor([r[1] for r in rows])
    # target argmax: often the token of some child, so long paths get accepted
    target = torch.tensor([[rng.choice([t for t, p in zip(tok, par) if p == i] or [rng.randrange(vocab)])
                            if rng.random() < 0.8 else rng.randrange(vocab) for i in range(n)]
                           for tok, par in rows])
    source = torch.tensor([[rng.randrange(3) for _ in range(n)] for _ in range(b)])
    res = greedy_verify(tokens, parents, target, source=source)
    for r in range(b):
        path, bonus = ref_greedy(rows[r][0], rows[r][1], target[r].tolist())
        assert res.accept_index[r, : len(path)].tolist() == path
        assert (res.accept_index[r, len(path):] == -1).all()
        assert res.accept_length[r].item() == len(path)
        assert res.bonus[r].item() == bonus
        for s in range(3):
            assert res.accepted_by_source[r, s].item() == sum(1 for i in path[1:] if source[r, i] == s)
        assert res.emitted(tokens)[r] == [rows[r][0][i] for i in path[1:]] + [bonus]
    # sampling with one-hot target distributions is greedy verification (distinct siblings)
    probs = torch.nn.functional.one_hot(target, vocab).float()
    sres = sample_verify(tokens, parents, probs, generator=torch.Generator().manual_seed(seed))
    ok = ~has_duplicate_siblings(tokens, parents)
    assert torch.equal(sres.accept_index[ok], res.accept_index[ok]) and torch.equal(sres.bonus[ok], res.bonus[ok])


# ----------------------------------------------------------------------------- distribution test

V, L, ROWS = 5, 3, 20_000
TOPK, STEPS, ND, N = 2, 3, 7, 9


def tables(processed=False):
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(V, V, V, generator=g) * 2.0
    target = torch.softmax(logits, -1)                                   # p(x | prev2, prev1)
    if processed:  # the sampling distribution after temperature / top-k / top-p
        target = logits_to_probs(logits, temperature=0.8, top_k=3, top_p=0.9)
    draft = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)      # q(x | prev1), a poor drafter
    return target, draft


def build_hybrid(roots: torch.Tensor, draft_q: torch.Tensor, dedupe: bool = True) -> DraftTree:
    """Deterministic hybrid tree per root: EAGLE tree from q + retrieved paths, grafted."""
    b = roots.shape[0]
    sl, tl, pl = [], [], []
    fs, front = None, roots[:, None]
    for i in range(STEPS):
        q = draft_q[front]                                  # [B, F, V]
        p, ids = q.topk(TOPK, dim=-1)
        if i == 0:
            p, ids = p[:, 0], ids[:, 0]
        (s, t, pa), fs, nxt = eagle_step(i, p, ids, fs)
        sl.append(s)
        tl.append(t)
        pl.append(pa)
        front = t.gather(1, nxt)
    d = eagle_rerank(sl, tl, pl, roots, ND)
    pr = prune(d, [PruneStage(depth=1, threshold=0.5, keep=2), PruneStage(depth=2, threshold=0.4, keep=4)], N)
    # retrieved: root -> a -> (r+2), root -> (r+3), a -> r with a = the drafter's own top-1
    # (a deterministic function of the root, so allowed), i.e. always a duplicate of a draft
    # root child that graft must merge
    r = roots[:, None]
    a = draft_q[roots].argmax(dim=-1, keepdim=True)
    c = Cands(tokens=torch.cat([a, (r + 2) % V, (r + 3) % V, r], 1),
              parents=torch.tensor([[-1, 0, -1, 0]]).expand(b, 4),
              score=torch.tensor([[0.6, 0.4, 0.3, 0.2]]).expand(b, 4),
              valid=torch.ones(b, 4, dtype=torch.bool))
    if dedupe:
        return graft(d, pr.keep, c, N, GraftPolicy())
    # wrong: plain union of kept draft nodes and candidates, no merging of duplicates
    rows = []
    for bi in range(b):
        kept = [i for i in range(ND) if pr.keep[bi, i]]
        remap = {old: new for new, old in enumerate(kept)}
        tok = [int(d.tokens[bi, i]) for i in kept]
        par = [-1] + [remap[int(d.parents[bi, i])] for i in kept[1:]]
        off = len(tok)
        for j in range(4):
            tok.append(int(c.tokens[bi, j]))
            par.append(0 if c.parents[bi, j] < 0 else off + int(c.parents[bi, j]))
        rows.append((tok, par))
    w = max(len(t) for t, _ in rows)
    # equal widths: pad with a chain below the last node (adds no duplicate siblings)
    tok = torch.tensor([t + [0] * (w - len(t)) for t, _ in rows])
    par = torch.tensor([p + list(range(len(p) - 1, w - 1)) for _, p in rows])
    return DraftTree(tok, par, torch.zeros(b, w), torch.zeros(b, w, dtype=torch.int64))


def node_target_probs(tree: DraftTree, prev: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    ptok = tree.tokens.gather(1, tree.parents.clamp(min=0))
    ptok[:, 0] = prev
    return table[ptok, tree.tokens]                          # [B, N, V]


def wrong_no_renorm(tokens, parents, probs, *, generator=None, source=None):
    """Accepts sibling x with p(x) instead of p(x) / remaining mass (one coin per sibling).

    Everything else as in sample_verify: on rejection x is zeroed; if all siblings are
    rejected the bonus comes from the renormalised residual.
    """
    b, n = tokens.shape
    rows = torch.arange(b)
    cur = torch.zeros(b, dtype=torch.int64)
    active = torch.ones(b, dtype=torch.bool)
    on_path = torch.zeros(b, n, dtype=torch.bool)
    on_path[:, 0] = True
    bonus = torch.zeros(b, dtype=torch.int64)
    for _ in range(n):
        p = probs[rows, cur].double()
        p = p / p.sum(1, keepdim=True)
        children = (parents == cur[:, None]) & active[:, None]
        u = torch.rand(b, n, generator=generator, dtype=torch.float64)
        hit = children & (u < p.gather(1, tokens))
        accepted = hit.any(1)
        nxt = hit.to(torch.int8).argmax(1)
        cand = torch.zeros(b, V + 1, dtype=torch.bool)
        cand.scatter_(1, torch.where(children, tokens, V), True)
        resid = torch.where(cand[:, :V], 0.0, p)
        resid = torch.where(resid.sum(1, keepdim=True) > 0, resid, p)
        draw = torch.multinomial(resid.float(), 1, generator=generator).squeeze(1)
        bonus = torch.where(active & ~accepted, draw, bonus)
        on_path[rows, nxt] |= accepted
        cur = torch.where(accepted, nxt, cur)
        active = accepted
        if not active.any():
            break
    ar = torch.arange(n)
    srt = torch.where(on_path, ar, n).sort(1).values
    return VerifyResult(torch.where(srt == n, -1, srt), on_path.sum(1), bonus, torch.zeros(b, NUM_SOURCES, dtype=torch.int64))


def decode_joint(verify, dedupe=True, seed=0, processed=False):
    target, draft_q = tables(processed)
    gen = torch.Generator().manual_seed(seed)
    prev = torch.full((ROWS,), 1)
    root = torch.full((ROWS,), 2)
    out = [[] for _ in range(ROWS)]
    todo = torch.arange(ROWS)
    stats = AcceptanceStats()
    retrieved_hits = 0
    per_root = build_hybrid(torch.arange(V), draft_q, dedupe)  # trees depend on the root only
    while todo.numel():
        r = root[todo]
        tree = DraftTree(per_root.tokens[r], per_root.parents[r], per_root.logp[r], per_root.source[r])
        if dedupe:
            assert not has_duplicate_siblings(tree.tokens, tree.parents).any()
        probs = node_target_probs(tree, prev[todo], target)
        res = verify(tree.tokens, tree.parents, probs, generator=gen, source=tree.source)
        stats.update(res)
        retrieved_hits += int(res.accepted_by_source[:, list(GRAFTED_SOURCES)].sum())
        em = res.emitted(tree.tokens)
        keep = []
        for j, r in enumerate(todo.tolist()):
            full = [1, 2] + out[r] + em[j]
            out[r].extend(em[j])
            prev[r], root[r] = full[-2], full[-1]
            if len(out[r]) < L:
                keep.append(r)
        todo = torch.tensor(keep, dtype=torch.int64)
    counts = {}
    for o in out:
        key = tuple(o[:L])
        counts[key] = counts.get(key, 0) + 1
    exact = {}
    for seq in itertools.product(range(V), repeat=L):
        ctx = [1, 2] + list(seq)
        p = 1.0
        for i in range(L):
            p *= float(target[ctx[i], ctx[i + 1], ctx[i + 2]])
        exact[seq] = p
    return counts, exact, stats, retrieved_hits


def chi_square(counts, exact):
    """Pearson statistic with cells of expected count < 5 pooled; returns (stat, df)."""
    stat, pooled_o, pooled_e, cells = 0.0, 0, 0.0, 0
    for seq, p in exact.items():
        e = p * ROWS
        o = counts.get(seq, 0)
        if e < 5:
            pooled_o += o
            pooled_e += e
        else:
            stat += (o - e) ** 2 / e
            cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return stat, cells - 1


def critical(df, z=3.0902):  # alpha = 1e-3, Wilson-Hilferty approximation of the chi2 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("processed", [False, True], ids=["softmax", "temp-topk-topp"])
def test_sampling_reproduces_target_distribution(processed):
    counts, exact, stats, retrieved_hits = decode_joint(sample_verify, processed=processed)
    stat, df = chi_square(counts, exact)
    assert df >= 10
    if processed:  # outcomes outside the top-k / top-p support never appear
        assert all(counts.get(seq, 0) == 0 for seq, p in exact.items() if p == 0)
    assert stat < critical(df), (stat, df)
    # the trees really were hybrid and really were used
    assert stats.tau > 1.3
    assert stats.by_source[SOURCE_DRAFT] > 1000 and retrieved_hits > 1000


def test_root_only_sampling_draws_the_target_distribution():
    """A plain decode round (N = 1) takes `sample_verify`'s one-draw path: the bonus follows the
    root's target distribution (chi-square, rows drawn at once), a zero-probability token never."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    rows = 20000
    gen = torch.Generator().manual_seed(0)
    res = sample_verify(torch.zeros(rows, 1, dtype=torch.int64), torch.full((rows, 1), -1),
                        (p * 3.0).expand(rows, 1, -1), generator=gen)   # unnormalised rows are fine
    assert res.accept_length.eq(1).all() and res.accept_index[:, 0].eq(0).all()
    counts = torch.bincount(res.bonus, minlength=p.numel()).double()
    assert counts[-1] == 0
    e = p[:-1].double() * rows
    stat = float(((counts[:-1] - e) ** 2 / e).sum())
    assert stat < critical(p.numel() - 2), stat


def test_wrong_verifier_without_renormalisation_is_rejected():
    counts, exact, _, _ = decode_joint(wrong_no_renorm)
    stat, df = chi_square(counts, exact)
    assert stat > critical(df), (stat, df)


def test_verifier_on_undeduplicated_tree_is_rejected():
    counts, exact, _, _ = decode_joint(sample_verify, dedupe=False)
    stat, df = chi_square(counts, exact)
    assert stat > critical(df), (stat, df)


# ----------------------------------------------------------------------------- logits -> probs

def test_logits_to_probs():
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 50)
    p = logits_to_probs(logits, temperature=torch.tensor([1.0, 0.5, 0.0]), top_k=torch.tensor([0, 5, 0]),
                        top_p=torch.tensor([0.9, 1.0, 1.0]))
    assert torch.allclose(p.sum(-1), torch.ones(3, 2))
    # row 0: plain softmax restricted to the smallest prefix with mass >= 0.9
    ref = torch.softmax(logits[0], -1)
    srt, idx = ref.sort(-1, descending=True)
    keep = (srt.cumsum(-1) - srt) < 0.9
    exp0 = torch.zeros_like(ref).scatter(-1, idx, torch.where(keep, srt, 0.0))
    assert torch.allclose(p[0], exp0 / exp0.sum(-1, keepdim=True), atol=1e-6)
    # row 1: temperature 0.5 then top-5
    ref = torch.softmax(logits[1] / 0.5, -1)
    top = ref.topk(5, -1)
    exp1 = torch.zeros_like(ref).scatter(-1, top.indices, top.values)
    assert torch.allclose(p[1], exp1 / exp1.sum(-1, keepdim=True), atol=1e-6)
    # row 2: greedy
    assert torch.equal(p[2].argmax(-1), logits[2].argmax(-1)) and torch.equal(p[2].max(-1).values, torch.ones(2))


def test_metrics_accumulate():
    by_source = torch.zeros(2, NUM_SOURCES, dtype=torch.int64)
    by_source[0, SOURCE_SUFFIX] = 1
    res = VerifyResult(torch.tensor([[0, 2, -1], [0, -1, -1]]), torch.tensor([2, 1]), torch.tensor([4, 5]),
                       by_source)
    s = AcceptanceStats()
    s.update(res, stage=torch.tensor([0, -1]))
    s.update(res, num_verified=torch.tensor([3, 2]))
    assert s.tau == pytest.approx(1.5)
    assert s.verified_per_step == pytest.approx((6 + 5) / 4)
    d = s.to_dict()
    assert d["accept_length_hist"] == {1: 2, 2: 2}
    assert d["source_share"]["suffix"] == 1.0 and d["stage_hist"] == {-1: 1, 0: 1}
