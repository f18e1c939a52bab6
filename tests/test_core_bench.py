"""bench_core runs end to end and writes its JSON (a smoke test: no timing assertions)."""

import json

from graft_spec import bench_core


def test_bench_core_writes_json(tmp_path):
    out = tmp_path / "core.json"
    assert bench_core.main(["--json", str(out), "--batches", "1,3", "--nodes", "24,16",
                            "--steps", "2", "--vocab", "2000"]) == 0
    data = json.loads(out.read_text())
    assert [(r["batch"], r["num_draft_tokens"]) for r in data["results"]] == [(1, 24), (3, 24), (1, 16), (3, 16)]
    for r in data["results"]:
        assert r["plan_us"] > 0 and r["extend_us"] >= 0 and r["derive_us"] > 0
        assert sum(r["stage_hist"].values()) == 2 * r["batch"]
