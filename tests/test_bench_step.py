"""The step benchmark (sglang_patch/bench/step.py) runs end to end, writes its JSON with both
methods side by side, and its counters count what they claim (no timing assertions)."""

import json

import torch

from sglang_patch.bench import step as bench_step


def test_step_bench_writes_graft_and_eagle_rows(tmp_path):
    out = tmp_path / "step.json"
    assert bench_step.main(["--json", str(out), "--batches", "1,3", "--nodes", "24", "--rounds", "2",
                            "--vocab", "2000"]) == 0
    data = json.loads(out.read_text())
    rows = {(r["method"], r["batch"]) for r in data["rows"]}
    assert rows == {(m, b) for m in ("graft", "graft_fused", "eagle") for b in (1, 3)}
    for r in data["rows"]:
        assert r["ops_per_round"] > 0 and r["host_us_per_round"] > 0
        if r["method"] in ("graft", "graft_fused"):
            assert r["syncs_per_round"] == 0 and r["observe_syncs_per_round"] == 0
            assert r["host_to_device_copies_per_round"] == 1
    by = {(r["method"], r["batch"]): r["ops_per_round"] for r in data["rows"]}
    for b in (1, 3):   # each fused kernel replaces its reference's ops by one launch
        assert by[("graft_fused", b)] < by[("graft", b)]
    assert {(r["batch"], r["num_draft_tokens"]) for r in data["ratios"]} == {(1, 24), (3, 24)}


def test_step_bench_eager_gate_rows(tmp_path):
    """``--eager-gate``: the gated round with the gate's retrieval shared runs fewer ops than with the
    build pricing it again, with no host read either way."""
    out = tmp_path / "step.json"
    assert bench_step.main(["--json", str(out), "--batches", "2", "--nodes", "24", "--rounds", "2",
                            "--vocab", "2000", "--eager-gate"]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    shared, unshared = rows["graft_eager_gated"], rows["graft_eager_gated_unshared"]
    assert shared["syncs_per_round"] == 0 and unshared["syncs_per_round"] == 0
    assert shared["ops_per_round"] < unshared["ops_per_round"]
    assert shared["ops_per_round"] > rows["graft"]["ops_per_round"]   # the gate's own work remains


def test_op_counter_counts_kernels_and_syncs():
    x = torch.arange(6).reshape(2, 3)
    with bench_step.OpCounter() as c:
        y = x.view(3, 2).t()          # views: no kernel
        z = (y + 1).sum()             # two kernels
        z.item()                      # one host read
        with c.as_one_op():
            torch.ones(3).cumsum(0).max()
    assert c.ops == 4 and c.syncs == 1


def test_step_bench_ops_by_function(tmp_path):
    """``--by-function``: the graft row's ops per graft_spec function, inclusive of callees: the build
    holds at most the round's ops, and its parts (merge / select, retrieval) at most the build's."""
    out = tmp_path / "step.json"
    assert bench_step.main(["--json", str(out), "--batches", "2", "--nodes", "24", "--rounds", "2",
                            "--vocab", "2000", "--by-function"]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert "ops_by_function" not in rows["eagle"]
    graft = rows["graft"]
    by = graft["ops_by_function"]
    build = by["pipeline.py:build"]
    assert 0.9 * graft["ops_per_round"] <= build <= graft["ops_per_round"]
    assert 0 < by["merge.py:merge_select"] < build and 0 < by["step.py:retrieve"] < build
    assert by["tree.py:path_min"] < by["pipeline.py:build"]


def test_op_counter_attributes_ops_to_graft_spec_functions():
    from graft_spec.tree import node_depths

    parents = torch.tensor([[-1, 0, 1, 1]])
    with bench_step.OpCounter(by_function=True) as c:
        node_depths(parents)
        parents + 1                   # outside graft_spec: counted, not attributed
    assert c.functions["tree.py:node_depths"] == c.ops - 1
    assert c.functions["tree.py:pointer_jumps"] < c.functions["tree.py:node_depths"]
