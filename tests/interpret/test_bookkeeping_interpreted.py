"""The fused bookkeeping kernels (observe, table refresh, successor update) against their torch
references, bit for bit, in every state they mutate and every result, run by Triton's interpreter.

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


def _planner(slots: int, source_window: float = 256.0, request_window: float = 64.0):
    from graft_spec.config import GraftConfig
    from graft_spec.pipeline import GraftPlanner

    cfg = GraftConfig(calibration={"source_window": source_window, "request_window": request_window})
    return GraftPlanner(cfg, 500, max_slots=slots)


def _counts(cal, g: torch.Generator) -> None:
    """Counts with fractional bits (as halving leaves them), some bins past their memory."""
    n = cal.trials.numel()
    trials = torch.randint(0, 9000, (n,), generator=g).float() / 2.0 ** torch.randint(0, 12, (n,), generator=g)
    trials[torch.rand(n, generator=g) < 0.5] = 0.0
    cal.trials.copy_(trials)
    cal.hits.copy_(torch.floor(trials * torch.rand(n, generator=g)))
    cal.trials[-1] = 0.0
    cal.hits[-1] = 0.0
    t = torch.randint(0, 600, (cal.recent.shape[0] - 1,), generator=g).to(torch.int64) << 32
    cal.recent[:-1, 0] = t
    cal.recent[:-1, 1] = (t.double() * torch.rand(t.shape[0], generator=g, dtype=torch.float64)).to(torch.int64)
    cal.recent[:-1, 2] = (t.double() * torch.rand(t.shape[0], generator=g, dtype=torch.float64)).to(torch.int64)


def _state(planner) -> dict:
    cal = planner.calibrator
    return {"trials": cal.trials, "hits": cal.hits, "recent": cal.recent, "base": cal._base, "table": cal.table,
            "request": planner.request_correction.recent, "hist": planner.history.tokens,
            "count": planner.history.count, "successor": planner.successor.table}


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _assert_equal(a: dict, b: dict) -> None:
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@st.composite
def rounds(draw):
    return (draw(st.sampled_from([1, 3, 16, 64])), draw(st.sampled_from([2, 24, 60])),
            draw(st.integers(0, 2 ** 31 - 1)), draw(st.booleans()), draw(st.sampled_from([0.0, 64.0])),
            draw(st.booleans()))


@settings(max_examples=14, deadline=None)
@given(case=rounds())
def test_observe_kernel_equals_reference(case):
    from graft_spec.kernels.observe import gain_columns, observe_rows_reference, observe_rows_triton
    from graft_spec.kernels.views import CalibrationState, Commit, ObserveOptions, Prices, RoundOutcome, Windows
    from graft_spec.sources import NUM_MEMBERS, NUM_SOURCES

    b, n, seed, window_on, rc_window, with_gain = case
    g = torch.Generator().manual_seed(seed)
    slots = b + 5
    planner = _planner(slots)
    cal = planner.calibrator
    _counts(cal, g)
    cal.refresh()
    planner.request_correction.recent.copy_(torch.rand(slots, NUM_MEMBERS, 3, generator=g) * 70)
    planner.history.tokens.copy_(torch.randint(0, 500, planner.history.tokens.shape, generator=g))
    planner.history.count.copy_(torch.randint(0, planner.history.length + 1, (slots,), generator=g))
    s1 = cal.trials.numel()
    # bins drawn from a small pool, so that many nodes of many rows credit the same bins
    pool = torch.randint(0, s1 - 1, (max(4, b * n // 8),), generator=g)
    bins = pool[torch.randint(0, pool.numel(), (b, n, NUM_MEMBERS), generator=g)]
    bins = torch.where(torch.rand(b, n, NUM_MEMBERS, generator=g) < 0.6, -1, bins)
    bins[:, 0] = -1
    on_path = torch.rand(b, n, generator=g) < 0.4
    on_path[:, 0] = True
    depth = torch.randint(0, 80, (b, n), generator=g)
    source = torch.randint(0, NUM_SOURCES, (b, n), generator=g)
    scale = torch.rand(b, NUM_MEMBERS, generator=g)
    under = torch.rand(b, NUM_MEMBERS, generator=g) < 0.5
    gain = torch.rand(b, n - 1 if with_gain else 0, generator=g).cumsum(1)
    cols = gain_columns((1, 2, 6, 12, 24, 61, n), gain.shape[1], "cpu")
    slot_ids = torch.randperm(slots, generator=g)[:b]
    committed = torch.randint(0, 500, (b, n), generator=g)
    accept_len = torch.randint(1, n + 1, (b,), generator=g)
    outcome = RoundOutcome(bins, on_path, depth, source)
    prices = Prices(cal.table.clone(), scale, under)
    base = cal._base.clone()
    opts = ObserveOptions(window_on, rc_window, cal.max_depth)
    results, states = [], []
    for fn in (observe_rows_reference, observe_rows_triton):
        st_ = _clone(_state(planner))
        state = CalibrationState(st_["hits"], st_["trials"], cal.prior, st_["recent"], cal._group, base, cal.table)
        results.append(fn(outcome, prices, state, gain, cols, Commit(slot_ids, committed, accept_len), st_["request"],
                          Windows(st_["hist"], st_["count"]), opts))
        states.append(st_)
    _assert_equal(states[0], states[1])
    for name, r, f in zip(("sources", "members", "depths", "expected"), *results):
        assert r.dtype == f.dtype and r.shape == f.shape, name
        assert torch.equal(r, f), name


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), window=st.sampled_from([0.0, 64.0, 256.0]))
def test_refresh_kernel_equals_reference(seed, window):
    from graft_spec.kernels.refresh import refresh_reference, refresh_triton
    from graft_spec.kernels.views import CalibrationState, RefreshOptions

    planner = _planner(2, source_window=window)
    cal = planner.calibrator
    _counts(cal, torch.Generator().manual_seed(seed))
    st0 = _state(planner)
    outs = []
    for fn in (refresh_reference, refresh_triton):
        s = _clone(st0)
        fn(CalibrationState(s["hits"], s["trials"], cal.prior, s["recent"], cal._group, s["base"], s["table"]),
           cal.refresh_index,
           RefreshOptions(cal.w, cal.halve_at, window, cal.SOURCE_PSEUDO_TRIALS))
        outs.append(s)
        assert int(cal.refresh_index.arrivals) == 0                   # the kernel's last program reset it
    _assert_equal(outs[0], outs[1])
    assert not torch.equal(outs[0]["table"], st0["table"])          # it did recompute


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from([(1, 1), (7, 1), (1, 24), (25, 8), (40, 24)]), seed=st.integers(0, 2 ** 31 - 1),
       k2=st.sampled_from([3, 8, 11]), groups=st.sampled_from([1, 3]), rows=st.sampled_from([None, 37]),
       sources=st.booleans())
def test_successor_kernel_equals_reference(shape, seed, k2, groups, rows, sources):
    from graft_spec.kernels.successor import successor_update_reference, successor_update_triton
    from graft_spec.retrieval.successor import SuccessorTable
    from graft_spec.sources import SOURCE_PADDING

    g = torch.Generator().manual_seed(seed)
    vocab = 300
    b, n = shape
    succ = SuccessorTable(vocab, k=8, groups=groups, rows=rows)
    succ.table.copy_(torch.randint(-1, vocab, succ.table.shape, generator=g).to(torch.int32))
    succ._keep_empty_rows()
    # few distinct tokens: many nodes write the same rows; some out of the vocabulary
    tokens = torch.randint(-2, 40, (b, n), generator=g)
    tokens[torch.rand(b, n, generator=g) < 0.05] = vocab + 3
    topk = torch.randint(0, vocab, (b * n, k2), generator=g)
    valid = torch.rand(b, n, generator=g) < 0.8
    invalid = 0
    if sources:   # the nodes' sources, padding marking the nodes that do not learn
        valid = torch.where(valid, torch.randint(0, SOURCE_PADDING, (b, n), generator=g), SOURCE_PADDING)
        invalid = SOURCE_PADDING
    grp = torch.randint(0, groups, (b, 3), generator=g)
    grp = grp[:, 1] if sources else grp[:, 1].contiguous()   # a packed host block's column, read in place
    tables = []
    for fn in (successor_update_reference, successor_update_triton):
        t = succ.table.clone()
        fn(t, tokens, topk, valid, grp, succ.rows, vocab, invalid)
        tables.append(t)
    assert torch.equal(tables[0], tables[1])


@settings(max_examples=10, deadline=None)
@given(b=st.sampled_from([1, 16, 64]), seed=st.integers(0, 2 ** 31 - 1), window=st.sampled_from([0.0, 64.0]))
def test_request_factors_kernel_equals_reference(b, seed, window):
    from graft_spec.kernels.factors import factors_reference, factors_triton
    from graft_spec.request_correction import RequestCorrection
    from graft_spec.sources import NUM_MEMBERS

    g = torch.Generator().manual_seed(seed)
    rc = RequestCorrection(b + 3, window)
    t = torch.randint(0, 80, (b + 3, NUM_MEMBERS), generator=g).float() * torch.rand(b + 3, NUM_MEMBERS, generator=g)
    rc.recent.copy_(torch.stack([t, t * torch.rand(t.shape, generator=g), t * torch.rand(t.shape, generator=g)], 2))
    rc.recent[0] = 0.0                                                        # an empty window: the identity
    slots = torch.randperm(b + 3, generator=g)[:b]
    on = rc._on if rc.enabled else rc._off
    for f, r in zip(factors_triton(rc.recent, slots, on, rc.pseudo_trials),
                    factors_reference(rc.recent, slots, on, rc.pseudo_trials)):
        assert f.dtype == r.dtype and torch.equal(f, r)


@pytest.mark.parametrize("b,bucket,dtype", [(1, 1, torch.int64), (5, 8, torch.int32), (130, 160, torch.int64)])
def test_load_rows_kernel_equals_reference(b, bucket, dtype):
    """A round's roots, slots, lengths and sampled rows into the first rows of a bucket's buffers:
    integer sources of either width and strided views, the rows past the batch untouched."""
    from graft_spec.kernels.inputs import load_rows_reference, load_rows_triton

    g = torch.Generator().manual_seed(b)
    srcs = (torch.randint(0, 1000, (b, 2), generator=g).to(dtype)[:, 1],   # a strided column
            torch.randint(0, 64, (b,), generator=g).to(dtype), torch.randint(0, 4096, (b,), generator=g),
            torch.rand(b, generator=g) < 0.5)
    outs = []
    for fn in (load_rows_reference, load_rows_triton):
        bufs = [torch.full((bucket,), -3, dtype=torch.int64) for _ in range(3)] + [torch.ones(bucket, dtype=torch.bool)]
        fn(*bufs, *srcs)
        outs.append(bufs)
    for ref, ker in zip(*outs):
        assert ref.dtype == ker.dtype and torch.equal(ref, ker)
    assert torch.equal(outs[0][0][:b], srcs[0].long()) and (outs[0][0][b:] == -3).all()


@pytest.mark.parametrize("b,bucket,n,w,dtype", [(1, 1, 12, 5, torch.int64), (5, 8, 24, 6, torch.int32),
                                                (70, 96, 60, 8, torch.int64)])
def test_load_outcome_kernel_equals_reference(b, bucket, n, w, dtype):
    """A verified round into an observe's buffers: accepted paths of every length (the root alone
    up to ``w`` nodes) in SGLang's accept index, committed tokens wider than the buffer read through
    a strided view, integer inputs of either width; the rows past the batch untouched."""
    from graft_spec.kernels.inputs import load_outcome_reference, load_outcome_triton
    from graft_spec.tree import on_path_from_accept_index

    g = torch.Generator().manual_seed(b)
    lens = torch.randint(1, w + 1, (b,), generator=g)
    nodes = torch.sort(torch.rand(b, n, generator=g)[:, 1:].argsort(1)[:, : w - 1] + 1, dim=1).values
    path = torch.cat([torch.zeros(b, 1, dtype=torch.int64), nodes], 1) + torch.arange(b)[:, None] * n
    accept = torch.where(torch.arange(w) < lens[:, None], path, -1).to(dtype)
    committed = torch.randint(0, 5000, (b, 2 * (n + 3)), generator=g).to(dtype)[:, ::2]    # [b, n + 3], strided
    srcs = (accept, committed, lens.to(dtype), torch.randperm(bucket, generator=g)[:b])
    outs = []
    for fn in (load_outcome_reference, load_outcome_triton):
        bufs = [torch.ones(bucket, n, dtype=torch.bool), torch.full((bucket, n), -3, dtype=torch.int64),
                torch.full((bucket,), -3, dtype=torch.int64), torch.full((bucket,), -3, dtype=torch.int64),
                torch.full((1,), -3, dtype=torch.int64)]
        fn(*bufs, *srcs)
        outs.append(bufs)
    for ref, ker in zip(*outs):
        assert ref.dtype == ker.dtype and torch.equal(ref, ker)
    ref = outs[0]
    assert torch.equal(ref[0][:b], on_path_from_accept_index(accept, n)) and ref[0][b:].all()
    assert torch.equal(ref[0][:b].sum(1), lens) and int(ref[4]) == b
    assert torch.equal(ref[1][:b], committed[:, :n].long()) and (ref[1][b:] == -3).all()
