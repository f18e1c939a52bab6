"""The per-request correction of the retrieval sources (request_correction.py): its windows, its
map, and through the planner: a request whose lookup proposals keep failing prices them lower than
a request whose proposals are accepted, from the same bins."""

from __future__ import annotations

import pytest
import torch

from graft_spec.numerics.correction import apply_correction, linear_correction, price
from graft_spec.config import GraftConfig
from graft_spec.graphs import _rows as graph_rows
from graft_spec.pipeline import GraftPlanner
from graft_spec.sources import NUM_MEMBERS, SOURCE_DRAFT, SOURCE_LOOKUP, SOURCE_SUCCESSOR, SOURCE_SUFFIX
from graft_spec.request_correction import RequestCorrection
from graft_spec.step import StepOutput
from test_core_step import dense_inputs


def _round(rc: RequestCorrection, slot: int, member: int, est: float, trials: int, hits: int,
           rounds: int = 1) -> None:
    """``rounds`` verified rounds for ``slot``, each with ``trials`` nodes of ``member`` priced
    ``est``, ``hits`` of them accepted."""
    bins = torch.full((1, trials + 1, NUM_MEMBERS), -1)
    bins[0, 1:, member] = 0
    on_path = torch.zeros(1, trials + 1, dtype=torch.bool)
    on_path[0, : hits + 1] = True
    table = torch.tensor([est, 0.0])
    for _ in range(rounds):
        rc.update(torch.tensor([slot]), bins, on_path, table)


def test_empty_windows_and_uncorrected_members_are_the_identity():
    rc = RequestCorrection(4, window=64.0)
    scale, under = rc.factors(torch.tensor([0, 3]))
    assert scale.shape == (2, NUM_MEMBERS) and (scale == 1).all() and not under.any()
    _round(rc, 0, SOURCE_DRAFT, 0.9, 4, 0, rounds=10)   # the draft member is never corrected
    scale, under = rc.factors(torch.tensor([0]))
    assert (scale == 1).all() and not under.any()


@pytest.mark.parametrize("est, hits, over", [(0.6, 1, True), (0.2, 9, False)])
def test_a_request_window_moves_its_own_estimates_toward_its_rate(est, hits, over):
    """Ten rounds of ten nodes each: the window holds ten trials (one per round, the round's hit
    rate as its outcome), and the request's estimates move toward its rate by 10 / (10 + a)."""
    rc = RequestCorrection(4, window=64.0)
    _round(rc, 1, SOURCE_SUFFIX, est, 10, hits, rounds=10)
    assert rc.recent[1, SOURCE_SUFFIX].tolist() == pytest.approx([10.0, 10 * est, hits], rel=1e-5)
    factors = rc.factors(torch.tensor([1, 2]))
    grid = torch.linspace(0, 1, 11)[None, :].expand(2, 11)
    priced = price(grid, torch.full((1, 1), SOURCE_SUFFIX), factors)
    assert torch.equal(price(grid, SOURCE_SUFFIX, factors), priced)   # one member as an int
    assert torch.equal(priced[1], grid[1])                                # another slot: untouched
    assert (priced[0] <= grid[0]).all() if over else (priced[0] >= grid[0]).all()
    assert (priced[0].diff() >= 0).all() and (priced[0] >= 0).all() and (priced[0] <= 1).all()  # monotone
    # the window's own nodes are priced near their observed rate (8 pseudo-trials pull toward est)
    mid = price(torch.tensor([[est]]), torch.full((1, 1), SOURCE_SUFFIX),
                                  (factors[0][:1], factors[1][:1])).item()
    a = rc.pseudo_trials
    assert mid == pytest.approx((hits + a * est) / (10 + a), abs=1e-5)
    assert torch.equal(price(grid[:1], torch.full((1, 1), SOURCE_LOOKUP),
                                               (factors[0][:1], factors[1][:1])), grid[:1])   # other member


def test_windows_halve_beyond_their_length_and_reset_with_a_new_request():
    rc = RequestCorrection(2, window=16.0)
    _round(rc, 0, SOURCE_SUCCESSOR, 0.5, 4, 2, rounds=17)
    assert rc.recent[0, SOURCE_SUCCESSOR].tolist() == pytest.approx([8.5, 4.25, 4.25])
    rc.reset(torch.tensor([0]))
    assert (rc.recent == 0).all()
    off = RequestCorrection(2, window=0.0)
    _round(off, 0, SOURCE_SUFFIX, 0.9, 4, 0, rounds=5)
    assert not off.enabled and (off.recent == 0).all() and (off.factors(torch.tensor([0]))[0] == 1).all()
    with pytest.raises(ValueError, match="window"):
        RequestCorrection(2, window=-1.0)


def test_the_source_correction_is_the_same_map():
    """`linear_correction` + `apply_correction` (shared with the source correction) scale hits where the
    window over-estimates and misses where it under-estimates; no data = identity."""
    t, e, h = torch.tensor([0.0, 50.0, 50.0]), torch.tensor([0.0, 30.0, 10.0]), torch.tensor([0.0, 10.0, 30.0])
    scale, under = linear_correction(t, e, h, 8.0)
    assert scale[0] == 1 and under.tolist() == [False, False, True]
    b = torch.tensor([0.5, 0.5, 0.5])
    out = apply_correction(b, scale, under)
    assert out[0] == 0.5 and out[1] < 0.5 < out[2] <= 1.0


def _lookup_planner(window: float) -> GraftPlanner:
    cfg = GraftConfig(num_draft_tokens=6, topk=2, depth=2, draft_nodes=False,
                      retrieval={"successor": False, "suffix": False, "outputs": "off", "max_candidates": 4},
                      calibration={"request_window": window})
    return GraftPlanner(cfg, 50, max_slots=4)


def _lookup_round(planner: GraftPlanner, slots: torch.Tensor):
    """Both slots' context rewritten to the same repeating text (the history only: the windows stay),
    then the round's tree."""
    b = slots.shape[0]
    draft, _, host, _, _, _ = dense_inputs(b, 2, 2, 50, 0, "cpu", torch.Generator().manual_seed(0))
    planner.history.reset(slots, torch.tensor([[5, 6, 7, 8, 9] * 4] * b), torch.full((b,), 20))
    return planner.build(draft, torch.full((b,), 9), host, slots, torch.full((b,), 19),
                         torch.zeros(b, dtype=torch.bool))


@pytest.mark.parametrize("window", [64.0, 0.0])
def test_planner_prices_a_failing_requests_lookup_lower(window):
    """Two requests with the same context (the lookup source proposes the same chain to both): slot 1
    rejects every lookup node for a few rounds, slot 2 accepts them. Afterwards slot 1's chain is
    priced lower than slot 2's; the calibrator's metrics carry the prices the round used; a new
    request in slot 1 starts from the shared prices again. Off (window 0): both rows read the same."""
    planner = _lookup_planner(window)
    slots = torch.tensor([1, 2])
    planner.reset_slots(slots, torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    for _ in range(6):
        out = _lookup_round(planner, slots)
        lookup = out.member_bins[:, :, SOURCE_LOOKUP] >= 0
        assert lookup.any()
        on_path = torch.zeros_like(lookup)
        on_path[:, 0] = True
        on_path[1] |= lookup[1]                            # slot 2 accepts its whole chain
        if window > 0:  # the round carries the prices it was built with, through a TP broadcast and a graph replay too
            for carried in (out.factors, StepOutput.unpack(out.pack(), torch.full((2,), 19), out.estimates,
                                                           out.groups, out.factors).factors):
                assert all(torch.equal(a, b) for a, b in zip(carried, planner.request_correction.factors(slots)))
            replayed = graph_rows(out, 1).factors                # StepGraphs' clone of a replay's first rows
            assert all(torch.equal(a, b[:1]) for a, b in zip(replayed, out.factors))
        else:
            assert out.factors is None
        stats = planner.observe(out, on_path, None, torch.zeros(2, 6, dtype=torch.int64),
                                torch.ones(2, dtype=torch.int64), slots)
        # the metric's estimate sum is what the round's tree was priced with
        assert stats.members[:, SOURCE_LOOKUP, 1].sum().item() == pytest.approx(
            (out.tree.logp.exp() * lookup).sum().item(), rel=1e-4)
    first = _lookup_round(planner, slots).tree.logp[:, 1].exp()
    if window > 0:
        assert first[0] < first[1] - 0.05
        planner.reset_slots(slots[:1], torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        again = _lookup_round(planner, slots).tree.logp[:, 1].exp()
        assert first[0] < again[0] < again[1]              # back to the shared price, below slot 2's own
    else:
        assert first[0] == first[1]
