"""Benchmark summaries: per-setting metrics, ratios, JSON, PNG plots and a markdown table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from graft_spec.pipeline import GRAFTED_SOURCES, SOURCE_LETTERS
from sglang_patch.bench.client import RunResult


def sum_histograms(hists: Iterable[Sequence[int]], offset: int = 0) -> List[int]:
    """Element-wise sum of count lists of any lengths, each moved ``offset`` places right (index =
    accept length; SGLang's per-request ``correct_drafts_histogram`` counts drafted tokens, so
    ``offset=1`` adds the bonus token). ``[]`` for no lists."""
    out: List[int] = []
    for h in hists:
        for k, c in enumerate(h):
            while len(out) <= k + offset:
                out.append(0)
            out[k + offset] += int(c)
    return out


def summarize(run: RunResult, num_draft_tokens: int) -> Dict[str, Any]:
    """Metrics of one (method, N, concurrency) run.

    Returns a dict with:
        tau: mean accepted tokens per verify step, bonus included (completion tokens / verify steps,
            over all requests); 1.0 without speculation.
        accept_hist: accept-length histogram, index = accept length (bonus included), counts of steps.
        verified_tokens_per_step: tokens the target verifies per request per step (N; 1 without
            speculation; for graft's batch budget the run's mean width, set by the caller from
            ``/server_info``).
        output_tokens, wall_s, tokens_per_s (output tokens / wall seconds), mean_latency_s.
        grafted_accept_share: share of accepted tree tokens that came from grafted nodes (a
            retrieval source's, no draft member: `GRAFTED_SOURCES`), from Graft's ``graft_src``
            letters; None for other methods.
    """
    src = "".join(r.graft_src for r in run.results)
    tree_accepted = sum(src.count(c) for c in SOURCE_LETTERS)
    grafted = sum(src.count(SOURCE_LETTERS[s]) for s in GRAFTED_SOURCES)
    tokens = sum(r.completion_tokens for r in run.results)
    steps = sum(r.verify_ct for r in run.results)
    hist = sum_histograms((r.correct_drafts_histogram for r in run.results), offset=1)
    spec = steps > 0
    return {
        "tau": tokens / steps if spec else 1.0,
        "accept_hist": hist if spec else [0, tokens],
        "verify_steps": steps if spec else tokens,
        "verified_tokens_per_step": num_draft_tokens if spec else 1,
        "output_tokens": tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else 0.0,
        "mean_latency_s": sum(r.latency_s for r in run.results) / max(len(run.results), 1),
        "grafted_accept_share": grafted / tree_accepted if tree_accepted else None,
    }


PEERS = ("eagle3", "ngram", "retrieval_only", "pruned_only", "graft_fixed")


def _group(row: Dict[str, Any]) -> tuple:
    return row.get("prompt_set"), row.get("mode"), row["concurrency"]


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """Ratios within one (prompt set, mode, concurrency), side by side:

    * ``speedup_vs_nospec``: tokens/s over the no-speculation server's;
    * on graft rows, ``vs``: {peer: {"tau": ratio, "tokens_per_s": ratio}} against every peer at the
      same N (`PEERS`);
    * on ``graft`` rows (the batch budget), ``vs_best_fixed``: tokens/s over the better of no-spec and
      ``graft_fixed`` at the same N (the two choices the budget picks between), when both ran, and
      ``speculative_share``: the share of its decode rounds that verified more than the root.
    """
    by: Dict[tuple, Dict[tuple, Dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(_group(r), {})[(r["method"], r["num_draft_tokens"])] = r
    for r in rows:
        same = by[_group(r)]
        base = same.get(("nospec", None))
        r["speedup_vs_nospec"] = r["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None
        if r["method"].startswith("graft"):
            r["vs"] = {}
            for peer in PEERS:
                p = same.get((peer, r["num_draft_tokens"]))
                if p is not None:
                    r["vs"][peer] = {"tau": r["tau"] / p["tau"] if p["tau"] else None,
                                     "tokens_per_s": r["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else None}
        if r["method"] == "graft":
            fixed = same.get(("graft_fixed", r["num_draft_tokens"]))
            best = max(x["tokens_per_s"] for x in (base, fixed) if x is not None) if base and fixed else None
            r["vs_best_fixed"] = r["tokens_per_s"] / best if best else None
            widths = r.get("verify_widths") or {}
            rounds = sum(widths.values())
            r["speculative_share"] = (sum(k for w, k in widths.items() if int(w) > 1) / rounds) if rounds else None


def calibration_delta(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """A graft server's calibration over one run, from two ``/server_info`` worker states: per member
    source ``{trials, est_sum, hit_sum, sq_error, estimated, observed, stderr}`` (means over the
    run's verified nodes; ``stderr`` the standard error of ``observed - estimated`` with the verify
    round as the cluster, `graft_spec.stats.GraftStats`)."""
    out = {}
    for m, a in after["calibration"].items():
        b = before["calibration"].get(m, {"trials": 0})
        t = a["trials"] - b["trials"]
        sums = lambda c, k: (c.get(k) or 0.0) * c["trials"]  # noqa: E731
        e, h = sums(a, "estimated") - sums(b, "estimated"), sums(a, "observed") - sums(b, "observed")
        out[m] = _calibration_row(t, e, h, (a.get("sq_error") or 0.0) - (b.get("sq_error") or 0.0))
    return out


def _calibration_row(t: float, e: float, h: float, sq: float) -> Dict[str, Any]:
    return {"trials": t, "est_sum": e, "hit_sum": h, "sq_error": sq, "estimated": e / t if t else None,
            "observed": h / t if t else None, "stderr": math.sqrt(max(sq, 0.0)) / t if t else None}


def merge_calibration(parts: List[Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """Several `calibration_delta` results as one (counts summed, means recomputed)."""
    out = {}
    for m in parts[0]:
        t = sum(p[m]["trials"] for p in parts)
        e = sum(p[m]["est_sum"] for p in parts)
        h = sum(p[m]["hit_sum"] for p in parts)
        out[m] = _calibration_row(t, e, h, sum(p[m].get("sq_error", 0.0) for p in parts))
    return out


def text_quality(outputs: List[List[int]], tokenizer) -> Dict[str, float]:
    """How much of the text is real, per completion then averaged: ``non_whitespace_share`` (share of
    non-whitespace characters of the decoded text) and ``distinct_4gram_ratio`` (distinct token-id
    4-grams / all 4-grams; a loop drives it towards 0)."""
    nws, d4 = [], []
    for ids in outputs:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        nws.append(sum(not ch.isspace() for ch in text) / len(text) if text else 0.0)
        grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
        d4.append(len(set(grams)) / len(grams) if grams else 0.0)
    n = max(len(outputs), 1)
    return {"non_whitespace_share": sum(nws) / n, "distinct_4gram_ratio": sum(d4) / n}


def markdown_table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table of every row (graft rows add tau and tokens/s ratios to their peers)."""
    head = ("| method | N | set | mode | conc | tau | verified/step | grafted share | tok/s | x no-spec |"
            " x best fixed | spec rounds | graft tau / peers |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    fmt = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in rows:
        vs = ", ".join(f"{k} {fmt(v['tau'])}" for k, v in r.get("vs", {}).items())
        lines.append(
            f"| {r['method']} | {r['num_draft_tokens'] or '-'} | {r.get('prompt_set', '-')} | {r.get('mode', '-')} | "
            f"{r['concurrency']} | {r['tau']:.2f} | {r['verified_tokens_per_step']} | "
            f"{fmt(r.get('grafted_accept_share'))} | {r['tokens_per_s']:.1f} | {fmt(r.get('speedup_vs_nospec'))} | "
            f"{fmt(r.get('vs_best_fixed'))} | {fmt(r.get('speculative_share'))} | {vs or '-'} |")
    return "\n".join(lines)


def _panels_figure(rows: List[Dict[str, Any]], panels: List[tuple], keep, x: str, y: str, title: str,
                   xlabel: str, ylabel: str, path: Path, log2_x: bool = False) -> str:
    """One PNG with a panel per (prompt set, mode): ``y`` against ``x`` per method over the rows
    ``keep(row)`` selects. Returns the file path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (ps, mode) in zip(axes[0], panels):
        sel = [r for r in rows if (r.get("prompt_set"), r.get("mode")) == (ps, mode) and keep(r)]
        for method in sorted({r["method"] for r in sel}):
            pts = sorted((r[x], r[y]) for r in sel if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_title(title.format(ps=ps, mode=mode))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log2_x:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_plots(rows: List[Dict[str, Any]], out_dir: Path, stem: str = "bench") -> List[str]:
    """PNG plots: tau vs N per method (one panel per prompt set x mode, lowest concurrency), and
    tokens/s vs concurrency per method (largest N) when several concurrencies ran.

    Returns the written file paths.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = sorted({(r.get("prompt_set"), r.get("mode")) for r in rows})
    c_min = min(r["concurrency"] for r in rows)
    paths = [_panels_figure(rows, panels, lambda r: r["concurrency"] == c_min and r["num_draft_tokens"],
                            "num_draft_tokens", "tau", "{ps}, {mode}", "verify budget N",
                            "tau (tokens / verify step)", out_dir / f"{stem}_tau_vs_n.png")]
    if len({r["concurrency"] for r in rows}) > 1:
        n_max = max(r["num_draft_tokens"] or 0 for r in rows)
        paths.append(_panels_figure(rows, panels, lambda r: r["num_draft_tokens"] in (None, n_max),
                                    "concurrency", "tokens_per_s", f"{{ps}}, {{mode}}, N={n_max}", "concurrency",
                                    "tokens / s", out_dir / f"{stem}_tokens_vs_concurrency.png", log2_x=True))
    return paths


def write_json(path: Path, payload: Dict[str, Any]) -> None:
    """Write the benchmark JSON (indent 2)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def equal_outputs(ref: List[List[int]], got: List[List[int]]) -> Optional[int]:
    """Index of the first prompt whose output ids differ, or ``None`` when all are equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))
