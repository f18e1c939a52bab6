"""Every fused kernel against its torch reference, bit for bit, run by Triton's interpreter on CPU.

Collected in the main test run, these tests skip unless ``TRITON_INTERPRET=1`` was set before
Triton was imported; tests/test_kernels.py runs this file in a subprocess with it set.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported (tests/test_kernels.py)")


def _trees(draw, b: int, n: int) -> torch.Tensor:
    """``int64[b, n]`` parents: random trees, chains and stars mixed (root -1, parent < index)."""
    rows = []
    for _ in range(b):
        shape = draw(st.sampled_from(["random", "chain", "star", "deep_then_wide"]))
        if shape == "chain":
            par = [-1] + list(range(n - 1))
        elif shape == "star":
            par = [-1] + [0] * (n - 1)
        elif shape == "deep_then_wide":
            half = n // 2
            par = [-1] + list(range(half - 1)) + [half - 1] * (n - half)
        else:
            par = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
        rows.append(par[:n])
    return torch.tensor(rows, dtype=torch.int64)


@st.composite
def layouts(draw):
    b = draw(st.sampled_from([1, 3, 16]))
    n = draw(st.sampled_from([2, 5, 24, 37, 60]))
    parents = _trees(draw, b, n)
    seq_lens = torch.tensor([draw(st.integers(0, 4096)) for _ in range(b)], dtype=torch.int64)
    return parents, seq_lens


@settings(max_examples=20, deadline=None)
@given(case=layouts())
def test_tree_layout_kernel_equals_reference(case):
    from graft_spec.kernels.layout import layout_reference, layout_triton

    parents, seq_lens = case
    fused = layout_triton(parents, seq_lens)
    ref = layout_reference(parents, seq_lens)
    for name, a, r in zip(("depth", "positions", "mask", "first_child", "next_sibling"), fused, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert torch.equal(a, r), name


@pytest.mark.parametrize("n", [24, 60])
@pytest.mark.parametrize("b", [1, 16, 64])
def test_tree_layout_kernel_on_merge_select_trees(b, n):
    """The trees the step builds (padding included), at the issue's batch sizes and widths."""
    from graft_spec.config import GraftConfig
    from graft_spec.kernels.layout import layout_reference, layout_triton
    from graft_spec.pipeline import GraftPlanner

    from test_core_step import SHAPES, dense_inputs

    topk, steps = SHAPES[n]
    planner = GraftPlanner(GraftConfig(num_draft_tokens=n, topk=topk, depth=steps), 500, max_slots=b)
    planner.ensure_slots(b)
    args = dense_inputs(b, topk, steps, 500, 16, "cpu", torch.Generator().manual_seed(b * n))
    out = planner.build(*args)
    fused = layout_triton(out.tree.parents, args[4])
    for a, r in zip(fused, layout_reference(out.tree.parents, args[4])):
        assert torch.equal(a, r)


def _draft_case(b: int, n: int, seed: int, mode: str):
    """Draft candidates of the step's shapes: dense EAGLE trees (``dense``), the same with ties
    (scores rounded to a few values), undrafted (-inf) and NaN entries (``adversarial``)."""
    from test_core_step import SHAPES, dense_inputs

    topk, steps = SHAPES[n]
    g = torch.Generator().manual_seed(seed)
    draft = dense_inputs(b, topk, steps, 500, 4, "cpu", g)[0]
    if mode == "adversarial":
        logq = (draft.logq * 2).round() / 2                                    # many equal keys
        r = torch.rand(logq.shape, generator=g)
        logq = torch.where(r < 0.1, -float("inf"), torch.where(r > 0.95, float("nan"), logq))
        logq = torch.where((r > 0.9) & (r <= 0.95), torch.full_like(logq, -70.0), logq)
        draft.logq = logq
    return draft, torch.randint(0, 500, (b,), generator=g), torch.rand(b, generator=g) < 0.5


@settings(max_examples=10, deadline=None)
@given(b=st.sampled_from([1, 3, 16]), n=st.sampled_from([24, 60]), seed=st.integers(0, 2 ** 31 - 1),
       mode=st.sampled_from(["dense", "adversarial"]), by_logq=st.booleans(), draft_nodes=st.booleans())
def test_draft_part_kernel_equals_reference(b, n, seed, mode, by_logq, draft_nodes):
    from graft_spec.config import GraftConfig
    from graft_spec.kernels.draft_part import draft_part_reference, draft_part_triton
    from graft_spec.kernels.views import DraftOptions
    from graft_spec.pipeline import GraftPlanner

    from test_core_step import SHAPES

    draft, roots, sampled = _draft_case(b, n, seed, mode)
    topk, steps = SHAPES[n]
    cal = GraftPlanner(GraftConfig(num_draft_tokens=n, topk=topk, depth=steps), 500).calibrator
    table = torch.rand(cal.table.shape, generator=torch.Generator().manual_seed(seed))
    table[::7] = table[::7].round(decimals=1)                                 # equal estimates: ties
    args = (draft, roots, sampled, cal.draft_view(table), DraftOptions(n, draft_nodes, by_logq))
    for name, f, r in zip(("tokens", "parents", "est", "valid", "bins", "logq"), draft_part_triton(*args),
                          draft_part_reference(*args)):
        assert f.dtype == r.dtype and f.shape == r.shape, name
        assert torch.equal(f, r) or (name == "logq" and torch.equal(f.nan_to_num(), r.nan_to_num())), name


def test_draft_part_kernel_at_batch_64():
    test_draft_part_kernel_equals_reference.hypothesis.inner_test(64, 60, 7, "adversarial", False, True)


@settings(max_examples=10, deadline=None)
@given(b=st.sampled_from([1, 3, 16]), shape=st.sampled_from([(4, 4), (10, 7), (3, 5), (4, 1), (2, 3)]),
       seed=st.integers(0, 2 ** 31 - 1), mode=st.sampled_from(["dense", "adversarial"]), by_logq=st.booleans(),
       draft_nodes=st.booleans(), links=st.sampled_from(["exact", "wider", "none"]))
def test_dense_draft_part_kernel_equals_reference(b, shape, seed, mode, by_logq, draft_nodes, links):
    """The dense form (links derived in the kernel from ``parent_list`` and ``topk``) against
    `dense_draft_part_reference`: the step's shapes (4 x 4, 10 x 7) and others, one draft step, a
    ``parent_list`` as wide as the layout needs, wider (the sink's extra columns), or empty (steps
    1); ties, zeros, NaN and negative scores."""
    from graft_spec.config import GraftConfig
    from graft_spec.kernels.draft_part import dense_draft_part_reference, dense_draft_part_triton
    from graft_spec.kernels.views import DraftOptions
    from graft_spec.pipeline import GraftPlanner
    from graft_spec.step import dense_logq

    topk, steps = shape
    g = torch.Generator().manual_seed(seed)
    s = topk + (steps - 1) * topk * topk
    scores = torch.rand(b, s, generator=g)
    if mode == "adversarial":
        scores = (scores * 4).round() / 4                                      # many equal keys, zeros
        r = torch.rand(b, s, generator=g)
        scores = torch.where(r < 0.05, float("nan"), torch.where(r > 0.95, -0.5, scores))
    need = (s - 1) // topk + 1
    width = {"exact": need, "wider": need + 3, "none": 0}[links if steps > 1 else "none"]
    parent_list = torch.randint(0, s, (b, width), generator=g)
    tokens = torch.randint(0, 500, (b, s), generator=g)
    n = min(24, 1 + s)
    cal = GraftPlanner(GraftConfig(num_draft_tokens=n, topk=topk, depth=steps), 500).calibrator
    table = torch.rand(cal.table.shape, generator=g)
    args = (tokens, parent_list, dense_logq(scores), topk, torch.randint(0, 500, (b,), generator=g),
            torch.rand(b, generator=g) < 0.5, cal.draft_view(table), DraftOptions(n, draft_nodes, by_logq))
    for name, f, r in zip(("tokens", "parents", "est", "valid", "bins", "logq"), dense_draft_part_triton(*args),
                          dense_draft_part_reference(*args)):
        assert f.dtype == r.dtype and f.shape == r.shape, name
        assert torch.equal(f, r) or (name == "logq" and torch.equal(f.nan_to_num(), r.nan_to_num())), name


def test_dense_draft_part_kernel_at_batch_64():
    test_dense_draft_part_kernel_equals_reference.hypothesis.inner_test(64, (10, 7), 11, "adversarial", False, True,
                                                                        "wider")


@settings(max_examples=12, deadline=None)
@given(b=st.sampled_from([1, 5, 64]), widths=st.lists(st.integers(1, 130), min_size=1, max_size=4),
       seed=st.integers(0, 2 ** 31 - 1))
def test_stack_kernel_equals_reference(b, widths, seed):
    from graft_spec.kernels.stack import stack_reference, stack_triton

    g = torch.Generator().manual_seed(seed)
    blocks = []
    for w in widths:
        blocks += [torch.randint(0, 500, (b, w), generator=g), torch.randint(-1, w, (b, w), generator=g),
                   torch.rand(b, w, generator=g), torch.rand(b, w, generator=g) < 0.5,
                   torch.randint(-1, 900, (b, w), generator=g), torch.randint(0, 7, (b, w), generator=g),
                   torch.where(torch.rand(b, w, generator=g) < 0.1, float("inf"), torch.rand(b, w, generator=g))]
    speculate = torch.rand(b, generator=g) < 0.8
    for f, r in zip(stack_triton(blocks, speculate), stack_reference(blocks, speculate)):
        assert f.dtype == r.dtype and f.shape == r.shape and torch.equal(f, r)
