"""The fused device retrieval candidates (graft_spec/kernels/successor_part.py, chain_part.py) against
their torch references, bit for bit, run by Triton's interpreter.

Collected in the main test run, these tests skip unless ``TRITON_INTERPRET=1`` was set before
Triton was imported; tests/test_kernels_device_sources.py runs this file in a subprocess with it set.
"""

from __future__ import annotations

import os

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported "
                                       "(tests/test_kernels_device_sources.py)")

NUM_MEMBERS = 7


def _assert_same(fused, ref) -> None:
    assert len(fused) == len(ref) == 6
    for i, (a, r) in enumerate(zip(fused, ref)):
        assert a.dtype == r.dtype and a.shape == r.shape, i
        assert torch.equal(a, r), i


def _factors(b: int, g: torch.Generator, identity: bool):
    if identity:
        return torch.ones(b, NUM_MEMBERS), torch.zeros(b, NUM_MEMBERS, dtype=torch.bool)
    scale = torch.rand(b, NUM_MEMBERS, generator=g) * 0.9 + 0.1
    scale[torch.rand(b, NUM_MEMBERS, generator=g) < 0.3] = 1.0
    return scale, torch.rand(b, NUM_MEMBERS, generator=g) < 0.5


# ----------------------------------------------------------------------------- successor part

@st.composite
def successor_cases(draw):
    return (draw(st.sampled_from([1, 16, 64])), draw(st.sampled_from([(8, 8, 64), (4, 3, 11), (2, 8, 24)])),
            draw(st.sampled_from([(1, None), (3, None), (4, 13)])), draw(st.sampled_from(["random", "empty", "full"])),
            draw(st.booleans()), draw(st.integers(0, 2 ** 31 - 1)))


@settings(max_examples=6, deadline=None)
@given(case=successor_cases())
def test_successor_part_kernel_equals_reference(case):
    from graft_spec.kernels.successor_part import successor_part_reference, successor_part_triton
    from graft_spec.kernels.views import Prices
    from graft_spec.retrieval.successor import SuccessorTable

    b, (k, max_depth, size), (groups, rows), fill, identity, seed = case
    g = torch.Generator().manual_seed(seed)
    vocab = 40
    succ = SuccessorTable(vocab, k=k, max_depth=max_depth, size=size, groups=groups, rows=rows)
    r = succ.rows
    view = succ.table.view(groups, r + 2, k)
    if fill != "empty":   # tokens in [-1, vocab + 3): empty entries and out-of-vocabulary ones too
        vals = torch.randint(-1 if fill == "random" else 0, vocab + 3, (groups, r, k), generator=g)
        vals[torch.rand(groups, r, k, generator=g) < (0.3 if fill == "random" else 0.0)] = -1
        view[:, :r] = vals.to(torch.int32)
    roots = torch.randint(-2, vocab + 2, (b,), generator=g)
    grp = torch.randint(0, groups, (b,), generator=g)
    sampled = torch.rand(b, generator=g) < 0.5
    t = succ.size
    offset, per_mode = 17, 17 + t + 9
    est_table = torch.rand(2 * per_mode + 1, generator=g)
    scale, under = _factors(b, g, identity)
    args = (roots, grp, sampled, succ.view, Prices(est_table, scale, under), offset, per_mode)
    ref = successor_part_reference(*args)
    _assert_same(successor_part_triton(*args), ref)
    if fill == "empty":
        assert not ref[3].any()


# ----------------------------------------------------------------------------- chain part

@st.composite
def chain_cases(draw):
    return (draw(st.sampled_from([1, 16, 64])), draw(st.sampled_from([24, 60])), draw(st.sampled_from([16, 40, 300])),
            draw(st.sampled_from([(True, True), (True, False), (False, True)])),        # lookup, output index
            draw(st.sampled_from([(True, False), (True, True), (False, True)])),        # output modes
            draw(st.sampled_from([(64, 4), (256, 16), (128, 1)])), draw(st.sampled_from(["random", "loops", "empty"])),
            draw(st.booleans()), draw(st.integers(0, 2 ** 31 - 1)))


def _histories(b: int, length: int, kind: str, vocab: int, g: torch.Generator):
    """``(hist int64[B, L], count int64[B])``: random text, or loops of short periods (the lookup
    wraps), counts from 0 to L (a padded left part is -1 as in history.py)."""
    if kind == "loops":
        period = torch.randint(1, 7, (b, 1), generator=g)
        cycle = torch.randint(0, vocab, (b, 8), generator=g)
        hist = cycle.gather(1, torch.arange(length)[None, :] % period)
    else:
        hist = torch.randint(0, vocab, (b, length), generator=g)
    count = torch.randint(0, length + 1, (b,), generator=g)
    count[torch.rand(b, generator=g) < 0.3] = length
    hist = torch.where(torch.arange(length)[None, :] >= length - count[:, None], hist, -1)
    return hist, count


@settings(max_examples=8, deadline=None)
@given(case=chain_cases())
def test_chain_part_kernel_equals_reference(case):
    from graft_spec.calibration import BinLayout, Calibrator
    from graft_spec.kernels.chain_part import chain_part_reference, chain_part_triton
    from graft_spec.kernels.views import ChainOptions, Prices, Windows
    from graft_spec.numerics.lookup import LOOKUP_MAX_MATCH
    from graft_spec.retrieval.output_ring import OutputRing

    b, n, length, (lookup, outputs), (greedy, sampled_mode), (cap, max_match), kind, identity, seed = case
    g = torch.Generator().manual_seed(seed)
    vocab = 5 if kind == "loops" else 7
    groups_n = 3
    hist, count = _histories(b, length, kind, vocab, g)
    groups = torch.randint(0, groups_n, (b,), generator=g)
    sampled = torch.rand(b, generator=g) < 0.5
    ring = None
    if outputs:
        ring = OutputRing(capacity=cap, max_match=max_match, depth=n - 1)
        if kind != "empty":   # earlier answers to the rows' tails (some in other groups), past the capacity
            for i in torch.randperm(b, generator=g)[: min(b, 24)].tolist():
                tail = [t for t in hist[i, -12:].tolist() if t >= 0]
                cont = torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
                ring.insert(tail[int(torch.randint(0, len(tail) + 1, (1,), generator=g)):] + cont.tolist(),
                            int(groups[i]) if torch.rand(1, generator=g) < 0.8 else groups_n)
    cal = Calibrator(BinLayout(4, 8), torch.full((8,), 0.3))
    est_table = torch.rand(cal.table.numel(), generator=g)
    scale, under = _factors(b, g, identity)
    args = (Windows(hist, count), groups, sampled, Prices(est_table, scale, under), cal.retrieval_view,
            ring.view if ring is not None else None,
            ChainOptions(n - 1, LOOKUP_MAX_MATCH if lookup else 0, greedy, sampled_mode))
    ref = chain_part_reference(*args)
    _assert_same(chain_part_triton(*args), ref)
