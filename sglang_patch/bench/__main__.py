"""``python -m sglang_patch.bench``: no-spec vs EAGLE3 vs pruned-only vs retrieval-only vs Graft.

For every method and budget N one SGLang server runs at a time (2-core machines cannot hold more);
each prompt set is sent at every concurrency; greedy outputs of every speculative server are
compared with the no-speculation server's (a mismatch fails the run, exit code 1).
Output: one JSON file, PNG plots next to it, and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from tqdm import tqdm

from sglang_patch.bench.client import run_prompts_sync, sampling_params
from sglang_patch.bench.methods import STAGE_THRESHOLDS, MethodSpec, build_methods
from sglang_patch.bench.prompts import load_prompts
from sglang_patch.bench.report import add_ratios, equal_outputs, markdown_table, summarize, write_json, write_plots


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_patch.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="models/default/target", help="target model directory")
    p.add_argument("--draft", default="models/default/draft", help="EAGLE-3 draft head directory")
    p.add_argument("--prompts", nargs="+", default=["data/humaneval_dev.jsonl"],
                   help="JSONL prompt files (lines with 'prompt' or 'turns')")
    p.add_argument("--num-prompts", type=int, default=20, help="prompts taken from each file")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", nargs="+",
                   default=["nospec", "eagle3_dense", "eagle3", "pruned_only", "retrieval_only", "graft"])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 24, 40, 60], help="verify budgets N")
    p.add_argument("--dense-n", type=int, default=60, help="N of the EAGLE3-dense reference")
    p.add_argument("--depth", type=int, default=7, help="draft steps of the dense reference")
    p.add_argument("--topk", type=int, default=10, help="top-k of the dense reference")
    p.add_argument("--thresholds", type=float, nargs=3, default=list(STAGE_THRESHOLDS),
                   metavar=("T1", "T2", "T_LAST"),
                   help="pruning thresholds at depths 1, 2 and depth-1 (default: %(default)s, the "
                        "8B-head values; scripts/calibrate_checkpoints.py prints a model's own)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--graft-config", default=None, help="base GraftConfig file for the graft variants")
    p.add_argument("--server-args", default="--dtype float32 --max-running-requests 16",
                   help="extra args for every server (one string; float32 keeps equality exact on CPU)")
    p.add_argument("--json", default="bench_out/bench.json", help="output JSON path (plots beside it)")
    return p.parse_args(argv)


def _render_chat(target: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)

    def render(msg: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                       add_generation_prompt=True)

    return render


def _draft_steps(url: str) -> Dict[str, int] | None:
    """Graft worker's cumulative eager draft forwards {run, skipped} (``/server_info``), or None."""
    import httpx

    info = httpx.get(f"{url}/server_info", timeout=30).json()
    stats = info["internal_states"][0].get("graft", {})  # sglang_patch.server_stats
    worker = stats.get("worker", {})  # only graft servers have one
    steps = worker.get("draft_steps")
    return dict(steps) if steps is not None else None


def main(argv: List[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code (1 when any greedy output differs)."""
    from sglang_patch.launcher import SGLangServer

    a = _parse(sys.argv[1:] if argv is None else argv)
    render = _render_chat(a.target)
    prompts = [p for f in a.prompts for p in load_prompts(f, a.num_prompts, render)]
    params = sampling_params(a.max_tokens)
    methods: List[MethodSpec] = build_methods(a.methods, a.budgets, a.dense_n, a.depth, a.topk,
                                              a.draft, a.graft_config, a.thresholds)
    out = Path(a.json)
    work = Path(tempfile.mkdtemp(prefix="graft_bench_"))
    rows: List[Dict[str, Any]] = []
    reference: Dict[int, List[List[int]]] = {}
    mismatches: List[str] = []
    total = len(methods) * len(a.concurrency)
    bar = tqdm(total=total, desc="bench", unit="run")
    for m in methods:
        args = m.server_args(work) + (a.server_args.split() if a.server_args else [])
        bar.set_postfix_str(f"{m.label}: starting server")
        srv = SGLangServer(a.target, args, log_path=str(work / f"{m.label}.log"))
        t_start = time.perf_counter()
        with srv:
            startup = time.perf_counter() - t_start
            run_prompts_sync(srv.url, prompts[:2], 1, params)  # warm-up
            for c in a.concurrency:
                bar.set_postfix_str(f"{m.label} c={c}")
                before = _draft_steps(srv.url)
                run = run_prompts_sync(srv.url, prompts, c, params)
                after = _draft_steps(srv.url)
                row = {"method": m.method, "label": m.label, "num_draft_tokens": m.num_draft_tokens,
                       "concurrency": c, "startup_s": startup, **summarize(run, m.num_draft_tokens or 1)}
                if before is not None and after is not None:
                    row["draft_forwards"] = {k: after[k] - before[k] for k in after}
                outputs = [r.output_ids for r in run.results]
                if m.method == "nospec":
                    reference[c] = outputs
                elif c in reference or 1 in reference:
                    bad = equal_outputs(reference.get(c, reference.get(1)), outputs)
                    row["outputs_equal_nospec"] = bad is None
                    if bad is not None:
                        mismatches.append(f"{m.label} c={c}: prompt {prompts[bad].pid}")
                rows.append(row)
                bar.update(1)
    bar.close()
    add_ratios(rows)
    payload = {"args": vars(a), "num_prompts": len(prompts), "rows": rows, "mismatches": mismatches}
    write_json(out, payload)
    plots = write_plots(rows, out.parent)
    print(markdown_table(rows))
    print(f"\nJSON: {out}\nplots: {', '.join(plots)}")
    if mismatches:
        print("GREEDY OUTPUT MISMATCH vs no-spec: " + "; ".join(mismatches), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
