"""``python -m sglang_patch.bench.peers BENCH.json``: issue 12's table from a benchmark's JSON.

For every (N, prompt set, mode) at concurrency 1: tau of each method, graft's tau over the best of
its peers that a user could run instead (EAGLE-3, SGLang's NGRAM, retrieval-only; pruned-only is
shown but is graft with retrieval off), graft's grafted share, and graft's calibration cells
(estimated vs observed acceptance per source, sampled seeds pooled) with at least ``--min-trials``
trials. The targets: ratio >= ``--ratio`` (0.97) in every cell, |estimated - observed| <= ``--tol``
(0.05) in every calibration cell. Reads the JSON `sglang_patch.bench` writes; runs nothing.

Example::

    python -m sglang_patch.bench.peers bench_out/issue12_quick.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Sequence

__all__ = ["BEST_OF", "peer_cells", "peer_markdown"]

#: The methods graft must match (the issue-12 criterion): what a user would run instead.
BEST_OF = ("eagle3", "ngram", "retrieval_only")
#: Methods shown before graft's own column (pruned-only: graft without retrieval, shown, not a peer).
_SHOWN = BEST_OF + ("pruned_only",)


def peer_cells(rows: Sequence[Dict[str, Any]], graft: str = "graft_fixed", ratio: float = 0.97,
               tol: float = 0.05, min_trials: float = 100) -> List[Dict[str, Any]]:
    """One dict per (N, set, mode) with a ``graft`` row at concurrency 1.

    Args:
        rows: the bench JSON's ``rows`` (``method``, ``num_draft_tokens``, ``prompt_set``, ``mode``,
            ``concurrency``, ``tau``, ``grafted_accept_share``, ``calibration``).
        graft: the graft method compared (``graft_fixed``: N every round, as the peers).
        ratio, tol, min_trials: the targets and the calibration cells' minimum trials.
    Returns:
        ``[{"n", "set", "mode", "tau": {method: tau}, "ratio", "ok", "grafted_share",
        "calibration": [{"source", "estimated", "observed", "trials", "ok"}]}]`` sorted by (N, set,
        mode); ``ratio`` = graft's tau over the best of `BEST_OF` present (None when none is).
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
        peers = [by[k]["tau"] for k in BEST_OF if k in by]
        rat = g["tau"] / max(peers) if peers and max(peers) > 0 else None
        cal = [{"source": src, "estimated": v["estimated"], "observed": v["observed"], "trials": v["trials"],
                "ok": abs(v["estimated"] - v["observed"]) <= tol}
               for src, v in sorted((g.get("calibration") or {}).items())
               if isinstance(v, dict) and v.get("trials", 0) >= min_trials and v.get("estimated") is not None]
        out.append({"n": n, "set": s, "mode": m, "tau": {k: v["tau"] for k, v in by.items()}, "ratio": rat,
                    "ok": rat is not None and rat >= ratio, "grafted_share": g.get("grafted_accept_share") or 0.0,
                    "calibration": cal})
    return out


def peer_markdown(cells: Sequence[Dict[str, Any]], graft: str = "graft_fixed") -> str:
    """The cells as a markdown table, then the counts of cells and calibration cells on target and
    each calibration miss (``estimated / observed (trials)``)."""
    columns = _SHOWN + (graft,)
    lines = ["| N | set | mode | " + " | ".join(c.replace("_", " ") for c in columns) + " | ratio | grafted share |",
             "|---" * (len(columns) + 5) + "|"]
    misses = []
    for c in cells:
        tau = [f"{c['tau'][k]:.2f}" if k in c["tau"] else "-" for k in columns]
        rat = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
        lines.append(f"| {c['n']} | {c['set']} | {c['mode']} | " + " | ".join(tau)
                     + f" | {rat} | {c['grafted_share']:.2f} |")
        misses += [f"{c['n']} {c['set']} {c['mode']} {k['source']}: {k['estimated']:.3f} / {k['observed']:.3f} "
                   f"({k['trials']:.0f} trials)" for k in c["calibration"] if not k["ok"]]
    cal = [k for c in cells for k in c["calibration"]]
    lines += ["", f"cells on target: {sum(c['ok'] for c in cells)} of {len(cells)}; "
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
    print(peer_markdown(peer_cells(payload["rows"], a.graft, a.ratio, a.tol, a.min_trials), a.graft))
    print(f"greedy outputs differing from no-spec: {payload.get('mismatches') or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
