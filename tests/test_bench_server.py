"""The server benchmark (``python -m sglang_patch.bench``) end to end on the quick models, with
``--interleave``: every method's server up at once, each run sent to all of them back to back; a run
that repeats a prompt set starts with ``/flush_cache`` and the set's warm-up; greedy outputs are
checked against no-spec's once every server has run."""

from __future__ import annotations

import json
from pathlib import Path

from sglang_patch.bench.__main__ import main


def test_interleaved_bench_flushes_repeats_and_checks_outputs(quick_models, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["--target", str(quick_models.target), "--draft", str(quick_models.draft), "--topk", "4",
               "--depth", "5", "--budgets", "24", "--num-prompts", "3", "--warmup-prompts", "1",
               "--max-tokens", "8", "--modes", "greedy", "--concurrency", "1", "2",
               "--prompt-sets", f"code={Path(__file__).parents[1] / 'data' / 'humaneval_dev.jsonl'}", "--methods", "nospec", "graft_fixed",
               "--interleave", "--json", str(out)])
    data = json.loads(out.read_text())
    rows = {(r["label"], r["concurrency"]): r for r in data["rows"]}
    assert rc == 0 and data["mismatches"] == [] and data["args"]["interleave"] is True
    assert set(rows) == {(label, c) for label in ("nospec", "graft_fixed_n24") for c in (1, 2)}
    assert [rows[(label, c)]["flushed"] for label in ("nospec", "graft_fixed_n24") for c in (1, 2)] == \
        [False, True, False, True]
    assert rows[("graft_fixed_n24", 1)]["outputs_equal_nospec"] and rows[("graft_fixed_n24", 2)]["outputs_equal_nospec"]
    assert rows[("graft_fixed_n24", 2)]["calibration"]["draft"]["trials"] > 0


def test_paired_windows_measure_both_servers(quick_models, tmp_path):
    """``python -m sglang_patch.bench.paired`` end to end: both servers up at once, one pair of
    windows, tokens/s from the requests inside each window, the ratio per pair in the JSON."""
    from sglang_patch.bench.paired import main as paired

    out = tmp_path / "paired.json"
    rc = paired(["--target", str(quick_models.target), "--draft", str(quick_models.draft),
                 "--prompts", str(Path(__file__).parents[1] / "data" / "humaneval_dev.jsonl"),
                 "--concurrency", "2", "--reps", "2", "--window-s", "2", "--settle-s", "1", "--max-tokens", "8",
                 "--modes", "greedy", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0
    assert [(w["method"], w["rep"]) for w in data["windows"]] == \
        [("nospec", 0), ("graft_plain", 0), ("graft_plain", 1), ("nospec", 1)]   # ABBA
    assert all(w["tokens_per_s"] > 0 for w in data["windows"])
    plain = data["pairs"]["greedy c2"]["graft_plain"]
    assert len(plain["ratios"]) == 2 and plain["min_ratio"] <= plain["median_ratio"] <= plain["max_ratio"]
