"""``python -m sglang_patch.bench.peers BENCH.json``: issue 12's table from a benchmark's JSON.

For every (N, prompt set, mode) at concurrency 1: tau of each method, graft's tau over the best of
its peers that a user could run instead (EAGLE-3, SGLang's NGRAM, retrieval-only; pruned-only is
shown but is graft with retrieval off), graft's grafted share, and graft's calibration cells
(estimated vs observed acceptance per source, sampled seeds pooled) with at least ``--min-trials``
trials. The targets: ratio >= ``--ratio`` (0.97) in every cell, |estimated - observed| <= ``--tol``
(0.05) in every calibration cell. Beside each sampled cell's ratio, two standard errors of it
(`tau_se`): sampled methods decode different texts (each tree consumes the seed's draws
differently), so their taus carry sampling noise, and a miss inside two standard errors is one this
run cannot tell from the target. Greedy methods decode the same text (checked against no-spec), so
a greedy ratio has no sampling noise and gets no se; it still moves between runs of identical code
(the trees differ with the calibration's state), which this table cannot show. Each calibration miss is printed with two binomial
standard errors of its observed rate (trials taken as independent: retrieved nodes come in chains,
so this too is a lower bound on the noise). Reads the JSON `sglang_patch.bench` writes; runs
nothing.

Example::

    python -m sglang_patch.bench.peers bench_out/issue12_quick.json
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Dict, List, Sequence

__all__ = ["BEST_OF", "tau_se", "peer_cells", "peer_markdown"]

#: The methods graft must match (the issue-12 criterion): what a user would run instead.
BEST_OF = ("eagle3", "ngram", "retrieval_only")
#: Methods shown before graft's own column (pruned-only: graft without retrieval, shown, not a peer).
_SHOWN = BEST_OF + ("pruned_only",)


def tau_se(row: Dict[str, Any]) -> float:
    """Standard error of a row's tau (accepted tokens per verify step), in tokens.

    The spread of the accept length per step comes from ``accept_hist`` (index = accept length,
    bonus included); the number of steps from ``output_tokens`` x seeds / tau (a sampled row
    averages ``output_tokens`` over its seeds; JSON written before the histograms were summed over
    seeds carries the first seed's histogram, whose spread stands for all). Steps are taken as
    independent, which they are not (a prompt's steps share its text), so this is a lower bound on
    the run-to-run noise. 0.0 for a row without steps.
    """
    hist = row.get("accept_hist") or []
    n_hist = sum(hist)
    seeds = row.get("seed")
    steps = row.get("output_tokens", 0) * (len(seeds) if isinstance(seeds, list) else 1) / max(row["tau"], 1e-9)
    if n_hist < 2 or steps < 2:
        return 0.0
    mean = sum(k * c for k, c in enumerate(hist)) / n_hist
    var = sum(c * (k - mean) ** 2 for k, c in enumerate(hist)) / (n_hist - 1)
    return math.sqrt(var / steps)


def peer_cells(rows: Sequence[Dict[str, Any]], graft: str = "graft_fixed", ratio: float = 0.97,
               tol: float = 0.05, min_trials: float = 100) -> List[Dict[str, Any]]:
    """One dict per (N, set, mode) with a ``graft`` row at concurrency 1.

    Args:
        rows: the bench JSON's ``rows`` (``method``, ``num_draft_tokens``, ``prompt_set``, ``mode``,
            ``concurrency``, ``tau``, ``grafted_accept_share``, ``calibration``).
        graft: the graft method compared (``graft_fixed``: N every round, as the peers).
        ratio, tol, min_trials: the targets and the calibration cells' minimum trials.
    Returns:
        ``[{"n", "set", "mode", "tau": {method: tau}, "ratio", "ratio_se", "ok", "grafted_share",
        "calibration": [{"source", "estimated", "observed", "trials", "se", "ok"}]}]`` sorted by (N, set,
        mode); ``ratio`` = graft's tau over the best of `BEST_OF` present (None when none is),
        ``ratio_se`` its standard error from both rows' `tau_se` (sampled cells; None otherwise).
    """
    cells: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        if r.get("concurrency") == 1 and r.get("num_draft_tokens"):
            cells.setdefault((r["num_draft_tokens"], r["prompt_set"], r["mode"]), {})[r["method"]] = r
    out = []
    for (n, s, m), by in sorted(cells.items()):
        g = by.get(graft)
        if g is None:
            continue
        peers = [by[k] for k in BEST_OF if k in by]
        best = max(peers, key=lambda r: r["tau"]) if peers else None
        rat = g["tau"] / best["tau"] if best is not None and best["tau"] > 0 else None
        rat_se = (None if rat is None or m != "sampled" else
                  rat * math.hypot(tau_se(g) / g["tau"], tau_se(best) / best["tau"]))
        cal = [{"source": src, "estimated": v["estimated"], "observed": v["observed"], "trials": v["trials"],
                "se": math.sqrt(v["observed"] * (1.0 - v["observed"]) / v["trials"]),
                "ok": abs(v["estimated"] - v["observed"]) <= tol}
               for src, v in sorted((g.get("calibration") or {}).items())
               if isinstance(v, dict) and v.get("trials", 0) >= min_trials and v.get("estimated") is not None]
        out.append({"n": n, "set": s, "mode": m, "tau": {k: v["tau"] for k, v in by.items()}, "ratio": rat,
                    "ratio_se": rat_se,
                    "ok": rat is not None and rat >= ratio, "grafted_share": g.get("grafted_accept_share") or 0.0,
                    "calibration": cal})
    return out


def peer_markdown(cells: Sequence[Dict[str, Any]], graft: str = "graft_fixed", ratio: float = 0.97) -> str:
    """The cells as a markdown table (sampled ratios +- two standard errors), then the counts of cells and
    calibration cells on target, how many missed cells are within two standard errors of
    ``ratio``, and each calibration miss (``estimated / observed (trials, 2 se)``)."""
    columns = _SHOWN + (graft,)
    names = " | ".join(c.replace("_", " ") for c in columns)
    lines = ["| N | set | mode | " + names + " | ratio ± 2 se | grafted share |",
             "|---" * (len(columns) + 5) + "|"]
    misses = []
    for c in cells:
        tau = [f"{c['tau'][k]:.2f}" if k in c["tau"] else "-" for k in columns]
        rat = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
        rat += "" if c["ratio_se"] is None else f" ± {2 * c['ratio_se']:.3f}"
        lines.append(f"| {c['n']} | {c['set']} | {c['mode']} | " + " | ".join(tau)
                     + f" | {rat} | {c['grafted_share']:.2f} |")
        misses += [f"{c['n']} {c['set']} {c['mode']} {k['source']}: {k['estimated']:.3f} / {k['observed']:.3f} "
                   f"({k['trials']:.0f} trials, 2 se {2 * k['se']:.3f})" for k in c["calibration"] if not k["ok"]]
    cal = [k for c in cells for k in c["calibration"]]
    missed = [c for c in cells if not c["ok"] and c["ratio"] is not None]
    near = sum(c["ratio_se"] is not None and c["ratio"] + 2 * c["ratio_se"] >= ratio for c in missed)
    lines += ["", f"cells on target: {sum(c['ok'] for c in cells)} of {len(cells)} "
                  f"(misses within two standard errors of {ratio}: {near} of {len(missed)}); "
                  f"calibration cells within tolerance: {sum(k['ok'] for k in cal)} of {len(cal)}"]
    return "\n".join(lines + [f"calibration miss: {m}" for m in misses])


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_patch.bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a JSON file written by python -m sglang_patch.bench")
    p.add_argument("--graft", default="graft_fixed", help="the graft method compared with its peers")
    p.add_argument("--ratio", type=float, default=0.97)
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--min-trials", type=float, default=100)
    a = p.parse_args(argv)
    with open(a.json) as f:
        payload = json.load(f)
    print(peer_markdown(peer_cells(payload["rows"], a.graft, a.ratio, a.tol, a.min_trials), a.graft, a.ratio))
    print(f"greedy outputs differing from no-spec: {payload.get('mismatches') or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
