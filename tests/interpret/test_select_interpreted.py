"""The fused selection kernel (graft_spec/kernels/select.py) against `kernels.select.merge_select_reference`,
bit for bit, run by Triton's interpreter on CPU.

Collected in the main test run, these tests skip unless ``TRITON_INTERPRET=1`` was set before
Triton was imported; tests/test_kernels_select.py runs this file in a subprocess with it set. The
interpreter costs ~0.3 s per request whatever its size, so the big batches are fixed examples.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported "
                                       "(tests/test_kernels_select.py)")

NAMES = ("tokens", "parents", "logp", "source", "member_bins", "gain")


def candidates(b: int, u: int, seed: int, vocab: int = 6, paper: bool = False):
    """A stacked candidate block ``[b, u]`` as `Candidates.stack` builds it: the root, a draft tree
    (member 0), then retrieved chains (members 1..5) that partly repeat draft paths token for token
    (duplicates), hang under the root or a draft node, and carry invalid nodes (their subtrees drop).
    Estimates are coarse (many exact ties, zeros); ``paper``: some draft keys are +inf."""
    g = torch.Generator().manual_seed(seed)
    draft = max(1, u // 3)
    tokens = torch.randint(0, vocab, (b, u), generator=g)
    parents = torch.zeros(b, u, dtype=torch.int64)
    member = torch.zeros(b, u, dtype=torch.int64)
    for i in range(1, u):
        if i < draft:
            parents[:, i] = torch.randint(0, i, (b,), generator=g)
        else:   # a chain: continue the previous node, or start under the root / a draft node
            start = torch.rand(b, generator=g) < 0.3
            parents[:, i] = torch.where(start, torch.randint(0, draft, (b,), generator=g), i - 1)
            member[:, i] = torch.where(start | (i == draft), torch.randint(1, 6, (b,), generator=g),
                                       member[:, i - 1])
    copy = (torch.rand(b, u, generator=g) < 0.5) & (parents < draft) & (torch.arange(u) >= draft)
    src = parents.clamp(min=0) + 1                             # re-propose the token of a draft child
    tokens = torch.where(copy & (src < draft), tokens.gather(1, src.clamp(max=u - 1)), tokens)
    est = torch.randint(0, 9, (b, u), generator=g).float() / 8
    valid = torch.rand(b, u, generator=g) < 0.85
    est = torch.where(valid, est, 0.0)
    key = est.clone()
    if paper:
        key = torch.where((torch.rand(b, u, generator=g) < 0.2) & (torch.arange(u) < draft), math.inf, key)
    bins = torch.where(torch.rand(b, u, generator=g) < 0.9, torch.randint(0, 40, (b, u), generator=g), -1)
    parents[:, 0] = -1
    from graft_spec.kernels.views import Candidates

    return Candidates(tokens, parents, est, valid, bins, member, key)


def select_args(cands, num_nodes: int, gain_nodes: int, min_score: float, root_width, siblings: str, sampled,
                offset: int, table, rows, invert: bool = False) -> tuple:
    """`merge_select_reference`'s arguments (the views) from the flat values."""
    from graft_spec.kernels.views import Agreement, SelectOptions

    return (cands, SelectOptions(num_nodes, gain_nodes, min_score, root_width, siblings), sampled,
            Agreement(offset, table, rows, invert) if table is not None else None)


def compare(args):
    from graft_spec.kernels.select import merge_select_reference, select_triton

    fused = select_triton(*args)
    ref = merge_select_reference(*args)
    for name, a, r in zip(NAMES, fused, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        if name == "logp":   # the kernel's own log: within float32 rounding, -inf where the estimate is 0
            assert torch.equal(a.isinf(), r.isinf()) and torch.allclose(a, r, rtol=1e-6, atol=1e-7), name
        else:                # every other output bit for bit
            assert torch.equal(a, r), (name, (a != r).nonzero()[:4].tolist())


@st.composite
def cases(draw):
    b = draw(st.sampled_from([1, 2, 3]))
    n = draw(st.sampled_from([2, 5, 24, 60]))
    u = draw(st.sampled_from([1, 2, 17, 40, 90, 183]))
    seed = draw(st.integers(0, 2 ** 31))
    g = torch.Generator().manual_seed(seed + 1)
    cand = candidates(b, u, seed, vocab=draw(st.sampled_from([2, 6, 1000])), paper=draw(st.booleans()))
    sampled = draw(st.sampled_from([None, "mixed"]))
    sampled = torch.rand(b, generator=g) < 0.5 if sampled else None
    agree = draw(st.sampled_from([None, "all", "rows", "inverted rows"]))
    table = torch.rand(200, generator=g) if agree else None
    rows = torch.rand(b, generator=g) < 0.5 if agree in ("rows", "inverted rows") else None
    return select_args(cand, n, draw(st.sampled_from([n, n + 7, 2, 1])),
                       draw(st.sampled_from([0.0, 0.25, 0.3])), draw(st.sampled_from([None, 1, 3])),
                       draw(st.sampled_from(["never", "greedy", "always"])), sampled, 100, table, rows,
                       agree == "inverted rows")


@settings(max_examples=20, deadline=None)
@given(args=cases())
def test_select_kernel_equals_reference(args):
    compare(args)


@pytest.mark.parametrize("mode", ["never", "greedy", "always"])
def test_select_kernel_on_a_mixed_batch(mode):
    """16 rows, greedy and sampled mixed, agreement on some rows, root width and min score."""
    g = torch.Generator().manual_seed(7)
    b = 16
    args = select_args(candidates(b, 120, 3, paper=True), 24, 24, 0.1, 2, mode, torch.rand(b, generator=g) < 0.5,
                       100, torch.rand(200, generator=g), torch.rand(b, generator=g) < 0.5, mode == "greedy")
    compare(args)


@pytest.mark.parametrize("b,n", [(16, 24), (64, 60)])
def test_select_kernel_on_the_steps_candidates(b, n, monkeypatch):
    """The candidates `GraftStep` stacks (every other row sampled, the output index and agreement
    on), at the issue's batch sizes and widths."""
    from graft_spec.config import GraftConfig
    from graft_spec.kernels.select import merge_select_op
    from graft_spec.pipeline import GraftPlanner

    from test_core_step import SHAPES, dense_inputs

    seen = []
    reference = merge_select_op.reference
    monkeypatch.setattr(merge_select_op, "reference", lambda *a: seen.append(a) or reference(*a))
    topk, steps = SHAPES[n]
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=steps, retrieval={"outputs": True})
    planner = GraftPlanner(cfg, 500, max_slots=b)
    planner.ensure_slots(b)
    planner.build(*dense_inputs(b, topk, steps, 500, 16, "cpu", torch.Generator().manual_seed(b * n)))
    assert len(seen) == 1 and seen[0][3] is not None      # agreement priced
    compare(seen[0])


@pytest.mark.parametrize("n", [24, 60])
def test_select_kernel_on_the_benchmarks_candidates(n, monkeypatch):
    """The candidates of `sglang_patch.bench.step`'s workload (default config, Qwen3's vocabulary):
    the widths the server stacks at N 24 and 60 (U 180 and 360), so the GPU compile check
    (tests/kernel_launches.py) sees the kernel at the shapes it runs."""
    from graft_spec.kernels.select import merge_select_op
    from graft_spec.pipeline import dense_draft_candidates
    from sglang_patch.bench.step import dense_lists, workload

    seen = []
    reference = merge_select_op.reference
    monkeypatch.setattr(merge_select_op, "reference", lambda *a: seen.append(a) or reference(*a))
    b, vocab = 2, 151936
    w = workload(b, n, vocab, seed=n)
    sl, tl, pl = dense_lists(b, w.topk, w.depth, vocab, w.gen)
    scores = torch.cat([x.reshape(b, -1) for x in sl], 1)
    plist = torch.cat([x.reshape(b, -1) for x in pl[:-1]], 1)
    roots = torch.tensor([w.streams[i].take(1)[0] for i in range(b)])
    w.planner.build(dense_draft_candidates(scores, torch.cat(tl, 1), plist, w.topk, w.depth), roots,
                    w.planner.host_candidates(w.rids), torch.arange(b), torch.tensor(w.ctx) - 1,
                    torch.tensor([False, True]))
    assert len(seen) == 1 and seen[0][0].tokens.shape[1] >= 4 * n
    compare(seen[0])
