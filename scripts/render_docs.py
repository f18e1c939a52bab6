#!/usr/bin/env python
"""Render the benchmark tables and figures in README.md and docs/*.md from docs/bench/*.json.

    python scripts/render_docs.py            # rewrite every marked block in place
    python scripts/render_docs.py --check    # exit 1 if any block differs from what the JSON renders

A block is the text between two marker comments, which markdown does not display::

    <!-- table:NAME -->            a table (or any multi-line block), on its own lines
    ...
    <!-- /table:NAME -->

    <!-- fig:NAME -->3.3-5.2<!-- /fig:NAME -->     one figure inside a sentence

``NAME`` is a key of `TABLES` or `FIGURES`; each entry names the JSON files it reads (paths under
docs/bench/). An unknown name, or a JSON file that is missing, is an error. Standard library only;
the issue-12 cells are computed by `sglang_patch.bench.peers.peer_cells` (itself standard library
only), so the docs and ``python -m sglang_patch.bench.peers`` agree.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_patch.bench.budget_rates import speculation_net_seconds  # noqa: E402  (standard library only)
from sglang_patch.bench.peers import BEST_OF, peer_cells  # noqa: E402  (standard library only)

BENCH = "docs/bench"
#: The two model pairs of the tau tables: (label, JSON written by ``python -m sglang_patch.bench``).
PAIRS = (("quick", "tau_quick.json"), ("default", "tau_default.json"))
#: Files the renderer rewrites (relative to the root); every other file is left alone.
DOCS = ("README.md", "docs/*.md")
#: Tau target of the peers table: graft's tau over the best peer's (`sglang_patch.bench.peers`).
RATIO = 0.97
#: Calibration target: |estimated - observed| per source, cells with at least MIN_TRIALS trials.
TOL, MIN_TRIALS = 0.05, 100

_BLOCK = re.compile(r"<!-- (table|fig):([a-z0-9_]+) -->(.*?)<!-- /\1:\2 -->", re.S)


class Bench:
    """The JSON files under ``root/docs/bench``, each loaded once."""

    def __init__(self, root: Path):
        self.dir = root / BENCH
        self._cache: Dict[str, dict] = {}

    def __call__(self, name: str) -> dict:
        if name not in self._cache:
            path = self.dir / name
            if not path.is_file():
                raise SystemExit(f"render_docs: {path} is missing")
            self._cache[name] = json.loads(path.read_text())
        return self._cache[name]


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _range(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


# --- tau against the peers (issue 12's table), both pairs ------------------------------------------

def _cells(bench: Bench) -> List[Tuple[str, dict]]:
    return [(pair, c) for pair, name in PAIRS for c in peer_cells(bench(name)["rows"], "graft_fixed", RATIO,
                                                                    TOL, MIN_TRIALS)]


def tau_peers(bench: Bench) -> str:
    rows = []
    for pair, c in _cells(bench):
        tau = [f"{c['tau'][k]:.2f}" if k in c["tau"] else "-" for k in BEST_OF + ("pruned_only", "graft_fixed")]
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
        if c["ratio_se"] is not None:
            ratio += f" ± {2 * c['ratio_se']:.3f}"
        if not c["ok"]:
            ratio = f"**{ratio}**"
        rows.append([pair, c["n"], c["set"], c["mode"], *tau, ratio, f"{c['grafted_share']:.2f}"])
    return _md(["pair", "N", "set", "mode", "EAGLE-3", "NGRAM", "retrieval-only", "pruned-only", "graft",
                "graft / best peer (± 2 se)", "grafted share"], rows)


def tau_on_target(bench: Bench) -> str:
    cells = [c for _, c in _cells(bench)]
    return f"{sum(c['ok'] for c in cells)} of {len(cells)}"


def tau_ratio_range(bench: Bench) -> str:
    return _range([c["ratio"] for _, c in _cells(bench) if c["ratio"] is not None], "{:.2f}")


def _tau_cell(pair: str, n: int, set_: str, mode: str, method: str) -> Callable[[Bench], str]:
    def fig(bench: Bench) -> str:
        for p, c in _cells(bench):
            if (p, c["n"], c["set"], c["mode"]) == (pair, n, set_, mode):
                return f"{c['tau'][method]:.2f}"
        raise SystemExit(f"render_docs: no cell {pair} N {n} {set_} {mode}")
    return fig


def greedy_equal(bench: Bench) -> str:
    bad = [name for _, name in PAIRS if bench(name).get("mismatches")]
    return "none" if not bad else "in " + ", ".join(bad)


# --- calibration ---------------------------------------------------------------------------------

def _graft_rows(bench: Bench, name: str) -> List[dict]:
    return [r for r in bench(name)["rows"] if r["method"] == "graft_fixed" and r["concurrency"] == 1]


def calibration(bench: Bench) -> str:
    """Per pair and source, pooled over the run's graft cells: trials, mean estimate, observed rate, and
    how many cells with >= MIN_TRIALS trials are within TOL."""
    rows = []
    for pair, name in PAIRS:
        sums: Dict[str, List[float]] = {}
        for r in _graft_rows(bench, name):
            for src, v in (r.get("calibration") or {}).items():
                if not isinstance(v, dict) or not v.get("trials"):
                    continue
                s = sums.setdefault(src, [0.0, 0.0, 0.0, 0, 0])
                s[0] += v["trials"]
                s[1] += v["est_sum"]
                s[2] += v["hit_sum"]
                if v["trials"] >= MIN_TRIALS:
                    s[3] += 1
                    s[4] += abs(v["estimated"] - v["observed"]) <= TOL
        for src, (t, e, h, cells, ok) in sums.items():
            rows.append([pair, src, f"{t:,.0f}", f"{e / t:.3f}", f"{h / t:.3f}", f"{ok} of {cells}" if cells else "-"])
    return _md(["pair", "source", "verified nodes", "estimated", "observed",
                f"cells within {TOL} (>= {MIN_TRIALS} trials)"], rows)


def calibration_misses(bench: Bench) -> str:
    rows = []
    for pair, c in _cells(bench):
        for k in c["calibration"]:
            if not k["ok"]:
                rows.append([pair, c["n"], c["set"], c["mode"], k["source"], f"{k['estimated']:.3f}",
                             f"{k['observed']:.3f}", f"{k['trials']:,.0f}", f"{2 * k['se']:.3f}"])
    return _md(["pair", "N", "set", "mode", "source", "estimated", "observed", "trials", "2 se of observed"], rows)


def calibration_on_target(bench: Bench) -> str:
    parts = []
    for pair, name in PAIRS:
        cal = [k for c in peer_cells(bench(name)["rows"], "graft_fixed", RATIO, TOL, MIN_TRIALS)
               for k in c["calibration"]]
        parts.append(f"{pair} {sum(k['ok'] for k in cal)} of {len(cal)}")
    return ", ".join(parts)


# --- the graft step on CPU (sglang_patch.bench.step) ---------------------------------------------------

def _step_rows(bench: Bench) -> Dict[Tuple[int, int], Dict[str, dict]]:
    out: Dict[Tuple[int, int], Dict[str, dict]] = {}
    for r in bench("step.json")["rows"]:
        out.setdefault((r["num_draft_tokens"], r["batch"]), {})[r["method"]] = r
    return out


def step_ops(bench: Bench) -> str:
    rows = []
    for (n, bs), m in sorted(_step_rows(bench).items()):
        g, e, gate, fused = m["graft"], m["eagle"], m.get("graft_eager_gated"), m.get("graft_fused")
        rows.append([n, bs, f"{g['ops_per_round']:.0f}", "-" if fused is None else f"{fused['ops_per_round']:.0f}",
                     f"{g['observe_ops_per_round']:.0f}",
                     "-" if fused is None or fused.get("observe_ops_per_round") is None
                     else f"{fused['observe_ops_per_round']:.0f}",
                     f"{g['syncs_per_round'] + g['observe_syncs_per_round']:.0f}",
                     f"{g['host_us_per_round'] / 1e3:.2f}",
                     "-" if gate is None else f"{gate['ops_per_round']:.0f}",
                     "-" if gate is None else f"{gate['host_us_per_round'] / 1e3:.2f}",
                     f"{e['ops_per_round']:.0f}", f"{e['host_us_per_round'] / 1e3:.2f}",
                     "-" if fused is None or fused.get("observe_ops_per_round") is None
                     else f"{(fused['ops_per_round'] + fused['observe_ops_per_round']) / e['ops_per_round']:.2f}"])
    return _md(["N", "batch", "graft build ops", "fused build ops", "observe ops", "fused observe ops", "syncs", "build ms",
                "eager gated round ops",
                "eager gated ms", "EAGLE ops", "EAGLE ms", "fused build + observe / EAGLE"], rows)


def step_build_ops(bench: Bench) -> str:
    return _range([m["graft"]["ops_per_round"] for m in _step_rows(bench).values()], "{:,.0f}")


def step_observe_ops(bench: Bench) -> str:
    return _range([m["graft"]["observe_ops_per_round"] for m in _step_rows(bench).values()], "{:,.0f}")


def step_gate_ops(bench: Bench) -> str:
    """Extra ops of the eager gated round (stop gate + build) over the build alone."""
    return _range([m["graft_eager_gated"]["ops_per_round"] - m["graft"]["ops_per_round"]
                   for m in _step_rows(bench).values() if "graft_eager_gated" in m], "{:,.0f}")


def step_unshared_ops(bench: Bench) -> str:
    """The eager gated round's ops with the gate's retrieval priced twice (``--eager-gate``'s baseline)."""
    return _range([m["graft_eager_gated_unshared"]["ops_per_round"]
                   for m in _step_rows(bench).values() if "graft_eager_gated_unshared" in m], "{:,.0f}")


def step_gated_ops(bench: Bench) -> str:
    return _range([m["graft_eager_gated"]["ops_per_round"]
                   for m in _step_rows(bench).values() if "graft_eager_gated" in m], "{:,.0f}")


# --- the graft step on a CUDA device (scripts/bench_step_cuda.py) --------------------------------------

def step_cuda(bench: Bench) -> str:
    rows = []
    for r in bench("step_cuda.json")["rows"]:
        rows.append([r["num_draft_tokens"], r["batch"], f"{r['eager_ms_per_round']:.1f}",
                     f"{r['graphs_ms_per_round']:.2f}", f"{r['eager_over_graphs']:.1f}x",
                     r["graph_kernels_per_replay"], "yes" if r["graph_trees_equal_eager"] else "**no**",
                     f"{r['host_side_ms_per_round']:.2f}"])
    return _md(["N", "batch", "eager ms", "graphs ms", "eager / graphs", "kernels per replay",
                "trees equal eager", "host-side ms (off the critical path)"], rows)


def cuda_device(bench: Bench) -> str:
    d = bench("step_cuda.json")
    return f"{d['device']}, torch {d['torch']}"


def cuda_graphs_ms(bench: Bench) -> str:
    return _range([r["graphs_ms_per_round"] for r in bench("step_cuda.json")["rows"]])


def cuda_eager_ms(bench: Bench) -> str:
    return _range([r["eager_ms_per_round"] for r in bench("step_cuda.json")["rows"]], "{:.0f}")


def cuda_kernels(bench: Bench) -> str:
    return _range([r["graph_kernels_per_replay"] for r in bench("step_cuda.json")["rows"]], "{:,.0f}")


def cuda_one_graph_ms(bench: Bench) -> str:
    """Build and observe captured in one graph (the script's ``build_and_observe_in_one_graph`` rows)."""
    return _range([r["graph_ms_per_replay"] for r in bench("step_cuda.json")["build_and_observe_in_one_graph"]["rows"]])


# --- the batch budget across concurrency (sglang_patch.bench, --concurrency 1 4 8 16 32) -----------------

def _budget_cells(bench: Bench) -> List[dict]:
    d = bench("batch_budget.json")
    by: Dict[tuple, Dict[str, dict]] = {}
    for r in d["rows"]:
        by.setdefault((r["prompt_set"], r["mode"], r["concurrency"]), {})[r["method"]] = r
    order = {s.split("=")[0]: i for i, s in enumerate(d["args"]["prompt_sets"])}
    cells = []
    for (s, m, c), rows in sorted(by.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1], kv[0][2])):
        g, base = rows["graft"], max(rows["nospec"]["tokens_per_s"], rows["graft_fixed"]["tokens_per_s"])
        cells.append({"set": s, "mode": m, "conc": c, "rows": rows, "ratio": g["tokens_per_s"] / base})
    return cells


def _widths(n: int) -> Tuple[int, ...]:
    return (1, math.ceil(n / 2), n)


def _with_repeats(ratio: float, graft: dict) -> str:
    """The cell's ratio, then each repeat's own in brackets when the run had ``--repeats``."""
    each = (graft.get("per_repeat") or {}).get("vs_best_fixed") or []
    return f"{ratio:.2f}" + (f" ({', '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else "")


def batch_budget(bench: Bench) -> str:
    cells = _budget_cells(bench)
    widths = _widths(cells[0]["rows"]["graft"]["num_draft_tokens"])
    eagle = all("eagle3" in c["rows"] for c in cells)
    out = []
    for c in cells:
        r = c["rows"]
        g = r["graft"]
        vw = g.get("verify_widths") or {}
        rounds = sum(vw.values())
        spec = sum(k for w, k in vw.items() if int(w) > 1) / rounds if rounds else 0.0
        row = [c["set"], c["mode"], c["conc"], f"{r['nospec']['tokens_per_s']:.0f}"]
        if eagle:
            row.append(f"{r['eagle3']['tokens_per_s']:.0f} ({r['eagle3']['tau']:.2f})")
        row += [f"{r['graft_fixed']['tokens_per_s']:.0f} ({r['graft_fixed']['tau']:.2f})",
                f"{g['tokens_per_s']:.0f}", _with_repeats(c["ratio"], g), f"{g['tau']:.2f}", f"{spec:.0%}",
                "/".join(str(vw.get(str(w), 0)) for w in widths)]
        reasons = (g.get("budget") or {}).get("rounds_by_reason")
        row.append(str(reasons.get("explore", 0)) if reasons is not None else "-")
        row.append(_net_seconds(g))
        out.append(row)
    n = widths[-1]
    head = ["set", "mode", "conc", "no-spec"] + (["EAGLE-3 (tau)"] if eagle else []) + [
        f"graft N {n} (tau)", "graft budget", "budget / max", "budget tau", "speculative rounds",
        "rounds " + "/".join(map(str, widths)), "explored", "speculating vs plain, s/run"]
    return _md(head, out)


def _speculation_net(graft: dict) -> Optional[Dict[str, float]]:
    """`speculation_net_seconds` of a budget row, per run (None without per-bucket counts)."""
    repeat = graft.get("repeat")
    return speculation_net_seconds(graft.get("budget") or {}, len(repeat) if isinstance(repeat, list) else 1)


def _net_seconds(graft: dict) -> str:
    """`_speculation_net` as a cell: ``-0.77`` (saved), ``+0.11`` (cost), with the share of
    speculative seconds it prices when below 100%; ``-`` without per-bucket counts."""
    net = _speculation_net(graft)
    if net is None:
        return "-"
    return f"{net['net_s']:+.2f}" + (f" ({net['covered']:.0%} priced)" if net["covered"] < 0.995 else "")


def budget_mean_ratio(bench: Bench) -> str:
    cells = _budget_cells(bench)
    return f"{sum(c['ratio'] for c in cells) / len(cells):.3f}"


def budget_ratio_range(bench: Bench) -> str:
    return _range([c["ratio"] for c in _budget_cells(bench)], "{:.2f}")


def budget_repeat_spread(bench: Bench) -> str:
    """Median and largest difference between the repeats of one cell's budget / max ratio."""
    gaps = sorted(max(e) - min(e) for e in ((c["rows"]["graft"].get("per_repeat") or {}).get("vs_best_fixed")
                                             for c in _budget_cells(bench)) if e and len(e) > 1)
    if not gaps:
        return "-"
    return f"{statistics.median(gaps):.2f} (median), {gaps[-1]:.2f} (largest)"


def budget_cells_095(bench: Bench) -> str:
    cells = _budget_cells(bench)
    return f"{sum(c['ratio'] >= 0.95 for c in cells)} of {len(cells)}"


def budget_plain_cells(bench: Bench) -> str:
    """Cells whose budget rounds were all plain (width 1)."""
    cells = _budget_cells(bench)
    plain = sum(set((c["rows"]["graft"].get("verify_widths") or {}).keys()) <= {"1"} for c in cells)
    return f"{plain} of {len(cells)}"


def budget_fixed_vs_nospec(bench: Bench) -> str:
    """Where N every round beat no-spec, and its range of ratios where it lost."""
    ratios = [c["rows"]["graft_fixed"]["tokens_per_s"] / c["rows"]["nospec"]["tokens_per_s"]
              for c in _budget_cells(bench)]
    won, lost = [r for r in ratios if r > 1.0], [r for r in ratios if r <= 1.0]
    parts = [f"beat no-spec in {len(won)} of {len(ratios)} cells"
             + (f" ({_range(won, '{:.2f}')}x)" if won else "")]
    if lost:
        parts.append(f"lost in {len(lost)} ({_range(lost, '{:.2f}')}x)")
    return " and ".join(parts)


def budget_speculation_net(bench: Bench) -> str:
    """How the budget's speculative rounds did against its plain rounds, over the cells."""
    cells = _budget_cells(bench)
    saved, cost = [], []   # net seconds per run; (net seconds, share of the run) where it cost
    for c in cells:
        g = c["rows"]["graft"]
        net = _speculation_net(g)
        if net is None:
            continue
        if net["net_s"] < 0:
            saved.append(net["net_s"])
        else:   # wall_s: one run's
            cost.append((net["net_s"], net["net_s"] / g["wall_s"] if g.get("wall_s") else None))
    if not saved and not cost:
        return "-"
    text = f"saved time in {len(saved)} cells of {len(cells)}"
    if saved:
        text += f" (up to {-min(saved):.2f} s a run)"
    if cost:
        shares = [r for _, r in cost if r is not None]
        text += f" and cost time in {len(cost)}, at most {max(n for n, _ in cost):.2f} s a run" + (
            f" or {max(shares):.0%} of a run" if shares else "")
    return text


# --- a plain round against SGLang's decode step (sglang_patch.bench.paired) -----------------------------

def paired(bench: Bench) -> str:
    d = bench("paired.json")
    methods = d["args"]["methods"]
    rows = []
    for cell, per in d["pairs"].items():        # "<mode> c<concurrency>", in the tool's order
        mode, c = cell.split(" c")
        windows = {m: [w["tokens_per_s"] for w in sorted(d["windows"], key=lambda w: w["rep"])
                       if w["method"] == m and str(w["concurrency"]) == c and w.get("mode", "greedy") == mode]
                   for m in methods}
        other = per[methods[1]]
        rows.append([mode, c, ", ".join(f"{x:.1f}" for x in windows[methods[0]]),
                     ", ".join(f"{x:.1f}" for x in windows[methods[1]]),
                     ", ".join(f"{x:.2f}" for x in other["ratios"]), f"**{other['median_ratio']:.2f}**"])
    return _md(["mode", "concurrency", f"{methods[0]} tokens/s per window", f"{methods[1]} tokens/s per window",
                "ratio per pair", "median ratio"], rows)


def _paired_median(cell: str) -> Callable[[Bench], str]:
    def fig(bench: Bench) -> str:
        d = bench("paired.json")
        return f"{d['pairs'][cell][d['args']['methods'][1]]['median_ratio']:.2f}"
    return fig


def paired_range(bench: Bench) -> str:
    """The lowest and highest median ratio over the cells."""
    d = bench("paired.json")
    m = d["args"]["methods"][1]
    medians = [per[m]["median_ratio"] for per in d["pairs"].values()]
    return f"{min(medians):.2f}-{max(medians):.2f}"


#: Scheduler phases of the op census table: the round's forward, and the scheduling before it.
_CENSUS_PHASES = {"run_batch": "round (`run_batch`)", "get_next_batch_to_run": "scheduling (`get_next_batch_to_run`)"}


def op_census(bench: Bench) -> str:
    d = bench("op_census.json")
    ns, gp = d["servers"]["nospec"], d["servers"]["graft_plain"]
    rows = []
    for key in sorted(set(ns) & set(gp), key=lambda k: (-len(k.split()[0]), k.split()[1], int(k.split("bs")[1]))):
        phase, mode, bs = key.split()[0], key.split()[1], key.split("bs")[1]
        if phase not in _CENSUS_PHASES or (phase != "run_batch" and mode != "DECODE") or bs == "0":
            continue
        a, b = ns[key], gp[key]
        rows.append([_CENSUS_PHASES[phase], mode, bs, f"{a['kernels_per_round']:.0f}", f"{b['kernels_per_round']:.0f}",
                     f"{b['kernels_per_round'] - a['kernels_per_round']:+.0f}",
                     f"{a['syncs_per_round']:.0f} / {b['syncs_per_round']:.0f}"])
    return _md(["phase", "forward mode", "batch", "no-spec kernels", "graft plain kernels", "extra",
                "syncs (no-spec / graft)"], rows)


def _census_extra(*keys: str) -> Callable[[Bench], str]:
    def fig(bench: Bench) -> str:
        d = bench("op_census.json")
        ns, gp = d["servers"]["nospec"], d["servers"]["graft_plain"]
        return f"{sum(gp[k]['kernels_per_round'] - ns[k]['kernels_per_round'] for k in keys):+.0f}"
    return fig


TABLES: Dict[str, Callable[[Bench], str]] = {
    "tau_peers": tau_peers,
    "calibration": calibration,
    "calibration_misses": calibration_misses,
    "step_ops": step_ops,
    "step_cuda": step_cuda,
    "batch_budget": batch_budget,
    "paired": paired,
    "op_census": op_census,
}

FIGURES: Dict[str, Callable[[Bench], str]] = {
    "tau_on_target": tau_on_target,
    "tau_ratio_range": tau_ratio_range,
    "tau_default_60_code_greedy": _tau_cell("default", 60, "code", "greedy", "graft_fixed"),
    "tau_default_60_code_greedy_eagle3": _tau_cell("default", 60, "code", "greedy", "eagle3"),
    "tau_default_60_chat_sampled": _tau_cell("default", 60, "chat", "sampled", "graft_fixed"),
    "tau_default_60_chat_sampled_eagle3": _tau_cell("default", 60, "chat", "sampled", "eagle3"),
    "greedy_equal": greedy_equal,
    "calibration_on_target": calibration_on_target,
    "step_build_ops": step_build_ops,
    "step_observe_ops": step_observe_ops,
    "step_gate_ops": step_gate_ops,
    "step_gated_ops": step_gated_ops,
    "step_unshared_ops": step_unshared_ops,
    "cuda_device": cuda_device,
    "cuda_graphs_ms": cuda_graphs_ms,
    "cuda_eager_ms": cuda_eager_ms,
    "cuda_kernels": cuda_kernels,
    "cuda_one_graph_ms": cuda_one_graph_ms,
    "budget_mean_ratio": budget_mean_ratio,
    "budget_fixed_vs_nospec": budget_fixed_vs_nospec,
    "budget_speculation_net": budget_speculation_net,
    "budget_ratio_range": budget_ratio_range,
    "budget_cells_095": budget_cells_095,
    "budget_repeat_spread": budget_repeat_spread,
    "budget_plain_cells": budget_plain_cells,
    "paired_median_greedy_1": _paired_median("greedy c1"),
    "paired_range": paired_range,
    "census_extra_kernels_1": _census_extra("run_batch DECODE bs1"),
    "census_extra_kernels_4": _census_extra("run_batch DECODE bs4"),
    "census_extra_scheduling_1": _census_extra("get_next_batch_to_run DECODE bs1"),
    "census_extra_decode_1": _census_extra("run_batch DECODE bs1", "get_next_batch_to_run DECODE bs1"),
    "census_extra_decode_4": _census_extra("run_batch DECODE bs4", "get_next_batch_to_run DECODE bs4"),
}


def render_text(text: str, bench: Bench, where: str = "") -> str:
    """``text`` with every marked block replaced by what its JSON renders."""
    def sub(m: re.Match) -> str:
        kind, name = m.group(1), m.group(2)
        registry = TABLES if kind == "table" else FIGURES
        if name not in registry:
            raise SystemExit(f"render_docs: {where}: unknown {kind} {name!r} (known: {', '.join(sorted(registry))})")
        body = registry[name](bench)
        body = f"\n{body}\n" if kind == "table" else body
        return f"<!-- {kind}:{name} -->{body}<!-- /{kind}:{name} -->"
    return _BLOCK.sub(sub, text)


def doc_files(root: Path) -> List[Path]:
    return sorted({p for pattern in DOCS for p in root.glob(pattern) if p.is_file()})


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    p.add_argument("--root", type=Path, default=REPO, help="the checkout whose docs and docs/bench to use")
    a = p.parse_args(argv)
    bench = Bench(a.root)
    stale = []
    for path in doc_files(a.root):
        old = path.read_text()
        new = render_text(old, bench, str(path.relative_to(a.root)))
        if new != old:
            stale.append(str(path.relative_to(a.root)))
            if not a.check:
                path.write_text(new)
    if a.check and stale:
        print("render_docs: out of date (run python scripts/render_docs.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(("render_docs: rewrote " + ", ".join(stale)) if stale and not a.check else "render_docs: up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
