"""``python -m sglang_patch.bench.paired``: tokens/s of several servers in paired, alternating windows.

`sglang_patch.bench` sends each prompt set once per method: one cell is a few seconds of traffic,
and on a shared 2-core machine the speed moves between minutes by more than the differences
between methods. This tool
resolves smaller differences. Every method's server is up at once; the same steady load (``c``
requests always in flight, ``--max-tokens`` each, ``ignore_eos``, prompts cycled from one set) is
sent to one server for a window of ``--window-s`` seconds while the others are paused (SIGSTOP:
on two cores an idle server's threads take time slices from the measured one), then to the next,
the order reversed in every other repetition (ABBA); tokens/s is the tokens generated inside the window (`window_tokens`:
every request's tokens spread evenly over its lifetime, so a request that straddles an edge counts
for its share) over the window's length. Windows of one repetition form a pair; each method's ratio
to the reference (``nospec``) is taken per pair, and the median over the pairs is reported next to
its range.

Not SGLang's ``sglang:generation_tokens_total``: that counter grows when a request *finishes*
(``TokenizerManager`` -> ``observe_one_finished_request``, metrics_collector.py:2092), so a window
counted whole requests. At concurrency 1 (64 tokens, ~1.4 s a request) a 10 s window held 7 of them
for either server, and a 10% slower server would read the same tokens/s.

Methods: ``nospec`` and ``graft_plain``, graft whose batch budget runs every decode round at width
1 (``batch_budget.schedule [1]``): the floor the budget reaches when it steps aside, i.e. what a
plain round costs over SGLang's own decode step. Speculative methods are left to
`sglang_patch.bench`: a steady load cycles the prompt set and repeats prompts, whose answers
retrieval would then find, while a plain round's cost does not depend on the text.

Example (the shipped pair; what a plain round costs at concurrency 1 and 8)::
    python -m sglang_patch.bench.paired --target models/default/target --draft models/default/draft \\
        --methods nospec graft_plain --concurrency 1 8 --json bench_out/paired.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import httpx

from sglang_patch.bench.methods import MethodSpec, interleave_order
from sglang_patch.bench.prompts import load_prompts
from sglang_patch.bench.report import write_json
from sglang_patch.launcher import SGLangServer, alone, start_all

#: the extra method of this tool: graft with every decode round plain (verify width 1)
PLAIN = "graft_plain"
_PLAIN_ENV = {"GRAFTCFG_BATCH_BUDGET__SCHEDULE": "[1]"}


def window_tokens(requests: Sequence[Tuple[float, float, int]], t0: float, t1: float) -> float:
    """Tokens generated inside the window ``[t0, t1]``.

    Each request's tokens are spread evenly over its lifetime, so a request contributes
    ``tokens * overlap / lifetime``; the same for every server, this puts the window's edges inside
    requests instead of rounding them to whole requests. Its error is the unevenness within one
    request at each edge (its prefill: under a tenth of a 64-token request's time here).

    Args:
        requests: ``(start, end, tokens)`` per request, ``start``/``end`` in seconds on the clock of
            ``t0``/``t1``, ``tokens`` its completion tokens.
        t0, t1: the window, seconds.
    Returns:
        Tokens (float).
    Raises:
        ValueError: ``t1 <= t0``, or a request ends before it starts.
    """
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1}]")
    total = 0.0
    for start, end, tokens in requests:
        if end < start:
            raise ValueError(f"request ends ({end}) before it starts ({start})")
        overlap = min(end, t1) - max(start, t0)
        if overlap > 0:
            total += tokens * overlap / (end - start)
    return total


def paired_ratios(windows: Sequence[Dict[str, Any]], reference: str = "nospec") -> Dict[str, Dict[str, Any]]:
    """Per cell (mode and concurrency) and method, the ratios of its tokens/s to ``reference``'s in
    the same repetition (a pair), their median, min and max, and the medians of tokens/s.

    Args:
        windows: rows ``{"method", "concurrency", "rep", "tokens_per_s"}`` and optionally ``"mode"``
            (``"greedy"`` when absent).
    Returns:
        ``{"<mode> c<concurrency>": {method: {"ratios", "median_ratio", "min_ratio", "max_ratio",
        "median_tokens_per_s"}}}`` (the reference has no ratio fields).
    Raises:
        ValueError: a (mode, concurrency, rep) has a method window but no reference window.
    """
    def cell_of(w):
        return (w.get("mode", "greedy"), int(w["concurrency"]))

    by = {(cell_of(w), w["rep"], w["method"]): float(w["tokens_per_s"]) for w in windows}
    out: Dict[str, Dict[str, Any]] = {}
    for key in sorted({cell_of(w) for w in windows}, key=lambda k: (k[0] != "greedy", k[1])):
        cell: Dict[str, Any] = {}
        for m in dict.fromkeys(w["method"] for w in windows if cell_of(w) == key):
            reps = sorted(r for (kk, r, mm) in by if kk == key and mm == m)
            row: Dict[str, Any] = {"median_tokens_per_s": round(statistics.median(by[(key, r, m)] for r in reps), 3)}
            if m != reference:
                missing = [r for r in reps if (key, r, reference) not in by]
                if missing:
                    raise ValueError(f"{key[0]} c{key[1]}: repetitions {missing} have {m} but no {reference} window")
                ratios = [by[(key, r, m)] / max(by[(key, r, reference)], 1e-9) for r in reps]
                row.update(ratios=[round(x, 4) for x in ratios], median_ratio=round(statistics.median(ratios), 4),
                           min_ratio=round(min(ratios), 4), max_ratio=round(max(ratios), 4))
            cell[m] = row
        out[f"{key[0]} c{key[1]}"] = cell
    return out


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_patch.bench.paired", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--methods", nargs="+", default=["nospec", PLAIN], choices=["nospec", PLAIN])
    p.add_argument("--budget", type=int, default=24, help="verify budget N of the speculative methods")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--prompts", default="data/humaneval_dev.jsonl", help="JSONL prompt set, cycled")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"],
                   help="greedy: temperature 0; sampled: temperature 0.8, top-p 0.95")
    p.add_argument("--reps", type=int, default=4, help="pairs (repetitions) per concurrency")
    p.add_argument("--window-s", type=float, default=10.0, help="measured seconds per window")
    p.add_argument("--settle-s", type=float, default=3.0, help="seconds of load before a window's clock starts")
    p.add_argument("--server-args", default="--dtype float32 --max-running-requests 32")
    p.add_argument("--json", default="bench_out/paired.json")
    a = p.parse_args(argv)
    if "nospec" not in a.methods:
        p.error("--methods: nospec is the reference of every pair")
    return a


def _window(url: str, texts: Sequence[str], concurrency: int, params: Dict[str, Any], settle_s: float,
            window_s: float) -> float:
    """Tokens/s of ``url`` over ``window_s`` seconds with ``concurrency`` requests always in flight
    (`window_tokens`; the requests in flight at the window's end are waited for)."""
    stop = threading.Event()
    requests: List[Tuple[float, float, int]] = []   # (start, end, tokens); list.append is atomic

    def loop(i: int) -> None:
        with httpx.Client(timeout=600.0) as client:
            k = i
            while not stop.is_set():
                body = {"text": texts[k % len(texts)], "sampling_params": params}
                start = time.perf_counter()
                r = client.post(f"{url}/generate", json=body)
                r.raise_for_status()
                requests.append((start, time.perf_counter(), int(r.json()["meta_info"]["completion_tokens"])))
                k += concurrency

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(loop, i) for i in range(concurrency)]
        try:
            time.sleep(settle_s)
            t0 = time.perf_counter()
            time.sleep(window_s)
            t1 = time.perf_counter()
        finally:
            stop.set()
        for f in futures:
            f.result()
    return window_tokens(requests, t0, t1) / (t1 - t0)


def main(argv: List[str] | None = None) -> int:
    """Run the paired windows; print the summary and write the JSON (``args``, ``windows``, ``pairs``)."""
    a = _parse(sys.argv[1:] if argv is None else argv)
    texts = [p.text for p in load_prompts(a.prompts)]
    by_mode = {"greedy": {"max_new_tokens": a.max_tokens, "temperature": 0.0, "ignore_eos": True},
               "sampled": {"max_new_tokens": a.max_tokens, "temperature": 0.8, "top_p": 0.95, "ignore_eos": True}}
    work = Path(tempfile.mkdtemp(prefix="graft_paired_"))
    windows: List[Dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for m in a.methods:
            spec = MethodSpec("graft" if m == PLAIN else m, m, None if m == "nospec" else a.budget,
                              a.depth, a.topk, a.draft)
            args = spec.server_args() + a.server_args.split()
            servers[m] = SGLangServer(a.target, args, env=_PLAIN_ENV if m == PLAIN else {},
                                      log_path=str(work / f"{m}.log"))
            stack.callback(servers[m].stop)
        everyone = start_all(list(servers.values()))   # at once: their starts overlap
        for srv in everyone:   # warm up: compiled paths, first-use allocations, in every mode
            with alone(srv, everyone):
                for mode in a.modes:
                    _window(srv.url, texts, 4, by_mode[mode], a.settle_s, a.window_s / 2)
        for mode in a.modes:
            for c in a.concurrency:
                for rep in range(a.reps):
                    for m, srv in interleave_order(list(servers.items()), rep):
                        with alone(srv, everyone):   # the others paused: they steal no time slices
                            tps = _window(srv.url, texts, c, by_mode[mode], a.settle_s, a.window_s)
                        windows.append({"method": m, "mode": mode, "concurrency": c, "rep": rep,
                                        "tokens_per_s": round(tps, 3)})
                        print(f"{mode} c={c} rep={rep} {m}: {tps:.1f} tokens/s", flush=True)
    pairs = paired_ratios(windows)
    write_json(Path(a.json), {"args": vars(a), "windows": windows, "pairs": pairs})
    for c, cell in pairs.items():
        for m, row in cell.items():
            if "median_ratio" in row:
                print(f"{c} {m}/nospec: median {row['median_ratio']:.3f} "
                      f"(range {row['min_ratio']:.3f}-{row['max_ratio']:.3f}, {len(row['ratios'])} pairs)")
    print(f"JSON: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
