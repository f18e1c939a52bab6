"""The fused kernels (graft_spec/kernels/) against their torch references, and how the step uses them.

The bit-for-bit comparisons run in a subprocess under ``TRITON_INTERPRET=1`` (Triton must see the
switch before it is imported; this session's Triton was imported by SGLang already):
tests/interpret/test_*_interpreted.py, one file per group of kernels, started in the background at
collection (tests/kernel_checks.py) with the sm_90 compile of their launches after them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def interpreted():
    """The interpreter run over every tests/interpret file (tests/kernel_checks.py, started in the
    background at collection): ``(completed run, output tail, path of the recorded kernel launches)``
    (tests/kernel_launches.py)."""
    pytest.importorskip("triton")
    import kernel_checks

    results, out = kernel_checks.results()
    r = results["interpreter"]
    run = SimpleNamespace(returncode=r["returncode"], stdout=r["stdout"], stderr=r["stderr"],
                          compiled=results["compile"])
    return run, run.stdout[-3000:] + run.stderr[-2000:], out / "launches.json"


def test_fused_kernels_equal_their_references_under_the_interpreter(interpreted):
    run, tail, _ = interpreted
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail


def test_every_fused_launcher_is_its_one_kernel_launch(interpreted):
    """Each fused op's CUDA launcher issues no torch op besides its Triton launch (casts, copies of
    strided views and post-processing would each be one more kernel on a GPU), and launches exactly
    one kernel per call: counted over every call of the interpreted tests (tests/launcher_ops.py)."""
    from launcher_ops import LAUNCHERS

    _, tail, launches = interpreted
    ops = launches.parent / "ops.json"
    assert ops.exists(), tail
    record = json.loads(ops.read_text())
    assert sorted(record) == sorted(LAUNCHERS), tail                 # every launcher was exercised
    extra = {k: (v["extra_ops"], v["names"]) for k, v in record.items() if v["extra_ops"]}
    assert not extra, extra
    assert {k: v["launches"] for k, v in record.items() if v["launches"] != 1} == {}


def test_every_interpreted_kernel_compiles_for_a_cuda_gpu(interpreted):
    """Each distinct launch of the interpreted tests (kernel, argument types, flags, block sizes) is
    compiled for ``sm_90`` down to a cubin (Triton's own compiler and ptxas, no GPU needed) and spills
    at most `kernel_launches.MAX_SPILL_BYTES` per thread: the interpreter never lowers a kernel, so
    this is what says the tested code is code a GPU can run, and run from registers."""
    pytest.importorskip("triton.backends.nvidia")
    interp, tail, launches = interpreted
    assert launches.exists(), tail
    run = interp.compiled
    assert run is not None, tail
    assert run["returncode"] == 0, run["stdout"][-4000:] + run["stderr"][-2000:]
    run = SimpleNamespace(**run)
    assert "compiled for sm_90" in run.stdout, run.stdout
    for kernel in ("_tree_sample_kernel", "_select_kernel", "_tree_attention_kernel"):
        assert kernel in run.stdout, run.stdout


def test_layout_op_is_one_dispatch_and_the_reference_on_cpu():
    """``graft::tree_layout`` is one op to the dispatcher (the step's op counter counts one launch)
    and computes the reference on CPU; `tree_layout` on CPU tensors calls the reference directly."""
    from graft_spec.kernels import layout
    from sglang_patch.bench.step import OpCounter

    parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 0, 3, 3]])
    seq = torch.tensor([7, 11])
    with OpCounter() as c:
        fused = torch.ops.graft.tree_layout(parents, seq)
    assert c.ops == 1
    ref = layout.layout_reference(parents, seq)
    assert all(torch.equal(a, r) for a, r in zip(fused, ref))
    with OpCounter() as c:
        layout.tree_layout(parents, seq)
    assert c.ops > 1                                    # CPU: the reference's own ops, counted as they run


def test_reference_switch(monkeypatch):
    from graft_spec.kernels import dispatch as layout

    monkeypatch.setenv(layout.REFERENCE_ENV, "1")
    assert not layout.fused_enabled()
    monkeypatch.setenv(layout.REFERENCE_ENV, "0")
    assert layout.fused_enabled() == (layout.triton is not None)


def test_start_up_fallback_switches_to_the_references(monkeypatch):
    """`use_reference_kernels` (what the SGLang worker calls when the fused step fails to compile or
    capture at start-up) turns the fused ops off for the process and names the cause."""
    from graft_spec.kernels import dispatch as layout

    monkeypatch.setenv(layout.REFERENCE_ENV, "0")
    monkeypatch.setattr(layout, "_FALLBACK", [None])
    assert layout.kernel_path() == ("fused" if layout.triton is not None else "reference")
    layout.use_reference_kernels("CompilationError: out of resources")
    assert not layout.fused_enabled()
    assert not layout.fused_kernels_for(torch.zeros(1))
    with layout.fused_ops_everywhere():
        assert not layout.fused_kernels_for(torch.zeros(1))
    assert layout.kernel_path() == "reference (fallback: CompilationError: out of resources)"


def test_observe_is_three_launches_inside_fused_ops_everywhere():
    """`GraftPlanner.observe` on the fused path: the observe kernel, the successor update and the
    table refresh, plus the metrics' two row sums and two adds (the op counter of
    ``sglang_patch.bench.step`` counts each custom op as one launch); on CPU each op runs its
    reference, so both paths leave the same state."""
    from graft_spec.config import GraftConfig
    from graft_spec.kernels import fused_ops_everywhere
    from graft_spec.pipeline import GraftPlanner, dense_draft_candidates, on_path_from_accept_index
    from sglang_patch.bench.step import OpCounter

    torch.manual_seed(0)
    planners = [GraftPlanner(GraftConfig(), 300, max_slots=4) for _ in range(2)]
    b, s = 3, 30
    draft = dict(scores=torch.rand(b, s), tokens=torch.randint(0, 300, (b, s)))
    roots, slots, seq = torch.randint(0, 300, (b,)), torch.tensor([2, 0, 1]), torch.tensor([40, 41, 42])
    accept = torch.full((b, 24), -1)
    accept[:, 0] = torch.arange(b) * 24
    accept[:, 1] = torch.arange(b) * 24 + 1
    topk = torch.randint(0, 300, (b, 24, 8))
    committed = torch.randint(0, 300, (b, 24))
    lens = torch.tensor([2, 2, 2])
    ops, stats = [], []
    for fused, planner in zip((False, True), planners):
        cands = dense_draft_candidates(draft["scores"], draft["tokens"], torch.zeros(b, 30, dtype=torch.int64), 1, 30)
        out = planner.build(cands, roots, planner.host_candidates(["a", "b", "c"]), slots, seq,
                            torch.zeros(b, dtype=torch.bool))
        on_path = on_path_from_accept_index(accept, 24)
        with OpCounter() as c:
            if fused:
                with fused_ops_everywhere():
                    st = planner.observe(out, on_path, topk, committed, lens, slots)
            else:
                st = planner.observe(out, on_path, topk, committed, lens, slots)
        ops.append(c.ops)
        names = c.names
        stats.append(st)
    assert ops[1] <= 10 < ops[0], str(names)
    a, f = planners
    for x, y in ((a.calibrator.trials, f.calibrator.trials), (a.calibrator.table, f.calibrator.table),
                 (a.calibrator.recent, f.calibrator.recent), (a.successor.table, f.successor.table),
                 (a.history.tokens, f.history.tokens), (a.request_correction.recent, f.request_correction.recent)):
        assert torch.equal(x, y)
    for name in ("sources", "members", "depths", "expected"):
        assert torch.equal(getattr(stats[0], name), getattr(stats[1], name)), name


def test_verify_mask_op_is_one_dispatch_and_the_reference_on_cpu():
    """``graft::write_verify_mask`` (sglang_patch/tree_mask.py) is one op that writes the reference's
    cells in place; on CPU tensors `write_verify_mask` runs the reference (a fill and the scatter),
    inside `fused_ops_everywhere` the op."""
    from graft_spec.pipeline import fused_ops_everywhere
    from sglang_patch.bench.step import OpCounter
    from sglang_patch.tree_mask import FULL_MASK, write_tree_mask, write_verify_mask

    mask = torch.rand(3, 5, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    seq = torch.tensor([4, 0, 9])
    numel = int((seq * 5 + 25).sum())
    expect = torch.ones(numel, dtype=torch.bool)
    write_tree_mask(expect, mask, seq, FULL_MASK)
    for everywhere, ops in ((True, 1), (False, None)):
        out = torch.zeros(numel, dtype=torch.bool)
        with fused_ops_everywhere() if everywhere else contextlib.nullcontext(), OpCounter() as c:
            write_verify_mask(out, mask, seq, FULL_MASK, True)
        assert torch.equal(out, expect)
        assert c.ops == ops if ops is not None else c.ops > 1
    with pytest.raises(ValueError, match="unknown tree mask mode"):
        write_verify_mask(torch.zeros(4, dtype=torch.bool), mask, seq, 7, False)


def test_dense_draft_part_is_one_op_and_the_converted_draft_on_cpu():
    """The dense draft op: one dispatch inside `fused_ops_everywhere`; its reference equals
    `draft_part_reference` of the converted draft (`dense_draft_candidates`), and a planner built
    from the `DenseDraft` gives the tree of the converted one."""
    from graft_spec.config import GraftConfig
    from graft_spec.kernels import fused_ops_everywhere
    from graft_spec.kernels.draft_part import dense_draft_part, draft_part_reference
    from graft_spec.kernels.views import DraftOptions
    from graft_spec.pipeline import GraftPlanner
    from graft_spec.step import dense_draft_candidates, dense_logq
    from sglang_patch.bench.step import OpCounter
    from test_core_step import SHAPES, dense_inputs

    topk, steps = SHAPES[24]
    planner = GraftPlanner(GraftConfig(num_draft_tokens=24, topk=topk, depth=steps), 500, max_slots=3)
    planner.ensure_slots(3)
    inputs = dense_inputs(3, topk, steps, 500, 16, "cpu", torch.Generator().manual_seed(3), unconverted=True)
    dense, roots, sampled = inputs[0], inputs[1], inputs[-1]
    cal = planner.calibrator
    rest = (roots, sampled, cal.draft_view(cal.table), DraftOptions(24, True, False))
    logq = dense_logq(dense.scores)
    with fused_ops_everywhere(), OpCounter() as c:
        got = dense_draft_part(dense.tokens, dense.parent_list, logq, topk, *rest)
    assert c.ops == 1 and c.names == {"dense_draft_part": 1}
    conv = dense_draft_candidates(dense.scores, dense.tokens, dense.parent_list, topk, steps)
    want = draft_part_reference(conv, *rest)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    x, y = planner.build(*inputs), planner.build(conv, *inputs[1:])
    for a, b in [(x.tree.tokens, y.tree.tokens), (x.tree.parents, y.tree.parents), (x.member_bins, y.member_bins)]:
        assert torch.equal(a, b)

