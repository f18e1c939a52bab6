"""The benchmark's pieces that need no server: method expansion, metrics, report files."""

from __future__ import annotations

import json

import pytest

from sglang_patch.bench.client import RequestResult, RunResult
from sglang_patch.bench.methods import build_methods, stage_checkpoints
from sglang_patch.bench.prompts import load_prompts
from sglang_patch.bench.report import add_ratios, equal_outputs, markdown_table, summarize, write_plots
from graft_spec.config import GraftConfig

ALL = ["nospec", "eagle3_dense", "eagle3", "pruned_only", "retrieval_only", "graft"]


def test_methods_expand_and_graft_configs_validate(tmp_path):
    methods = build_methods(ALL, [16, 24, 40, 60], 60, 7, 10, "draft", None)
    labels = [m.label for m in methods]
    assert labels[0] == "nospec" and "eagle3_dense" in labels and "eagle3_n60" not in labels
    assert len(labels) == len(set(labels)) == 2 + 3 + 3 * 4
    for m in methods:
        args = m.server_args(tmp_path)
        if m.method == "nospec":
            assert args == []
            continue
        assert args[args.index("--speculative-num-draft-tokens") + 1] == str(m.num_draft_tokens)
        if m.method in ("graft", "pruned_only", "retrieval_only"):
            cfg = json.loads(open(args[args.index("--graft-config") + 1]).read())
            GraftConfig.model_validate({**cfg, "num_draft_tokens": m.num_draft_tokens, "topk": 10, "depth": 7})
            if m.method == "pruned_only":
                assert not any(cfg["retrieval"][s] for s in ("successor", "suffix", "corpus"))


@pytest.mark.parametrize("n", [8, 16, 24, 60])
def test_stage_checkpoints_increasing_and_below_budget(n):
    st = stage_checkpoints(n, 7, "graft")
    keeps = [s["keep"] for s in st]
    assert keeps == sorted(set(keeps)) and all(0 < k < n for k in keeps)
    assert [s["depth"] for s in st] == sorted({s["depth"] for s in st})


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="unknown methods"):
        build_methods(["eagle9"], [24], 60, 7, 10, "d", None)


def _run(hists, tokens, steps, src=""):
    res = [RequestResult(str(i), [1, 2], t, s, h, 0.5, src) for i, (h, t, s) in enumerate(zip(hists, tokens, steps))]
    return RunResult(res, wall_s=2.0)


def test_summarize_tau_histogram_share_and_ratios(tmp_path):
    spec = summarize(_run([[1, 2, 1], [0, 1]], [7, 2], [4, 1], src="tdrrt"), 24)
    assert spec["tau"] == pytest.approx(9 / 5)
    assert spec["accept_hist"] == [0, 1, 3, 1]          # index = accept length, bonus included
    assert spec["grafted_accept_share"] == pytest.approx(2 / 3)
    base = summarize(_run([[], []], [9, 9], [0, 0]), 1)
    assert base["tau"] == 1.0 and base["grafted_accept_share"] is None
    rows = [{"label": "nospec", "method": "nospec", "num_draft_tokens": None, "concurrency": 1, **base},
            {"label": "eagle3_dense", "method": "eagle3", "num_draft_tokens": 60, "concurrency": 1, **spec},
            {"label": "graft_n24", "method": "graft", "num_draft_tokens": 24, "concurrency": 1, **spec}]
    add_ratios(rows)
    assert rows[2]["speedup_vs_nospec"] == pytest.approx(spec["tokens_per_s"] / base["tokens_per_s"])
    assert rows[2]["speedup_vs_eagle3_dense"] == pytest.approx(1.0)
    assert "graft_n24" in markdown_table(rows)
    paths = write_plots(rows, tmp_path)
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in paths)


def test_equal_outputs():
    assert equal_outputs([[1, 2], [3]], [[1, 2], [3]]) is None
    assert equal_outputs([[1, 2], [3]], [[1, 2], [4]]) == 1
    assert equal_outputs([[1]], [[1], [2]]) == 1


def test_load_prompts_both_shapes(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "def f():"}\n{"id": "b", "turns": ["hi", "again"]}\n')
    ps = load_prompts(f, render_chat=lambda m: f"<u>{m}</u>")
    assert [(p.pid, p.text, p.kind) for p in ps] == [("a", "def f():", "completion"), ("b", "<u>hi</u>", "chat")]
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="neither"):
        load_prompts(tmp_path / "bad.jsonl")
