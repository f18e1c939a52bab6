"""Benchmark summaries: per-setting metrics, ratios, JSON, PNG plots and a markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from sglang_patch.bench.client import RunResult


def summarize(run: RunResult, num_draft_tokens: int) -> Dict[str, Any]:
    """Metrics of one (method, N, concurrency) run.

    Returns a dict with:
        tau: mean accepted tokens per verify step, bonus included (completion tokens / verify steps,
            over all requests); 1.0 without speculation.
        accept_hist: accept-length histogram, index = accept length (bonus included), counts of steps.
        verified_tokens_per_step: tokens the target verifies per step (N; 1 without speculation).
        output_tokens, wall_s, tokens_per_s (output tokens / wall seconds), mean_latency_s.
        grafted_accept_share: share of accepted draft-tree tokens that came from grafted
            (retrieved) nodes, from Graft's ``graft_src`` letters; None for other methods.
    """
    src = "".join(r.graft_src for r in run.results)
    tree_accepted = sum(src.count(c) for c in "drp")
    tokens = sum(r.completion_tokens for r in run.results)
    steps = sum(r.verify_ct for r in run.results)
    hist: List[int] = []
    for r in run.results:
        for k, c in enumerate(r.correct_drafts_histogram):
            while len(hist) <= k + 1:
                hist.append(0)
            hist[k + 1] += int(c)
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
        "grafted_accept_share": src.count("r") / tree_accepted if tree_accepted else None,
    }


def add_ratios(rows: List[Dict[str, Any]], baseline: str = "nospec", dense: str = "eagle3_dense") -> None:
    """Add ``speedup_vs_nospec`` and ``speedup_vs_eagle3_dense`` (tokens/s ratios, same concurrency)."""
    by_c: Dict[int, Dict[str, float]] = {}
    for r in rows:
        by_c.setdefault(r["concurrency"], {})[r["label"]] = r["tokens_per_s"]
    for r in rows:
        ref = by_c[r["concurrency"]]
        for key, name in (("speedup_vs_nospec", baseline), ("speedup_vs_eagle3_dense", dense)):
            base = ref.get(name)
            r[key] = r["tokens_per_s"] / base if base else None


def markdown_table(rows: List[Dict[str, Any]]) -> str:
    """A short markdown table of every row."""
    head = ("| method | N | conc | tau | verified/step | grafted share | tok/s | x no-spec | x EAGLE3-dense |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        share = r.get("grafted_accept_share")
        fmt = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        lines.append(
            f"| {r['label']} | {r['num_draft_tokens'] or '-'} | {r['concurrency']} | {r['tau']:.2f} | "
            f"{r['verified_tokens_per_step']} | {fmt(share)} | {r['tokens_per_s']:.1f} | "
            f"{fmt(r.get('speedup_vs_nospec'))} | {fmt(r.get('speedup_vs_eagle3_dense'))} |")
    return "\n".join(lines)


def write_plots(rows: List[Dict[str, Any]], out_dir: Path) -> List[str]:
    """PNG plots: tau vs N per method (concurrency 1), and accept-length histograms at the largest N.

    Returns the written file paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    c1 = [r for r in rows if r["concurrency"] == min(x["concurrency"] for x in rows)]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in c1 if r["num_draft_tokens"]}):
        pts = sorted((r["num_draft_tokens"], r["tau"]) for r in c1 if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xlabel("verify budget N (tokens per verify step)")
    ax.set_ylabel("tau (accepted tokens / verify step)")
    ax.grid(alpha=0.3)
    ax.legend()
    p = out_dir / "tau_vs_n.png"
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(str(p))

    spec_rows = [r for r in c1 if r["num_draft_tokens"]]
    if spec_rows:
        n_max = max(r["num_draft_tokens"] for r in spec_rows)
        fig, ax = plt.subplots(figsize=(6, 4))
        sel = [r for r in spec_rows if r["num_draft_tokens"] == n_max]
        width = 0.8 / max(len(sel), 1)
        for i, r in enumerate(sel):
            hist = r["accept_hist"]
            total = max(sum(hist), 1)
            ax.bar([k + i * width for k in range(len(hist))], [h / total for h in hist], width=width,
                   label=r["method"])
        ax.set_xlabel(f"accept length (bonus included), N={n_max}")
        ax.set_ylabel("share of verify steps")
        ax.legend()
        p = out_dir / "accept_hist.png"
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
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
