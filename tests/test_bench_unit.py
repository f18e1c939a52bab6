"""The benchmark's pieces that need no server: method expansion, metrics, report files."""

from __future__ import annotations

import math

import pytest

from sglang_patch.bench.client import RequestResult, RunResult
from sglang_patch.bench.methods import build_methods, stage_checkpoints
from sglang_patch.bench.prompts import load_prompts, split_warmup
from sglang_patch.bench.report import (add_ratios, calibration_delta, equal_outputs, markdown_table,
                                       merge_calibration, summarize, text_quality, write_plots)

ALL = ["nospec", "eagle3", "ngram", "retrieval_only", "pruned_only", "graft_fixed", "graft", "graft_paper"]


def test_methods_expand_to_valid_server_args(sglang_plugins_for_bench):
    methods = build_methods(ALL, [24, 60], 7, 10, "draft")
    labels = [m.label for m in methods]
    assert labels[0] == "nospec" and len(labels) == len(set(labels)) == 1 + 7 * 2
    for m in methods:
        args = m.server_args()
        if m.method == "nospec":
            assert args == []
            continue
        assert args[args.index("--speculative-num-draft-tokens") + 1] == str(m.num_draft_tokens)
        if m.method in ("graft", "graft_fixed", "pruned_only", "retrieval_only", "graft_paper"):
            # the real SGLang parser accepts them and graft's validator builds the config
            from sglang_patch.args import effective_graft_config

            sa = sglang_plugins_for_bench(["--model-path", "/x", *args])
            cfg = effective_graft_config(sa, environ={})
            assert cfg.num_draft_tokens == m.num_draft_tokens
            assert cfg.draft_nodes == (m.method != "retrieval_only")
            assert (not cfg.checkpoints) == (m.method != "graft_paper")
            # only the out-of-the-box method switches widths; every peer verifies N each step
            assert cfg.batch_budget.enabled == (m.method == "graft")
            if m.method == "pruned_only":
                assert not any(getattr(cfg.retrieval, s) for s in ("successor", "suffix", "corpus", "lookup"))
                assert cfg.retrieval.outputs == "off"


@pytest.fixture(scope="module")
def sglang_plugins_for_bench():
    pytest.importorskip("sglang")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args


@pytest.mark.parametrize("n", [8, 16, 24, 60])
def test_stage_checkpoints_increasing_and_below_budget(n):
    st = stage_checkpoints(n, 7)
    keeps = [s["keep"] for s in st]
    assert keeps == sorted(set(keeps)) and all(0 < k < n for k in keeps)
    assert [s["depth"] for s in st] == sorted({s["depth"] for s in st})


def test_unknown_method_and_unfillable_budget_rejected():
    with pytest.raises(ValueError, match="unknown methods"):
        build_methods(["eagle9"], [24], 7, 10, "d")
    with pytest.raises(ValueError, match="exceed the draft tree"):
        build_methods(["graft"], [60], 2, 4, "d")


def _run(hists, tokens, steps, src=""):
    res = [RequestResult(str(i), [1, 2], t, s, h, 0.5, src) for i, (h, t, s) in enumerate(zip(hists, tokens, steps))]
    return RunResult(res, wall_s=2.0)


def test_summarize_tau_histogram_share_and_ratios(tmp_path):
    spec = summarize(_run([[1, 2, 1], [0, 1]], [7, 2], [4, 1], src="tdxst"), 24)
    assert spec["tau"] == pytest.approx(9 / 5)
    assert spec["accept_hist"] == [0, 1, 3, 1]          # index = accept length, bonus included
    assert spec["grafted_accept_share"] == pytest.approx(2 / 3)
    base = summarize(_run([[], []], [9, 9], [0, 0]), 1)
    assert base["tau"] == 1.0 and base["grafted_accept_share"] is None
    slower = {**spec, "tau": spec["tau"] / 2, "tokens_per_s": spec["tokens_per_s"] / 4}
    g = {"prompt_set": "code", "mode": "greedy", "concurrency": 1}
    rows = [{"label": "nospec", "method": "nospec", "num_draft_tokens": None, **g, **base},
            {"label": "eagle3_n24", "method": "eagle3", "num_draft_tokens": 24, **g, **slower},
            {"label": "graft_n24", "method": "graft", "num_draft_tokens": 24, **g, **spec},
            {"label": "graft_n24", "method": "graft", "num_draft_tokens": 24, **g, "mode": "sampled", **base}]
    add_ratios(rows)
    assert rows[2]["speedup_vs_nospec"] == pytest.approx(spec["tokens_per_s"] / base["tokens_per_s"])
    assert rows[2]["vs"] == {"eagle3": {"tau": pytest.approx(2.0), "tokens_per_s": pytest.approx(4.0)}}
    assert rows[3]["vs"] == {} and rows[3]["speedup_vs_nospec"] is None   # other mode: no peers there
    assert "eagle3 2.00" in markdown_table(rows)
    paths = write_plots(rows, tmp_path, stem="t")
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in paths)


def test_calibration_deltas_merge_and_text_quality():
    before = {"calibration": {"draft": {"trials": 10, "estimated": 0.5, "observed": 0.4}}}
    after = {"calibration": {"draft": {"trials": 30, "estimated": 0.4, "observed": 0.3}}}
    d = calibration_delta(before, after)["draft"]
    assert d["trials"] == 20 and d["estimated"] == pytest.approx((12 - 5) / 20) and d["observed"] == pytest.approx(0.25)
    m = merge_calibration([calibration_delta(before, after), calibration_delta(before, before)])["draft"]
    assert m["trials"] == 20 and m["observed"] == pytest.approx(0.25)
    # the standard error of observed - estimated, the verify round as the cluster
    from graft_spec.stats import GraftStats
    stats = GraftStats()
    rounds = [(10, 5.0, 8), (10, 5.0, 2), (4, 2.0, 2)]     # (trials, sum of estimates, hits) of "suffix"
    for t, e, h in rounds:
        stats.record_round([], [[[0, 0, 0]] * 2 + [[t, e, h]] + [[0, 0, 0]] * 4], [[[0, 0]]])
    first = stats.summary()
    assert first["calibration"]["suffix"]["stderr"] == pytest.approx(math.sqrt(9 + 9 + 0) / 24)
    stats.record_round([], [[[0, 0, 0]] * 2 + [[6, 3.0, 6]] + [[0, 0, 0]] * 4], [[[0, 0]]])
    d = calibration_delta(first, stats.summary())["suffix"]
    assert d["trials"] == 6 and d["stderr"] == pytest.approx(3.0 / 6) and d["observed"] == pytest.approx(1.0)
    both = merge_calibration([{"suffix": d}, calibration_delta({"calibration": {}}, first)])["suffix"]
    assert both["trials"] == 30 and both["stderr"] == pytest.approx(math.sqrt(27) / 30)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(" " if i == 0 else "x" for i in ids)

    q = text_quality([[1, 0, 1, 0, 1, 0, 1, 0], [1, 2, 3, 4, 5]], Tok())
    # loop "x x x x": 4-grams (1,0,1,0) and (0,1,0,1) only -> 2 / 5; a novel text -> 2 / 2
    assert q["distinct_4gram_ratio"] == pytest.approx((2 / 5 + 2 / 2) / 2)
    assert q["non_whitespace_share"] == pytest.approx((0.5 + 1.0) / 2)


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


def test_warmup_prompts_are_held_out(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(f'{{"id": "{i}", "prompt": "p{i}"}}\n' for i in range(10)))
    measured, warm = split_warmup(load_prompts(f), 6, 3)
    assert [p.pid for p in measured] == ["0", "1", "2", "3", "4", "5"]
    assert [p.pid for p in warm] == ["7", "8", "9"]
    assert split_warmup(load_prompts(f), 10, 0) == (load_prompts(f), [])
    with pytest.raises(ValueError, match="holds 10"):
        split_warmup(load_prompts(f), 8, 3)


def test_prompt_sets_take_a_default_sets_bare_name_and_refuse_a_bare_unknown_one(capsys):
    from sglang_patch.bench.__main__ import _parse

    assert _parse(["--prompt-sets", "chat"]).prompt_sets == ["chat=data/mtbench_dev.jsonl"]
    assert _parse(["--prompt-sets", "mine=x.jsonl", "code"]).prompt_sets == ["mine=x.jsonl",
                                                                           "code=data/humaneval_dev.jsonl"]
    with pytest.raises(SystemExit):
        _parse(["--prompt-sets", "mine"])
    assert "--prompt-sets: 'mine' is neither NAME=JSONL" in capsys.readouterr().err


# ---------------------------------------------------------------- paired windows (bench/paired.py)
def test_window_tokens_credit_each_request_its_share_of_the_window():
    from sglang_patch.bench.paired import window_tokens

    reqs = [(0.0, 2.0, 64),     # straddles the start: 1 of its 2 s inside -> 32
            (2.0, 4.0, 64),     # inside -> 64
            (4.0, 8.0, 40),     # straddles the end: 1 of its 4 s inside -> 10
            (5.0, 6.0, 64),     # after the window -> 0
            (0.0, 0.5, 64),     # before the window -> 0
            (0.0, 8.0, 80)]     # covers the window: 4 of its 8 s -> 40
    assert window_tokens(reqs, 1.0, 5.0) == pytest.approx(32 + 64 + 10 + 40)
    # whole requests only (SGLang's finish-time counter) would read 64 here, whichever server was slower
    assert window_tokens([(0.0, 1.4, 64), (1.4, 2.8, 64)], 0.0, 2.1) == pytest.approx(96.0)
    with pytest.raises(ValueError, match="empty window"):
        window_tokens(reqs, 2.0, 2.0)
    with pytest.raises(ValueError, match="before it starts"):
        window_tokens([(3.0, 2.0, 1)], 0.0, 5.0)


def test_paired_ratios_pair_windows_of_the_same_repetition():
    from sglang_patch.bench.paired import paired_ratios

    w = [{"method": m, "concurrency": c, "rep": r, "tokens_per_s": t} for m, c, r, t in [
        ("nospec", 1, 0, 40.0), ("graft_plain", 1, 0, 40.0), ("nospec", 1, 1, 20.0), ("graft_plain", 1, 1, 18.0),
        ("nospec", 1, 2, 30.0), ("graft_plain", 1, 2, 33.0),
        ("nospec", 8, 0, 100.0), ("graft_plain", 8, 0, 80.0)]]
    w.append({"method": "nospec", "mode": "sampled", "concurrency": 8, "rep": 0, "tokens_per_s": 50.0})
    w.append({"method": "graft_plain", "mode": "sampled", "concurrency": 8, "rep": 0, "tokens_per_s": 45.0})
    out = paired_ratios(w)
    assert list(out) == ["greedy c1", "greedy c8", "sampled c8"]   # a window without a mode is greedy
    plain = out["greedy c1"]["graft_plain"]
    # per pair 1.0, 0.9, 1.1 (a ratio of medians would read 36/30 = 1.2 here)
    assert plain["ratios"] == [1.0, 0.9, 1.1] and plain["median_ratio"] == 1.0
    assert (plain["min_ratio"], plain["max_ratio"]) == (0.9, 1.1) and plain["median_tokens_per_s"] == 33.0
    assert "ratios" not in out["greedy c1"]["nospec"] and out["greedy c1"]["nospec"]["median_tokens_per_s"] == 30.0
    assert out["greedy c8"]["graft_plain"]["ratios"] == [0.8] and out["sampled c8"]["graft_plain"]["ratios"] == [0.9]
    with pytest.raises(ValueError, match="no nospec window"):
        paired_ratios(w + [{"method": "graft_plain", "concurrency": 8, "rep": 1, "tokens_per_s": 1.0}])


def test_interleaved_runs_alternate_the_server_order():
    from sglang_patch.bench.methods import interleave_order

    servers = ["nospec", "eagle3", "graft_fixed", "graft"]
    assert interleave_order(servers, 0) == servers and interleave_order(servers, 2) == servers
    assert interleave_order(servers, 1) == servers[::-1]
    firsts = {interleave_order(servers, i)[0] for i in range(4)}
    assert firsts == {"nospec", "graft"}   # graft runs first in every other cell, not always last


def test_peer_cells_compare_graft_with_the_best_peer_and_count_calibration_misses():
    from sglang_patch.bench.peers import peer_cells, peer_markdown

    def row(method, tau, n=24, s="chat", mode="greedy", c=1, cal=None):
        return {"method": method, "num_draft_tokens": n, "prompt_set": s, "mode": mode, "concurrency": c,
                "tau": tau, "grafted_accept_share": 0.5 if cal else None, "calibration": cal}

    cal = {"outputs": {"trials": 300, "estimated": 0.40, "observed": 0.47},      # a miss (0.07)
           "lookup": {"trials": 500, "estimated": 0.60, "observed": 0.62},
           "suffix": {"trials": 12, "estimated": 0.10, "observed": 0.90}}        # too few trials
    rows = [row("nospec", 1.0, n=None), row("eagle3", 3.0), row("ngram", 8.44), row("retrieval_only", 7.9),
            row("pruned_only", 9.5), row("graft_fixed", 8.08, cal=cal),
            row("eagle3", 2.0, mode="sampled"), row("graft_fixed", 2.1, mode="sampled", cal={}),
            row("graft_fixed", 99.0, c=4)]                                    # concurrency 1 only
    cells = peer_cells(rows)
    assert [(c["n"], c["set"], c["mode"]) for c in cells] == [(24, "chat", "greedy"), (24, "chat", "sampled")]
    greedy, sampled = cells
    assert greedy["ratio"] == pytest.approx(8.08 / 8.44) and not greedy["ok"]   # pruned-only is not a peer
    assert sampled["ratio"] == pytest.approx(2.1 / 2.0) and sampled["ok"]
    assert [(k["source"], k["ok"]) for k in greedy["calibration"]] == [("lookup", True), ("outputs", False)]
    text = peer_markdown(cells)
    assert greedy["ratio_se"] is None               # greedy methods decode the same text: no sampling noise
    assert ("cells on target: 1 of 2 (misses within two standard errors of 0.97: 0 of 1); "
            "calibration cells within tolerance: 1 of 2") in text
    assert "calibration miss: 24 chat greedy outputs: 0.400 / 0.470 (300 trials, 2 se 0.058)" in text


def test_tau_se_and_sampled_misses_within_noise():
    from sglang_patch.bench.peers import peer_cells, peer_markdown, tau_se

    # accept lengths 1 and 3, 50 steps each: tau 2, sample sd sqrt(100/99); 3 seeds x 100 tokens -> 150 steps
    pooled = {"tau": 2.0, "accept_hist": [0, 50, 0, 50], "output_tokens": 100.0, "seed": [0, 1, 2]}
    assert tau_se(pooled) == pytest.approx(math.sqrt(100 / 99 / 150))
    assert tau_se({"tau": 1.0, "accept_hist": [0, 64], "output_tokens": 64}) == 0.0     # no spread: no-spec

    def row(method, tau, hist, tokens):
        return {"method": method, "num_draft_tokens": 24, "prompt_set": "code", "mode": "sampled",
                "concurrency": 1, "tau": tau, "accept_hist": hist, "output_tokens": tokens, "seed": [0, 1, 2]}

    wide = [0, 40, 20, 20, 20]                       # tau 2.2, a wide spread
    near = peer_cells([row("eagle3", 2.2, wide, 100), row("graft_fixed", 2.1, wide, 100)])[0]
    far = peer_cells([row("eagle3", 2.2, wide, 10000), row("graft_fixed", 2.1, wide, 10000)])[0]
    assert not near["ok"] and near["ratio"] + 2 * near["ratio_se"] >= 0.97       # 45 steps per method
    assert not far["ok"] and far["ratio"] + 2 * far["ratio_se"] < 0.97           # 4545 steps per method
    assert "within two standard errors of 0.97: 1 of 1" in peer_markdown([near])
    assert "within two standard errors of 0.97: 0 of 1" in peer_markdown([far])


def test_sampled_seeds_average_rates_and_sum_counts():
    from sglang_patch.bench.__main__ import _mean_row

    def seed_row(seed, tau, hist, steps):
        return {"seed": seed, "tau": tau, "tokens_per_s": 10.0 * tau, "wall_s": 1.0, "mean_latency_s": 0.5,
                "output_tokens": 60.0, "verified_tokens_per_step": 24, "verify_steps": steps,
                "accept_hist": hist, "grafted_accept_share": 0.2}

    row = _mean_row([seed_row(0, 2.0, [0, 10, 10, 10], 30), seed_row(1, 3.0, [0, 0, 10, 0, 10], 20)])
    assert row["seed"] == [0, 1] and row["tau_per_seed"] == [2.0, 3.0]
    assert row["tau"] == pytest.approx(2.5) and row["output_tokens"] == pytest.approx(60.0)
    assert row["verify_steps"] == 50 and row["accept_hist"] == [0, 10, 20, 10, 10]


def test_budget_view_is_the_run_delta_for_its_buckets():
    """A bench row's ``budget``: rounds per reason during the run, and the round times, corrections
    and catch-up charge of the batch-size buckets the run's concurrency reaches."""
    from sglang_patch.bench.__main__ import _budget_view

    before = {"batch_budget": {"rounds_by_reason": {"explore": 5, "best": 100},
                               "round_ms": {"1": {"1": 15.0, "12": 50.0}}}}
    after = {"batch_budget": {"rounds_by_reason": {"explore": 7, "best": 160, "opt-out": 3},
                              "round_ms": {"1": {"1": 14.0, "12": 52.0}, "4": {"1": 20.0}, "16": {"1": 40.0}},
                              "correction": 0.8, "width_correction": {"1x12": 0.7, "16x12": 0.5},
                              "catch_up_ms_per_plain_round": {"1": 0.3, "16": 1.0}, "cost_model": None}}
    before["batch_budget"].update(tokens_by_width={"1": 100, "12": 40}, seconds_by_width={"1": 1.5, "12": 1.0})
    after["batch_budget"].update(tokens_by_width={"1": 160, "12": 40, "24": 9}, seconds_by_width={"1": 2.5, "12": 1.0, "24": 0.2})
    before["batch_budget"].update(tokens_by_bucket_width={"1x1": 100, "1x12": 40},
                                  seconds_by_bucket_width={"1x1": 1.5, "1x12": 1.0})
    after["batch_budget"].update(tokens_by_bucket_width={"1x1": 130, "1x12": 40, "4x1": 30, "4x24": 9},
                                 seconds_by_bucket_width={"1x1": 2.0, "1x12": 1.0, "4x1": 0.5, "4x24": 0.2})
    view = _budget_view(before, after, 4)
    assert view["tokens_by_bucket_width"] == {"1x1": 30, "4x1": 30, "4x24": 9}
    assert view["seconds_by_bucket_width"] == {"1x1": 0.5, "4x1": 0.5, "4x24": 0.2}
    assert view["rounds_by_reason"] == {"explore": 2, "best": 60, "opt-out": 3}
    assert view["tokens_by_width"] == {"1": 60, "24": 9} and view["seconds_by_width"] == {"1": 1.0, "24": 0.2}
    assert view["round_ms"] == {"1": {"1": 14.0, "12": 52.0}, "4": {"1": 20.0}}
    assert view["round_ms_before"] == {"1": {"1": 15.0, "12": 50.0}}
    assert view["width_correction"] == {"1x12": 0.7} and view["catch_up_ms_per_plain_round"] == {"1": 0.3}
    assert _budget_view({}, {"batch_budget": {"enabled": False}}, 1) is None


def test_repeats_keep_each_runs_ratio_beside_the_mean():
    """``--repeats 2``: a cell's rates are averaged over its runs, and ``per_repeat`` holds the
    ratios each run gave on its own (here budget / max(no-spec, N every round): 0.9, then 1.2)."""
    from sglang_patch.bench.__main__ import _add_per_repeat, _mean_row
    from sglang_patch.bench.report import add_ratios

    def row(method, label, n, rate, repeat, widths=None):
        r = {"method": method, "label": label, "num_draft_tokens": n, "prompt_set": "code", "mode": "greedy",
             "concurrency": 1, "seed": None, "repeat": repeat, "tau": 2.0, "tokens_per_s": rate, "wall_s": 1.0,
             "mean_latency_s": 0.5, "output_tokens": 64, "verified_tokens_per_step": 1, "verify_steps": 32,
             "accept_hist": [0, 32], "grafted_accept_share": None}
        if widths:
            r["verify_widths"] = widths
            r["budget"] = {"rounds_by_reason": {"best": 31, "explore": repeat}, "correction": 0.5 + repeat,
                           "tokens_by_width": {"1": 30, "24": 8}, "seconds_by_width": {"1": 0.3, "24": 0.1},
                           "tokens_by_bucket_width": {"1x1": 30, "1x24": 8}}
        return r

    per_cell = {}
    for k, (nospec, fixed, budget) in enumerate([(100.0, 80.0, 90.0), (50.0, 60.0, 72.0)]):
        for r in (row("nospec", "nospec", None, nospec, k), row("graft_fixed", "graft_fixed_n24", 24, fixed, k),
                  row("graft", "graft_n24", 24, budget, k, {"1": 30, "24": 2})):
            per_cell.setdefault((r["label"], "code", "greedy", 1), []).append(r)
    graft_runs = per_cell[("graft_n24", "code", "greedy", 1)]
    graft_runs[0]["outputs_equal_nospec"], graft_runs[1]["outputs_equal_nospec"] = True, False
    rows = [_mean_row(g) for g in per_cell.values()]
    add_ratios(rows)
    _add_per_repeat(rows, per_cell)
    graft = next(r for r in rows if r["method"] == "graft")
    assert graft["repeat"] == [0, 1] and graft["tokens_per_s"] == pytest.approx(81.0)
    assert graft["verify_widths"] == {"1": 60, "24": 4}                            # rounds of both runs
    assert graft["outputs_equal_nospec"] is False                                  # one run differed
    assert graft["budget"]["rounds_by_reason"] == {"best": 62, "explore": 1}
    assert graft["budget"]["tokens_by_width"] == {"1": 60, "24": 16} and graft["budget"]["correction"] == 1.5
    assert graft["budget"]["tokens_by_bucket_width"] == {"1x1": 60, "1x24": 16}
    assert graft["vs_best_fixed"] == pytest.approx(81.0 / 75.0)                  # of the averaged rates
    assert graft["per_repeat"]["vs_best_fixed"] == pytest.approx([0.9, 1.2])    # each run on its own
    assert graft["per_repeat"]["speedup_vs_nospec"] == pytest.approx([0.9, 1.44])
    nospec = next(r for r in rows if r["method"] == "nospec")
    assert "vs_best_fixed" not in nospec["per_repeat"]


def test_speculation_is_priced_at_the_plain_rate_of_its_own_batch_size():
    """A speculative round's tokens are priced at what plain rounds realised in the same batch-size
    bucket: at bucket 1, 60 tokens in 1.0 s of 12-wide rounds against plain rounds of 60 tokens/s
    breaks even; at bucket 4, 80 tokens in 1.0 s against 200 tokens/s costs 0.6 s; the 24-wide
    rounds of bucket 2, which never ran plain, are not priced. Per run: halved over 2 runs."""
    from sglang_patch.bench.budget_rates import speculation_net_seconds

    budget = {"tokens_by_bucket_width": {"1x1": 120, "1x12": 60, "4x1": 400, "4x12": 80, "2x24": 30},
              "seconds_by_bucket_width": {"1x1": 2.0, "1x12": 1.0, "4x1": 2.0, "4x12": 1.0, "2x24": 0.5}}
    net = speculation_net_seconds(budget, runs=2)
    assert net["net_s"] == pytest.approx((0.0 + 0.6) / 2)
    assert net["covered"] == pytest.approx(2.0 / 2.5)
    saved = speculation_net_seconds({"tokens_by_bucket_width": {"1x1": 60, "1x24": 90},
                                     "seconds_by_bucket_width": {"1x1": 1.0, "1x24": 1.0}})
    assert saved == {"net_s": pytest.approx(-0.5), "covered": 1.0}
    assert speculation_net_seconds({"tokens_by_bucket_width": {"1x1": 5}, "seconds_by_bucket_width": {"1x1": 1.0}}) is None
    assert speculation_net_seconds({}) is None
    with pytest.raises(ValueError, match="runs=0"):
        speculation_net_seconds(budget, runs=0)
