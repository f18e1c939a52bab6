"""The per-round graft step: static shapes and no host reads (meta tensors, fullgraph compile, a
dispatch-level check), re-anchoring of host proposals, calibration, the stop gate, and a simulated
decode loop in which Graft is never worse than its parts."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graft_spec.calibration import CHAIN_DECAY
from graft_spec.config import GraftConfig
from graft_spec.pipeline import GraftPlanner, on_path_from_accept_index
from graft_spec.retrieval.buffer import HostCandidates
from graft_spec.step import DenseDraft, dense_draft_candidates, reanchor
from graft_spec.sources import (NUM_MEMBERS, SOURCE_AGREE, SOURCE_DRAFT, SOURCE_LOOKUP, SOURCE_OUTPUTS,
                                SOURCE_PADDING, SOURCE_SUFFIX, grafted)
from graft_spec.tree import eagle_step, has_duplicate_siblings, validate_parents
from graft_spec.verify import greedy_verify
from sglang_patch.bench.step import OpCounter

#: aten ops that read device data on the host, copy between devices, or have data-dependent shapes
HOST_OPS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "lift_fresh", "_to_copy",
            "to_copy", "index.Tensor_bool")


class HostReadGuard(TorchDispatchMode):
    """Records every aten op the step dispatches that reads data on the host or moves it between
    devices (see `HOST_OPS`); a ``_to_copy`` that stays on the same device is allowed (dtype casts)."""

    def __init__(self):
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if any(h in name for h in HOST_OPS):
            moves = "device" in kwargs and args and isinstance(args[0], torch.Tensor) and \
                torch.device(kwargs["device"]) != args[0].device
            if not name.startswith("_to_copy") or moves:
                self.bad.append(name)
        if name.startswith("index.Tensor") and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                                   for a in (args[1] if len(args) > 1 else []) if a is not None):
            self.bad.append("boolean index")
        return func(*args, **(kwargs or {}))


def dense_inputs(b, topk, steps, vocab, m, dev, gen=None, succ_rows=True, unconverted=False):
    """A round's build inputs from random dense EAGLE lists; the draft as `DraftCandidates`, or with
    ``unconverted`` as the `DenseDraft` the SGLang worker hands over."""
    s = topk + (steps - 1) * topk * topk
    p = 1 + topk * (steps - 1)
    if dev == "meta":
        scores, tokens = torch.rand(b, s, device=dev), torch.randint(0, vocab, (b, s), device=dev)
        parent_list = torch.randint(0, s, (b, p), device=dev)
    else:
        sl, tl, pl, fs = [], [], [], None
        for i in range(steps):
            shape = (b, topk) if i == 0 else (b, topk, topk)
            q = torch.softmax(torch.randn(*shape, generator=gen) * 2, -1).sort(-1, descending=True).values
            (sc, tk, pa), fs, _ = eagle_step(i, q, torch.randint(0, vocab, shape, generator=gen), fs)
            sl.append(sc.reshape(b, -1))
            tl.append(tk)
            pl.append(pa)
        scores, tokens = torch.cat(sl, 1), torch.cat(tl, 1)
        parent_list = torch.cat([x.reshape(b, -1) for x in pl[:-1]], 1)
    draft = (DenseDraft(scores, tokens, parent_list, topk, steps) if unconverted
             else dense_draft_candidates(scores, tokens, parent_list, topk, steps))

    def randint(shape):   # from ``gen`` when given: the inputs must not depend on earlier tests' draws
        if gen is None or dev == "meta":
            return torch.randint(0, vocab, shape, device=dev)
        return torch.randint(0, vocab, shape, generator=gen).to(dev)

    host = HostCandidates(randint((b, m)), torch.full((b, m), -1, device=dev),
                          torch.zeros(b, m, device=dev), torch.full((b, m), SOURCE_SUFFIX, device=dev),
                          torch.ones(b, m, dtype=torch.int64, device=dev), torch.full((b,), 5, device=dev),
                          torch.zeros(b, dtype=torch.int64, device=dev))
    return (draft, randint((b,)), host, torch.arange(b, device=dev),
            torch.full((b,), 4, device=dev), torch.arange(b, device=dev) % 2 == 1)


SHAPES = {24: (4, 4), 60: (10, 7)}


@pytest.mark.parametrize("n", [24, 60])
@pytest.mark.parametrize("b", [1, 16, 64])
def test_step_runs_on_meta_tensors(b, n):
    """Static shapes and no host read: the step (and the planner's device state) runs on ``meta``."""
    topk, steps = SHAPES[n]
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=steps, retrieval={"outputs": True})
    planner = GraftPlanner(cfg, 151936, device="meta", max_slots=64)
    out = planner.build(*dense_inputs(b, topk, steps, 151936, 64, "meta"))
    assert out.tree.tokens.shape == (b, n) and out.mask.shape == (b, n, n)
    assert out.member_bins.shape == (b, n, NUM_MEMBERS) and out.positions.device.type == "meta"


@pytest.mark.parametrize("n,b,exclusive", [(24, 1, "greedy"), (24, 16, "greedy"), (24, 64, "greedy"),
                                            (60, 1, "greedy"), (60, 16, "greedy"), (60, 64, "greedy"),
                                            (24, 16, "always"), (60, 64, "never")])
def test_step_compiles_fullgraph_and_dispatches_no_host_op(b, n, exclusive):
    """``torch.compile(fullgraph=True, dynamic=False)`` traces the whole step without a graph break
    (a host read or data-dependent branch would break it), the compiled step equals the eager one,
    and the eager step dispatches none of `HOST_OPS`; with every sibling-caps mode, and the output
    index on greedy rows only (the default) or on every row; at batch 16 the draft comes as the
    unconverted `DenseDraft`."""
    topk, steps = SHAPES[n]
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=steps, graft={"exclusive_siblings": exclusive},
                      retrieval={"outputs": "greedy" if exclusive == "greedy" else "on"})
    planner = GraftPlanner(cfg, 5000, max_slots=64)
    gen = torch.Generator().manual_seed(b * 100 + n)
    args = dense_inputs(b, topk, steps, 5000, 64, "cpu", gen, unconverted=b == 16)   # 16: the server's form
    slots = args[3]
    ctx = torch.randint(0, 5000, (b, 40), generator=gen)
    planner.history.reset(slots, ctx, torch.full((b,), 40))
    for row in ctx[: min(b, 8)].tolist():            # earlier requests wrote some of these contexts
        planner.outputs.insert(row + [int(t) for t in torch.randint(0, 5000, (20,), generator=gen)])

    def step(*a):
        out = planner.build(*a)
        return out.tree.tokens, out.tree.parents, out.mask, out.positions, out.member_bins

    with HostReadGuard() as guard:
        eager = step(*args)
    assert guard.bad == [], f"the step dispatched host ops: {sorted(set(guard.bad))}"
    assert (eager[4][..., SOURCE_OUTPUTS] >= 0).any()           # the output index proposed on the device
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")(*args)
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)
    torch._dynamo.reset()


def _outputs_planner(outputs):
    cfg = GraftConfig(num_draft_tokens=24, topk=4, depth=4, retrieval={"outputs": outputs})
    planner = GraftPlanner(cfg, 5000, max_slots=16)
    gen = torch.Generator().manual_seed(11)
    args = dense_inputs(16, 4, 4, 5000, 16, "cpu", gen)
    ctx = torch.randint(0, 5000, (16, 40), generator=gen)
    planner.history.reset(args[3], ctx, torch.full((16,), 40))
    for row in ctx.tolist():                              # every context has an earlier answer
        planner.outputs.insert(row + [int(t) for t in torch.randint(0, 5000, (20,), generator=gen)])
    return planner, args


@pytest.mark.parametrize("modes", [(True, True), (True, False), (False, True)])
def test_mode_selector_picks_the_rows_of_mode_rows(modes):
    """The step's op-free form of a mode mask: rows where ``rows`` is not ``invert``."""
    from graft_spec.numerics.rows import mode_rows, mode_selector

    sampled = torch.tensor([True, False, False, True, False])
    rows, invert = mode_selector(modes, sampled)
    want = mode_rows(modes, sampled)
    expected = {(True, True): None, (True, False): ~sampled, (False, True): sampled}[modes]
    assert (want is None) if expected is None else torch.equal(want, expected)
    if want is None:
        assert rows is None
    else:
        assert torch.equal(rows != invert, want)
        assert rows is sampled                                  # no op: the sampled mask as it is
    with pytest.raises(ValueError):
        mode_selector((False, False), sampled)
    assert not mode_rows((False, False), sampled).any()


@pytest.mark.parametrize("outputs", ["greedy", "on"])
def test_output_index_candidates_go_to_the_rows_of_its_mode(outputs):
    """``retrieval.outputs: greedy`` (default): the output index proposes to greedy rows only, and
    only their agreement nodes use the agreement bins; ``on``: every row gets both."""
    planner, args = _outputs_planner(outputs)
    sampled = args[5]
    out = planner.build(*args)
    has_outputs = (out.member_bins[..., SOURCE_OUTPUTS] >= 0).any(dim=1)
    has_agree = (out.member_bins[..., SOURCE_AGREE] >= 0).any(dim=1)
    assert has_outputs[~sampled].all()
    assert has_outputs[sampled].all() if outputs == "on" else not has_outputs[sampled].any()
    if outputs == "greedy":
        assert not has_agree[sampled].any()
        assert planner.config.agreement_modes == (True, False)
    else:
        assert planner.config.agreement_modes == (True, True)


def test_guard_catches_host_reads():
    """The guard is not vacuous: item(), bool() and a list turned into a tensor are all caught."""
    x = torch.arange(4)
    for fn in (lambda: x.sum().item(), lambda: bool((x > 2).any()), lambda: torch.tensor([1, 2, 3, 4]) + x,
               lambda: x[x > 1], lambda: x.nonzero()):
        with HostReadGuard() as guard:
            fn()
        assert guard.bad, fn


# ----------------------------------------------------------------------------- re-anchoring

def test_reanchor_moves_matching_paths_under_the_new_root():
    # host anchored after ... 7; it proposed 8 -> 9 -> 10 -> 11 and 8 -> 5, and 3 -> 4
    tok = torch.tensor([[8, 9, 10, 11, 5, 3, 4]])
    par = torch.tensor([[-1, 0, 1, 2, 0, -1, 5]])
    logp = torch.log(torch.tensor([[0.9, 0.8, 0.6, 0.5, 0.1, 0.05, 0.04]]))
    member = torch.full((1, 7), SOURCE_SUFFIX)
    match = torch.full((1, 7), 3)
    host = HostCandidates(tok, par, logp, member, match, torch.tensor([10]), torch.zeros(1, dtype=torch.int64))
    # the device committed 8, 9 since (root = 9): seq_len + 1 = 12 = 10 + gap 2
    hist = torch.tensor([[5, 6, 7, 8, 9]])       # right-aligned window, all 5 valid
    new_par, depth, lp, mt, valid = reanchor(host, hist, torch.tensor([5]), torch.tensor([11]))
    assert valid[0].tolist() == [False, False, True, True, False, False, False]
    assert new_par[0, 2] == -1 and new_par[0, 3] == 2 and depth[0, 2:4].tolist() == [1, 2]
    assert lp[0, 2:4].exp().tolist() == pytest.approx([0.6 / 0.8, 0.5 / 0.8])
    assert mt[0, 2:4].tolist() == [5, 5]
    # no lag: everything stays, under the root
    host0 = HostCandidates(tok, par, logp, member, match, torch.tensor([12]), torch.zeros(1, dtype=torch.int64))
    new_par, depth, lp, _, valid = reanchor(host0, hist, torch.tensor([5]), torch.tensor([11]))
    assert valid.all() and torch.equal(new_par, par) and torch.allclose(lp, logp)
    # a gap the history does not hold (only 2 valid tokens): nothing survives
    host3 = HostCandidates(tok, par, logp, member, match, torch.tensor([9]), torch.zeros(1, dtype=torch.int64))
    assert not reanchor(host3, hist, torch.tensor([2]), torch.tensor([11]))[4].any()


def test_planner_grafts_a_lagging_host_proposal_shifted():
    """End to end through the planner: a suffix continuation proposed one round late still lands
    under the current root (the overlap scheduler's case)."""
    cfg = GraftConfig(num_draft_tokens=8, topk=2, depth=3, draft_nodes=False,
                      retrieval={"successor": False, "lookup": False, "max_candidates": 16})
    planner = GraftPlanner(cfg, 100, max_slots=4)
    planner.start_request("r", [1, 2, 3, 4, 5, 6, 1, 2])        # host knows ... 1 2
    host = planner.host_candidates(["r"])
    assert host.anchor_len.tolist() == [8]
    ctx = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4]])         # the device committed 3 4 since
    planner.history.reset(torch.tensor([2]), ctx, torch.tensor([10]))
    args = dense_inputs(1, 2, 3, 100, 0, "cpu", torch.Generator().manual_seed(0))
    out = planner.build(args[0], torch.tensor([4]), host, torch.tensor([2]), torch.tensor([9]),
                        torch.tensor([False]))
    real = out.tree.source[0] != SOURCE_PADDING
    assert out.tree.tokens[0][real].tolist()[:4] == [4, 5, 6, 1]
    assert grafted(out.tree.source[0, 1:4]).all()


# ----------------------------------------------------------------------------- calibration

def test_calibration_settles_on_observed_rates():
    """Estimates of a bin converge to its observed acceptance; the metrics compare them."""
    cfg = GraftConfig(num_draft_tokens=6, topk=2, depth=2, retrieval={"successor": False, "suffix": False})
    planner = GraftPlanner(cfg, 50)
    cal = planner.calibrator
    b, n = 4, 8
    rng = torch.Generator().manual_seed(0)
    d1 = cal.draft_bins(torch.ones(1, 1, dtype=torch.int64), torch.tensor([[-0.2]]), torch.zeros(1, dtype=torch.bool))
    bin1 = int(d1)
    totals = torch.zeros(NUM_MEMBERS, 3, dtype=torch.float64)
    for _ in range(300):
        est = cal.refresh()
        bins = torch.full((b, n, NUM_MEMBERS), -1)
        bins[:, 1, 0] = bin1
        on_path = torch.zeros(b, n, dtype=torch.bool)
        on_path[:, 0] = True
        on_path[:, 1] = torch.rand(b, generator=rng) < 0.3
        totals += cal.update(bins, on_path, torch.ones(b, n, dtype=torch.int64), est)[0]
    assert cal.refresh()[bin1].item() == pytest.approx(0.3, abs=0.05)
    trials, estimated, hits = totals[SOURCE_DRAFT].tolist()
    assert trials == 1200 and abs(estimated - hits) / trials < 0.1
    # monotone in the probability axis: a less probable bin never gets a higher estimate
    lower = int(cal.draft_bins(torch.ones(1, 1, dtype=torch.int64), torch.tensor([[-5.0]]),
                               torch.zeros(1, dtype=torch.bool)))
    assert cal.refresh()[lower] <= cal.refresh()[bin1]


def test_chained_retrieval_estimates_follow_the_sequential_recurrence():
    """A retrieval bin's prior is the estimate of the bin one depth shallower times CHAIN_DECAY per
    depth step (`Calibrator.refresh`); the log-depth scan that composes the chain equals the
    sequential recurrence, written out here in float64, up to float32 rounding."""
    planner = GraftPlanner(GraftConfig(), 50)
    cal = planner.calibrator
    g = torch.Generator().manual_seed(5)
    n = cal.hits.numel()
    cal.trials = torch.randint(0, 400, (n,), generator=g).float() * (torch.rand(n, generator=g) < 0.7)
    cal.hits = (cal.trials * torch.rand(n, generator=g)).floor()
    mids = (1.0, 2.0, 3.0, 4.0, 5.5, 7.5, 10.5, 14.5, 20.5, 28.5, 40.5, 56.0)   # calibration._DEPTH_MID
    depths = torch.tensor([[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60]])          # one per depth bin
    est = cal.refresh()
    for member in (SOURCE_SUFFIX, SOURCE_LOOKUP, SOURCE_OUTPUTS):
        for sampled in (False, True):
            bins = cal.retrieval_bins(torch.full_like(depths, member), depths, torch.full(depths.shape, -0.7),
                                      torch.full_like(depths, 5), torch.tensor([sampled]))[0].tolist()
            assert bins == sorted(set(bins)) and len(bins) == len(mids)
            w, h, t, prior = cal.w, cal.hits.double(), cal.trials.double(), cal.prior.double()
            e = (h[bins[0]] + w * prior[bins[0]]) / (t[bins[0]] + w)
            for d in range(1, len(bins)):
                e = (h[bins[d]] + w * e * CHAIN_DECAY ** (mids[d] - mids[d - 1])) / (t[bins[d]] + w)
                assert est[bins[d]].item() == pytest.approx(e.item(), rel=1e-5)


@pytest.mark.parametrize("rate", [0.95, 0.05])
def test_source_correction_follows_a_source_whose_acceptance_jumps(rate):
    """A bin that learnt a source at 0.5 for a long time, then sees it accepted at ``rate``: the
    source correction brings the source's mean estimate to the new rate within a few windows, in
    either direction, while the bin itself still lags; another source and the other mode are not
    moved; with ``source_window 0`` the estimate is the bin's. By default it is on (256 trials)."""
    assert GraftConfig().calibration.source_window == 256
    estimates = {}
    for window in (256.0, 0.0):
        cfg = GraftConfig(num_draft_tokens=6, topk=2, depth=2, calibration={"source_window": window})
        cal = GraftPlanner(cfg, 50).calibrator
        bins = torch.full((8, 2, NUM_MEMBERS), -1)
        node = int(cal.retrieval_bins(torch.tensor([[SOURCE_OUTPUTS]]), torch.tensor([[3]]), torch.zeros(1, 1),
                                      torch.tensor([[8]]), torch.zeros(1, dtype=torch.bool)))
        other = int(cal.retrieval_bins(torch.tensor([[SOURCE_SUFFIX]]), torch.tensor([[3]]), torch.zeros(1, 1),
                                       torch.tensor([[8]]), torch.zeros(1, dtype=torch.bool)))
        bins[:, 1, SOURCE_OUTPUTS] = node
        gen = torch.Generator().manual_seed(0)
        for p, rounds in ((0.5, 400), (rate, 64)):
            for _ in range(rounds):
                on_path = torch.stack([torch.ones(8, dtype=torch.bool), torch.rand(8, generator=gen) < p], dim=1)
                cal.update(bins, on_path, torch.ones(8, 2, dtype=torch.int64), cal.refresh())
        est = cal.refresh()
        estimates[window] = est[node].item()
        base = cal._base[node].item()                           # the bin's own estimate
        if window:
            assert abs(base - rate) > 0.15                      # the bin alone still lags
            assert est[node].item() == pytest.approx(rate, abs=0.05)
            assert est[other] == cal._base[other] and est[cal.layout.per_mode + node] == cal._base[cal.layout.per_mode + node]
        else:
            assert est[node].item() == base
    assert abs(estimates[256.0] - rate) < abs(estimates[0.0] - rate)


def test_source_correction_per_mode_on_sampled_rows_too():
    """By default the source correction covers both modes, each from its own window: the same source
    jumps from 0.5 to 0.95 on sampled rows only; the sampled estimate follows it while its bin lags,
    the greedy estimate of the same bin stays at the greedy rate."""
    cal = GraftPlanner(GraftConfig(num_draft_tokens=6, topk=2, depth=2), 50).calibrator
    node = {mode: int(cal.retrieval_bins(torch.tensor([[SOURCE_OUTPUTS]]), torch.tensor([[3]]), torch.zeros(1, 1),
                                         torch.tensor([[8]]), torch.tensor([mode]))) for mode in (False, True)}
    bins = torch.full((8, 2, NUM_MEMBERS), -1)
    bins[:4, 1, SOURCE_OUTPUTS], bins[4:, 1, SOURCE_OUTPUTS] = node[False], node[True]
    gen = torch.Generator().manual_seed(0)
    for p, rounds in ((0.5, 400), (0.95, 128)):
        for _ in range(rounds):
            rate = torch.tensor([0.5] * 4 + [p] * 4)
            on_path = torch.stack([torch.ones(8, dtype=torch.bool), torch.rand(8, generator=gen) < rate], dim=1)
            cal.update(bins, on_path, torch.ones(8, 2, dtype=torch.int64), cal.refresh())
    est = cal.refresh()
    assert cal._base[node[True]] < 0.85
    assert est[node[True]].item() == pytest.approx(0.95, abs=0.05)
    assert est[node[False]].item() == pytest.approx(0.5, abs=0.08)


def test_agreement_nodes_credit_the_agreement_bins_not_the_draft_bins():
    """A draft node a retrieval source also proposed is an agreement node: its agreement bin (draft
    bin + the agree block's offset, prior sqrt of the draft prior) is credited, its draft bin is not;
    the draft member keeps the draft-only nodes."""
    cfg = GraftConfig(num_draft_tokens=6, topk=2, depth=2, retrieval={"successor": False, "suffix": False,
                                                                        "lookup": False},
                      calibration={"agreement": True})
    assert not GraftConfig(retrieval={"outputs": "off"}).agreement_bins
    assert GraftConfig().agreement_modes == (True, False) and GraftConfig(retrieval={"outputs": True}).agreement_bins
    assert not GraftConfig(retrieval={"outputs": True}, calibration={"agreement": False}).agreement_bins
    planner = GraftPlanner(cfg, 50, max_slots=2)
    cal = planner.calibrator
    lay = cal.layout
    assert lay.offset(SOURCE_AGREE) + lay.draft_bins <= lay.per_mode
    draft_prior = cal.prior[:lay.draft_bins]
    agree_prior = cal.prior[lay.offset(SOURCE_AGREE): lay.offset(SOURCE_AGREE) + lay.draft_bins]
    assert torch.allclose(agree_prior, draft_prior.sqrt())
    draft, roots, host, slots, seq_lens, sampled = dense_inputs(2, 2, 2, 50, 1, "cpu",
                                                                torch.Generator().manual_seed(3))
    best = draft.logq.argmax(dim=1)                       # a depth-1 node: the best draft token
    host.tokens[:, 0] = draft.tokens.gather(1, best[:, None])[:, 0]
    host.anchor_len.fill_(5)                              # seq_len 4 + the root: no re-anchoring gap
    off = GraftPlanner(cfg.model_copy(update={"calibration": cfg.calibration.model_copy(update={"agreement": False})}),
                       50, max_slots=2).build(draft, roots, host, slots, seq_lens, sampled)
    assert not (off.member_bins[:, :, SOURCE_AGREE] >= 0).any()     # off: merged nodes credit the draft bin
    out = planner.build(draft, roots, host, slots, seq_lens, sampled)
    mb = out.member_bins
    agree = mb[:, :, SOURCE_AGREE] >= 0
    assert agree.sum(dim=1).tolist() == [1, 1]            # one agreement node per row
    assert (mb[:, :, SOURCE_DRAFT][agree] == -1).all() and (mb[:, :, SOURCE_SUFFIX][agree] >= 0).all()
    assert ((mb[:, :, SOURCE_DRAFT] >= 0) & ~agree).sum() >= 2   # the other draft nodes keep theirs
    on_path = torch.zeros_like(agree)
    on_path[:, 0] = True
    on_path |= agree
    members, _ = cal.update(mb, on_path, torch.ones_like(mb[:, :, 0]), out.estimates)
    assert members[SOURCE_AGREE].tolist()[0] == 2 and members[SOURCE_AGREE].tolist()[2] == 2
    assert members[SOURCE_DRAFT].tolist()[2] == 0


def test_agreement_priors_follow_what_agreement_has_shown():
    """Agreement nodes accepted far above their ``sqrt(q)`` prior raise the estimate of agreement
    bins never tried by the same ratio (per mode); draft bins and the other mode stay put. (The bins'
    own estimates: the source correction, tested above, is off here.)"""
    cfg = GraftConfig(num_draft_tokens=6, topk=2, depth=2, calibration={"source_window": 0})
    cal = GraftPlanner(cfg, 50).calibrator
    lay = cal.layout
    tried, untried = lay.offset(SOURCE_AGREE) + 5, lay.offset(SOURCE_AGREE) + 8
    before = cal.refresh().clone()                  # the table is refreshed in place
    bins = torch.full((4, 2, NUM_MEMBERS), -1)
    bins[:, 1, SOURCE_AGREE] = tried
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        on_path = torch.stack([torch.ones(4, dtype=torch.bool), torch.rand(4, generator=gen) < 0.9], dim=1)
        cal.update(bins, on_path, torch.ones(4, 2, dtype=torch.int64), cal.refresh())
    after = cal.refresh()
    ratio = (cal.hits[tried] + 1) / (cal.trials[tried] * cal.prior[tried] + 1)
    assert ratio > 2.0
    assert after[untried].item() == pytest.approx(min(cal.prior[untried].item() * ratio.item(), 0.99), rel=1e-4)
    assert after[tried].item() == pytest.approx(0.9, abs=0.06)
    assert after[lay.per_mode + untried] == before[lay.per_mode + untried]   # sampled rows: untouched
    assert torch.equal(after[:lay.draft_bins], before[:lay.draft_bins])      # draft bins: untouched


def test_observe_updates_device_state_and_reports_path_sources():
    cfg = GraftConfig(num_draft_tokens=6, topk=2, depth=2, retrieval={"suffix": False, "max_candidates": 4})
    planner = GraftPlanner(cfg, 50, max_slots=4)
    args = dense_inputs(2, 2, 2, 50, 0, "cpu", torch.Generator().manual_seed(1))
    out = planner.build(*args)
    accept_index = torch.tensor([[0, 1, -1, -1, -1, -1], [6, -1, -1, -1, -1, -1]])
    on_path = on_path_from_accept_index(accept_index, 6)
    assert on_path[0, :2].tolist() == [True, True] and on_path[1].tolist() == [True] + [False] * 5
    topk = torch.arange(2 * 6 * 3).reshape(2, 6, 3) % 50
    committed = torch.tensor([[out.tree.tokens[0, 1].item(), 7, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0]])
    stats = planner.observe(out, on_path, topk, committed, torch.tensor([2, 1]), torch.tensor([1, 3]))
    srcs = stats.sources
    assert srcs[0, 0].item() == out.tree.source[0, 1].item() and (srcs[0, 1:] == -1).all() and (srcs[1] == -1).all()
    assert planner.history.count[[1, 3]].tolist() == [2, 1] and planner.history.tokens[1, -2:].tolist()[1] == 7
    assert stats.members.shape == (2, NUM_MEMBERS, 3) and stats.depths.shape[0] == 2   # per row
    assert stats.members[0, SOURCE_DRAFT, 0] > 0 and stats.members[0, SOURCE_DRAFT, 2] >= 1  # row 0 accepted a node
    assert stats.members[1, :, 2].sum() == 0                                          # row 1 accepted none
    assert stats.depths[0, 1, 0] >= 1 and stats.depths[:, 0].sum() == 0
    t = out.tree.tokens[0, 1].item()
    if (out.tree.tokens == t).sum() == 1:
        assert planner.successor.table[t, :3].tolist() == topk[0, 1].tolist()


# ----------------------------------------------------------------------------- stop gate

@pytest.mark.parametrize("seed,width", [(s, 10) for s in range(6)] + [(s, 5) for s in range(3)])
def test_gate_stop_keeps_the_selection(seed, width):
    """When the gate stops drafting after depth d, the tree built from the truncated draft (deeper
    scores 0) equals the tree built from the full draft, at the full width and at a narrower verify
    width (whose floor, the (width-1)-th best, is at least the full width's); with the gate's
    retrieved candidates reused or not."""
    topk, steps, n, vocab = 3, 5, 10, 40
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=steps, retrieval={"max_candidates": 16})
    planner = GraftPlanner(cfg, vocab, max_slots=4)
    gen = torch.Generator().manual_seed(seed)
    b = 3
    draft, roots, host, slots, seq, _ = dense_inputs(b, topk, steps, vocab, 16, "cpu", gen)
    sampled = torch.zeros(b, dtype=torch.bool)
    host.logp = torch.zeros_like(host.logp)
    host.parents = torch.where(torch.arange(16) == 0, -1, torch.arange(16) - 1).expand(b, 16).clone()
    host.match = torch.full_like(host.match, 40)
    host.anchor_len = seq + 1
    # teach the calibrator that long suffix matches are always right
    planner.calibrator.hits[:-1] = 0.0
    planner.calibrator.trials[:-1] = 0.0
    suffix_bins = planner.calibrator.retrieval_bins(torch.full((1, 16), SOURCE_SUFFIX),
                                                    torch.arange(1, 17)[None], torch.zeros(1, 16),
                                                    torch.full((1, 16), 40), torch.tensor([False]))
    planner.calibrator.hits[suffix_bins.flatten()] = 1000.0
    planner.calibrator.trials[suffix_bins.flatten()] = 1000.0
    planner.calibrator.refresh()                          # counts changed outside `observe`
    gate = planner.stop_gate(roots, host, slots, seq, sampled, num_nodes=width)
    assert gate.floor.min() > 0.9
    assert (gate.floor >= planner.stop_gate(roots, host, slots, seq, sampled).floor).all()
    q = draft.logq.exp()
    bounds = [0, topk] + [topk + i * topk * topk for i in range(1, steps)]
    for d in range(1, steps + 1):
        if gate.observe(d, q[:, bounds[d - 1]:bounds[d]].amax(dim=1)):
            break
    assert gate.stop_depth == 1
    keep = topk + (gate.stop_depth - 1) * topk * topk
    full = planner.build(draft, roots, host, slots, seq, sampled, num_nodes=width)
    draft.logq = torch.where(torch.arange(draft.logq.shape[1]) < keep, draft.logq, -math.inf)
    for retrieved in (None, gate.retrieved):
        cut = planner.build(draft, roots, host, slots, seq, sampled, num_nodes=width, retrieved=retrieved)
        assert torch.equal(full.tree.tokens, cut.tree.tokens) and torch.equal(full.tree.parents, cut.tree.parents)


@pytest.mark.parametrize("seed", range(4))
def test_build_reuses_the_gate_retrieval(seed):
    """A build given the stop gate's `RoundRetrieval` returns the same tree, bins, estimates and gain
    curve as one that computes its own, on warmed state (every retrieval source, per-request
    correction on, greedy and sampled rows, full and narrower widths), in fewer ops."""
    topk, steps, n, vocab, b = 3, 4, 12, 32, 4
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=steps, batch_budget={"widths": [1, 6, n]},
                      retrieval={"max_candidates": 16})
    planner = GraftPlanner(cfg, vocab, max_slots=b)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(b)
    planner.reset_slots(slots, torch.randint(0, 6, (b, 40), generator=gen), torch.full((b,), 40))
    for _ in range(6):   # warm the calibrator, successor table, history and per-request windows
        draft, roots, host, _, seq, sampled = dense_inputs(b, topk, steps, vocab, 16, "cpu", gen)
        out = planner.build(draft, roots, host, slots, seq, sampled)
        on_path = torch.zeros(b, n, dtype=torch.bool)
        on_path[:, 0] = True
        on_path[:, 1] = torch.rand(b, generator=gen) < 0.5
        committed = out.tree.tokens[:, :3]
        planner.observe(out, on_path, torch.randint(0, vocab, (b, n, planner.successor.k), generator=gen),
                        committed, 1 + on_path[:, 1].long(), slots)
    draft, roots, host, _, seq, sampled = dense_inputs(b, topk, steps, vocab, 16, "cpu", gen)
    for width in (n, 6):
        gate = planner.stop_gate(roots, host, slots, seq, sampled, num_nodes=width)
        assert len(gate.retrieved.parts) == 3 and gate.retrieved.factors is not None   # successor, device chains, host
        assert set(gate.retrieved.parts[1].member.unique().tolist()) == {SOURCE_LOOKUP, SOURCE_OUTPUTS}
        own = planner.build(draft, roots, host, slots, seq, sampled, num_nodes=width)
        with OpCounter() as reused_ops:
            reused = planner.build(draft, roots, host, slots, seq, sampled, num_nodes=width,
                                   retrieved=gate.retrieved)
        with OpCounter() as own_ops:
            planner.build(draft, roots, host, slots, seq, sampled, num_nodes=width)
        for a, r in ((own.tree.tokens, reused.tree.tokens), (own.tree.parents, reused.tree.parents),
                     (own.tree.source, reused.tree.source), (own.tree.logp, reused.tree.logp),
                     (own.member_bins, reused.member_bins), (own.gain, reused.gain)):
            assert torch.equal(a, r)
        assert grafted(own.tree.source[:, 1:]).any()   # retrieved nodes were grafted
        assert reused_ops.ops < own_ops.ops


# ----------------------------------------------------------------------------- simulated decoding

class World:
    """A deterministic greedy 'target' over V tokens: the next token is a function of the last two,
    from one of two tables that alternate every 40 positions (so text repeats within a regime and
    retrieval goes stale across regimes), and a 'draft' that knows the target's next token with
    probability ``skill`` (else a random token), with topk - 1 random siblings."""

    def __init__(self, vocab=48, skill=0.6, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.v, self.skill = vocab, skill
        self.tables = [torch.randint(0, vocab, (vocab, vocab), generator=g) for _ in range(2)]
        self.rng = random.Random(seed)

    def next(self, a: int, b: int, pos: int) -> int:
        return int(self.tables[(pos // 40) % 2][a, b])

    def draft_lists(self, ctx_last2, pos, topk, steps):
        """SGLang-layout dense draft lists for one request: [1, S] scores/tokens and parent list."""
        frontier = [(ctx_last2[0], ctx_last2[1], 1.0)]        # (prev, last, cumulative q) per frontier slot
        scores, tokens, parents = [], [], [torch.arange(-1, topk)]
        for step in range(steps):
            cand = []
            for f, (a, b_, q) in enumerate(frontier):
                right = self.next(a, b_, pos + step)
                top = right if self.rng.random() < self.skill else self.rng.randrange(self.v)
                sibs = [top] + self.rng.sample([t for t in range(self.v) if t != top], topk - 1)
                probs = [0.6] + [0.4 / (topk - 1)] * (topk - 1)
                for c, (t, p) in enumerate(zip(sibs, probs)):
                    cand.append((q * p, t, f, c, b_))
            if step == 0:
                cand = cand[:topk]
            scores.append(torch.tensor([c[0] for c in cand]))
            tokens.append(torch.tensor([c[1] for c in cand]))
            if step == 0:   # SGLang: the root's children are the next frontier, in order
                best = list(range(topk))
            else:           # the top-k cumulative scores, best first, as torch.topk orders them
                best = sorted(range(len(cand)), key=lambda i: -cand[i][0])[:topk]
                parents.append(torch.tensor([topk + topk * topk * (step - 1) + i for i in best]))
            frontier = [(cand[i][4], cand[i][1], cand[i][0]) for i in best]
        plist = torch.cat(parents[: steps - 1]) if steps > 1 else torch.empty(0, dtype=torch.int64)
        return torch.cat(scores)[None], torch.cat(tokens)[None], plist[None]


def simulate(cfg: GraftConfig, skill: float, rounds=60, reqs=3, seed=0) -> tuple[float, bool]:
    """Greedy decoding of ``reqs`` requests with the planner; returns (tau, outputs == target)."""
    world = World(skill=skill, seed=seed)
    planner = GraftPlanner(cfg, world.v, max_batch=reqs, max_slots=reqs)
    rng = random.Random(seed + 1)
    ctx = [[rng.randrange(world.v) for _ in range(3)] for _ in range(reqs)]
    for r in range(reqs):   # prompt then the first target token (as after prefill)
        ctx[r].append(world.next(ctx[r][-2], ctx[r][-1], len(ctx[r])))
        planner.start_request(r, ctx[r])
        planner.history.reset(torch.tensor([r]), torch.tensor([ctx[r]]), torch.tensor([len(ctx[r])]))
    emitted = steps_ = 0
    ok = True
    for _ in range(rounds):
        lists = [world.draft_lists(c[-2:], len(c), cfg.topk, cfg.depth) for c in ctx]
        sc, tk, pl = (torch.cat([x[i] for x in lists]) for i in range(3))
        draft = dense_draft_candidates(sc, tk, pl, cfg.topk, cfg.depth)
        host = planner.host_candidates(list(range(reqs)))
        roots = torch.tensor([c[-1] for c in ctx])
        seq = torch.tensor([len(c) - 1 for c in ctx])
        out = planner.build(draft, roots, host, torch.arange(reqs), seq, torch.zeros(reqs, dtype=torch.bool))
        tree = out.tree
        validate_parents(tree.parents)
        assert not has_duplicate_siblings(tree.tokens, tree.parents).any()
        # target argmax after every node: its path context
        n = tree.tokens.shape[1]
        target = torch.zeros(reqs, n, dtype=torch.int64)
        for r in range(reqs):
            toks, pars = tree.tokens[r].tolist(), tree.parents[r].tolist()
            for i in range(n):
                path, j = [], i
                while j >= 0:
                    path.append(toks[j])
                    j = pars[j]
                full = ctx[r][:-1] + path[::-1]
                target[r, i] = world.next(full[-2], full[-1], len(full))
        res = greedy_verify(tree.tokens, tree.parents, target, tree.source)
        on_path = res.accept_index >= 0
        on = torch.zeros(reqs, n, dtype=torch.bool)
        on.scatter_(1, res.accept_index.clamp(min=0), on_path)
        committed = torch.zeros(reqs, n, dtype=torch.int64)
        lens = res.accept_length
        topk_ids = target[:, :, None].expand(reqs, n, cfg.retrieval.successor_k).clone()
        for r in range(reqs):
            path = res.accept_index[r][res.accept_index[r] >= 0].tolist()
            new = [int(tree.tokens[r, i]) for i in path[1:]] + [int(res.bonus[r])]
            for t in new:   # lossless: the emitted tokens are the target's greedy continuation
                ok &= t == world.next(ctx[r][-2], ctx[r][-1], len(ctx[r]))
                ctx[r].append(t)
            committed[r, : len(new)] = torch.tensor(new)
            planner.extend(r, new)
            emitted += len(new)
            steps_ += 1
        planner.observe(out, on, topk_ids, committed, lens, torch.arange(reqs))
    return emitted / steps_, ok


@pytest.mark.parametrize("skill", [0.3, 0.8])
def test_simulated_graft_is_lossless_and_not_worse_than_its_parts(skill):
    """Default config (no checkpoints, no tuning): tau(graft) >= max(draft-only, retrieval-only) - 3%."""
    base = dict(num_draft_tokens=12, topk=3, depth=4)
    taus = {}
    for name, extra in {"graft": {}, "draft_only": {"retrieval": {"successor": False, "suffix": False, "lookup": False,
                                                                 "outputs": False}},
                        "retrieval_only": {"draft_nodes": False}}.items():
        tau, ok = simulate(GraftConfig(**base, **extra), skill, rounds=50)
        assert ok, f"{name}: emitted tokens differ from the target's greedy continuation"
        taus[name] = tau
    assert taus["graft"] >= 0.97 * max(taus["draft_only"], taus["retrieval_only"]), taus
    assert taus["graft"] > 1.0


# ----------------------------------------------------------------------------- tenant isolation

@pytest.mark.parametrize("isolation, leaks", [("shared", True), ("tenant", False), ("request", False)])
def test_isolation_keeps_one_tenants_text_from_anothers_tree(isolation, leaks):
    """Tenant A's verified text teaches the successor table; with ``shared`` tenant B's tree then
    proposes A's continuation (B's acceptance timing depends on A's traffic), with ``tenant`` or
    ``request`` it does not."""
    cfg = GraftConfig(num_draft_tokens=8, topk=2, depth=3, draft_nodes=False,
                      retrieval={"suffix": False, "lookup": False, "isolation": isolation, "max_tenants": 4})
    planner = GraftPlanner(cfg, 100, max_batch=2, max_slots=4)
    planner.start_request("a", [1, 2], tenant="A")
    planner.start_request("b", [1, 2], tenant="B")
    # A's round: root 10 was verified, the target's top-k after it starts with 77 (A's secret)
    out = planner.build(dense_inputs(1, 2, 3, 100, 0, "cpu", torch.Generator().manual_seed(0))[0],
                        torch.tensor([10]), planner.host_candidates(["a"]), torch.tensor([0]), torch.tensor([5]),
                        torch.tensor([False]))
    topk = torch.full((1, 8, 8), 5)
    topk[0, 0, 0] = 77
    planner.observe(out, torch.ones(1, 8, dtype=torch.bool), topk, torch.zeros(1, 8, dtype=torch.int64),
                    torch.tensor([1]), torch.tensor([0]))
    # B's round with the same root
    out_b = planner.build(dense_inputs(1, 2, 3, 100, 0, "cpu", torch.Generator().manual_seed(1))[0],
                          torch.tensor([10]), planner.host_candidates(["b"]), torch.tensor([1]), torch.tensor([5]),
                          torch.tensor([False]))
    assert (77 in out_b.tree.tokens[0].tolist()) is leaks
    # and A still sees its own continuation
    out_a = planner.build(dense_inputs(1, 2, 3, 100, 0, "cpu", torch.Generator().manual_seed(2))[0],
                          torch.tensor([10]), planner.host_candidates(["a"]), torch.tensor([0]), torch.tensor([5]),
                          torch.tensor([False]))
    assert 77 in out_a.tree.tokens[0].tolist()


def test_a_key_that_finds_every_group_held_gets_private_state():
    """max_tenants 1: while A runs, B's requests get `PRIVATE_GROUP`: its tree proposes nothing A's
    traffic taught the successor table, its own verified rounds teach the table nothing, and A's
    group is not handed over (A still proposes its continuation). Once A stops, a new key takes the
    group, reset."""
    from graft_spec.pipeline import PRIVATE_GROUP

    cfg = GraftConfig(num_draft_tokens=8, topk=2, depth=3, draft_nodes=False,
                      retrieval={"suffix": False, "lookup": False, "isolation": "tenant", "max_tenants": 1})
    planner = GraftPlanner(cfg, 100, max_batch=2, max_slots=4)
    planner.start_request("a", [1, 2], tenant="A")
    planner.start_request("b", [1, 2], tenant="B")
    assert planner.group_of("a") == 0 and planner.group_of("b") == PRIVATE_GROUP

    def round_of(rid, slot, teach):
        out = planner.build(dense_inputs(1, 2, 3, 100, 0, "cpu", torch.Generator().manual_seed(slot))[0],
                            torch.tensor([10]), planner.host_candidates([rid]), torch.tensor([slot]),
                            torch.tensor([5]), torch.tensor([False]))
        if teach is not None:
            topk = torch.full((1, 8, 8), 5)
            topk[0, 0, 0] = teach
            planner.observe(out, torch.ones(1, 8, dtype=torch.bool), topk, torch.zeros(1, 8, dtype=torch.int64),
                            torch.tensor([1]), torch.tensor([slot]))
        return out.tree.tokens[0].tolist()

    table = planner.successor.table.clone()
    round_of("b", 1, 66)                               # B verifies a round: the table learns nothing
    assert torch.equal(planner.successor.table, table)
    round_of("a", 0, 77)                               # A's secret
    assert 77 not in round_of("b", 1, None) and 77 in round_of("a", 0, None)
    planner.stop_request("a")
    planner.stop_request("b")
    planner.start_request("c", [1, 2], tenant="C")
    assert planner.group_of("c") == 0 and 77 not in round_of("c", 2, None)   # handed over, reset
    assert planner.state_counts()["keys_held"] == 1


def test_group_map_hands_over_idle_groups_only():
    """A key keeps its group while a request of it runs; a new key takes a free group, else the
    least recently used idle one (fresh), else `PRIVATE_GROUP`; request-id keys free theirs."""
    from graft_spec.pipeline import PRIVATE_GROUP, GroupMap

    m = GroupMap(2)
    assert m.acquire("x") == (0, True) and m.acquire("y") == (1, True) and m.acquire("x") == (0, False)
    assert m.acquire("z") == (PRIVATE_GROUP, False)   # x (twice) and y are running: nothing handed over
    m.release("y")
    assert m.acquire("z") == (1, True)                 # y is idle now: its group goes to z, reset
    m.release("x")
    assert m.acquire("w") == (PRIVATE_GROUP, False)   # x still has one request running
    m.release("x")
    assert m.acquire("w") == (0, True) and m.held() == 2
    assert m.acquire("y") == (PRIVATE_GROUP, False)   # y's old group went to z
    m.release("z", forget=True)
    assert m.acquire("v") == (1, True)                 # a forgotten key's group is free at once


@pytest.mark.parametrize("topk,steps", [(1, 1), (4, 1), (4, 4), (10, 7), (3, 5)])
def test_dense_draft_candidates_follow_the_eagle_parent_rule(topk, steps):
    """Index g has tb = g // topk: tb == 0 -> child of the root (whatever parent_list[:, 0] holds),
    else the node parent_list[tb]; depth 1 for the first topk, then one level per topk**2 (eagle.cuh)."""
    gen = torch.Generator().manual_seed(topk * 100 + steps)
    b, s, w = 3, topk + (steps - 1) * topk * topk, 1 + topk * (steps - 1)
    scores = torch.rand(b, s, generator=gen)
    scores[0, -1] = 0.0
    scores[1, 0] = float("nan")
    tokens = torch.randint(0, 1000, (b, s), generator=gen)
    parent_list = torch.randint(0, max(s, 1), (b, w if steps > 1 else 0), generator=gen)
    d = dense_draft_candidates(scores, tokens, parent_list, topk, steps)
    for r in range(b):
        for g in range(s):
            tb = g // topk
            assert d.parents[r, g] == (-1 if tb == 0 else parent_list[r, tb])
            assert d.depth[r, g] == (1 if g < topk else 2 + (g - topk) // (topk * topk))
    expect = torch.log(scores)
    expect[(scores == 0) | torch.isnan(scores)] = -math.inf   # an undrafted node
    assert torch.equal(d.logq, expect) and torch.equal(d.tokens, tokens)
    if steps > 1:
        with pytest.raises(ValueError, match="parent_list has"):
            dense_draft_candidates(scores, tokens, parent_list[:, :-1], topk, steps)
    else:   # the SGLang worker's sink keeps one (unused) column at one step
        one = dense_draft_candidates(scores, tokens, torch.full((b, 1), 7), topk, steps)
        assert torch.equal(one.parents, d.parents) and (one.parents == -1).all()
