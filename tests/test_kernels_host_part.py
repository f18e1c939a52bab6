"""The fused host-proposal op ``graft::host_part`` (graft_spec/kernels/host_part.py): its reference is
``GraftStep._host_part`` (graft_spec/step.py) bit for bit, the kernel equals the reference under
Triton's interpreter, and the op is one op to the dispatcher and traceable.

The kernel comparisons run in a subprocess under ``TRITON_INTERPRET=1`` (Triton must see the switch
before it is imported): tests/interpret/test_host_part_interpreted.py, whose case builder
(`host_case`) the CPU tests here share.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graft_spec.kernels.host_part import host_part, host_part_reference
from graft_spec.retrieval.buffer import HostCandidates
from interpret.test_host_part_interpreted import NAMES, case_args, host_case, planner

ROOT = Path(__file__).resolve().parents[1]


def test_host_part_kernel_equals_its_reference_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "interpret" / "test_host_part_interpreted.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail


def _host(case: dict) -> HostCandidates:
    b = case["tokens"].shape[0]
    return HostCandidates(case["tokens"], case["parents"], case["logp"], case["member"], case["match"],
                          case["anchor_len"], torch.zeros(b, dtype=torch.int64))


def _assert_same(step_part, ref) -> None:
    """A `Candidates` block of ``GraftStep._host_part`` against the reference's six tensors."""
    for name, r in zip(NAMES, ref):
        s = getattr(step_part, name)
        assert s.dtype == r.dtype and s.shape == r.shape, name
        if r.dtype == torch.float32:
            s, r = s.view(torch.int32), r.view(torch.int32)
        assert torch.equal(s, r), name


def _step_and_reference(case: dict, corrected: bool):
    """``GraftStep._host_part`` of a `host_case` (``factors`` None, or the case's correction) and the
    reference (with the identity correction when uncorrected)."""
    step = planner().step
    factors = (case["scale"], case["under"]) if corrected else None
    part = step._host_part(_host(case), case["hist"], case["count"], case["seq_lens"], case["sampled"],
                           case["est_table"], factors)
    if not corrected:
        case = dict(case, scale=torch.ones_like(case["scale"]), under=torch.zeros_like(case["under"]))
    return part, host_part_reference(*case_args(case))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("corrected", [False, True])
def test_reference_is_the_steps_host_part(seed, corrected):
    """`host_part_reference` = ``GraftStep._host_part`` on every case kind (gaps, mismatches, cycles,
    NaN, invalid members), uncorrected (``factors=None``: the identity correction gives the same
    estimates bit for bit) and corrected."""
    b, m = (1, 3, 16, 64, 4, 2)[seed], (1, 7, 24, 8, 64, 128)[seed]
    part, ref = _step_and_reference(host_case(seed, b, m, (8, 32, 256)[seed % 3]), corrected)
    _assert_same(part, ref)
    assert ref[3].any() or b < 16                                  # the cases are not all dropped


def test_identity_correction_is_no_correction():
    """``apply_correction(est, 1, False)`` is ``est`` bit for bit on every float32 of [0, 1] the table can
    hold: the op with the identity equals the uncorrected step."""
    from graft_spec.calibration import apply_correction

    est = torch.cat([torch.rand(100000), torch.tensor([0.0, 1.0, 1e-45, 1e-38, 0.5, 1 - 2 ** -24])])
    out = apply_correction(est, torch.ones(()), torch.zeros((), dtype=torch.bool))
    assert torch.equal(out.view(torch.int32), est.view(torch.int32))


def test_reference_is_the_steps_host_part_on_a_planners_buffer():
    """Real host proposals (the suffix source through `GraftPlanner.host_candidates`: non-contiguous
    views of one upload, an unknown request's empty row) against slot histories that committed more
    tokens since: the proposed continuation (gap 2, matching), other tokens (gap 2, mismatching), none
    (gap 0), more than the history holds; with and without the request correction."""
    from graft_spec.config import GraftConfig
    from graft_spec.pipeline import GraftPlanner

    cfg = GraftConfig(num_draft_tokens=8, topk=2, depth=3, draft_nodes=False,
                      retrieval={"successor": False, "lookup": False, "max_candidates": 16})
    pl = GraftPlanner(cfg, 100, max_slots=6)
    ctx = [1, 2, 3, 4, 5, 6, 1, 2]
    for rid in ("match", "miss", "same", "short"):
        pl.start_request(rid, ctx)                                # the host knows ... 1 2
    host = pl.host_candidates(["match", "miss", "same", "short", "unknown"])
    assert host.anchor_len.tolist()[:4] == [8] * 4 and not host.tokens.is_contiguous()
    rows = [ctx + [3, 4], ctx + [7, 7], ctx + [0, 0], ctx + [3, 4]]
    lens = torch.tensor([10, 10, 8, 10, 3])
    pl.history.reset(torch.arange(4), torch.tensor(rows), lens[:4])
    pl.history.reset(torch.tensor([4, 5]), torch.tensor([[1, 2, 3] + [0] * 7] * 2), torch.tensor([3, 1]))
    slots = torch.tensor([0, 1, 2, 5, 4])                           # "short": a one-token history
    hist, count = pl.history.gather(slots)
    seq = lens - 1
    sampled = torch.tensor([False, True, False, True, False])
    g = torch.Generator().manual_seed(3)
    cal = pl.calibrator
    table = torch.rand(cal.table.numel(), generator=g)
    scale, under = torch.rand(5, cal.member_stats.shape[0], generator=g), torch.rand(5, 7, generator=g) < 0.5
    for factors in (None, (scale, under)):
        part = pl.step._host_part(host, hist, count, seq, sampled, table, factors)
        sc, un = factors if factors is not None else cal.identity(5)
        ref = host_part_reference(host.tokens, host.parents, host.logp, host.match, host.member, host.anchor_len,
                                  hist, count, seq, sampled, table, sc, un, cal._retrieval_base, cal.logp_edges,
                                  cal.depth_edges, cal.match_edges, cal.layout.per_mode)
        _assert_same(part, ref)
        valid = ref[3]
        assert valid[0].any() and not valid[1].any() and valid[2].any() and not valid[3:].any()


def test_host_part_is_one_op_inside_fused_ops_everywhere():
    """Inside `fused_ops_everywhere`, `host_part` on CPU is the one op ``graft::host_part`` (its
    implementation: the reference), with the reference's results; outside it, the reference's ops."""
    from graft_spec.kernels import fused_ops_everywhere
    from sglang_patch.bench.step import OpCounter

    args = case_args(host_case(7, 3, 24))
    ref = host_part_reference(*args)
    with fused_ops_everywhere(), OpCounter() as c:
        fused = host_part(*args)
    assert c.ops == 1 and c.names == {"host_part": 1}
    assert fused[0] is args[0] and fused[5] is args[4]              # tokens and members pass through
    assert all(torch.equal(a, r) for a, r in zip(fused, ref))
    with OpCounter() as c:
        host_part(*args)
    assert c.ops > 1                                                # CPU: the reference's own ops


def test_host_part_op_traces():
    """The op's fake implementation gives the real shapes and dtypes: ``make_fx`` records one call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft_spec.kernels import fused_ops_everywhere

    args = case_args(host_case(8, 2, 16))
    tensors, per_mode = args[:-1], args[-1]

    def fn(*ts):
        return host_part(*ts, per_mode)

    with fused_ops_everywhere():
        gm = make_fx(fn, tracing_mode="fake")(*tensors)
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "graft" in str(n.target)]
    assert calls == ["graft.host_part.default"]
    out = gm(*tensors)
    ref = host_part_reference(*args)
    assert all(a.dtype == r.dtype and torch.equal(a, r) for a, r in zip(out, ref))


def test_host_part_calls_the_reference_when_switched_off(monkeypatch):
    from graft_spec.kernels import fused_ops_everywhere, layout
    from sglang_patch.bench.step import OpCounter

    monkeypatch.setenv(layout.REFERENCE_ENV, "1")
    with fused_ops_everywhere(), OpCounter() as c:
        host_part(*case_args(host_case(9, 2, 8)))
    assert c.ops > 1
