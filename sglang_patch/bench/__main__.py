"""``python -m sglang_patch.bench``: Graft against every peer at the same verify budget, on real servers.

For every method and budget N (methods.py) one SGLang server runs at a time (2-core machines cannot
hold more); every prompt set is sent in every mode at every concurrency:

* ``greedy``: temperature 0, every output compared with the no-speculation server's (a mismatch
  fails the run, exit code 1);
* ``sampled``: temperature 0.8, top-p 0.95, one run per seed (``--seeds``; SGLang's
  ``sampling_seed``), figures averaged over the seeds.

Rows report tau (accepted tokens per verify step, bonus included), verified tokens per step,
tokens/s and its ratios against no-spec and every peer at the same (set, mode, concurrency, N), the
grafted share, and for graft servers the calibration of that run (estimated vs observed acceptance per
source, from ``/server_info``). A text-quality line per prompt set (non-whitespace share and
distinct-4-gram ratio of the no-spec completions, greedy and sampled) says when figures come from
looping text. Output: one JSON file, PNG plots next to it, a markdown table on stdout.

Example (the quick models, both prompt sets)::
    python -m sglang_patch.bench --target models/quick/target --draft models/quick/draft \\
        --topk 4 --depth 5 --budgets 24 60 --json bench_out/quick.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import httpx
from tqdm import tqdm

from graft_spec.budget import size_bucket
from sglang_patch.bench.client import run_prompts_sync, sampling_params
from sglang_patch.bench.methods import METHODS, STAGE_THRESHOLDS, MethodSpec, build_methods, interleave_order
from sglang_patch.bench.prompts import load_prompts, split_warmup
from sglang_patch.bench.report import (add_ratios, calibration_delta, equal_outputs, markdown_table, merge_calibration,
                                       sum_histograms, summarize, text_quality, write_json, write_plots)
from sglang_patch.launcher import SGLangServer, alone, start_all

SAMPLED = {"temperature": 0.8, "top_p": 0.95}


#: the default prompt sets: bare name on the command line -> NAME=JSONL
_DEFAULT_SETS = {"code": "code=data/humaneval_dev.jsonl", "chat": "chat=data/mtbench_dev.jsonl"}


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_patch.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="models/default/target", help="target model directory")
    p.add_argument("--draft", default="models/default/draft", help="EAGLE-3 draft head directory")
    p.add_argument("--prompt-sets", nargs="+", default=list(_DEFAULT_SETS.values()),
                   help="NAME=JSONL (lines with 'prompt' or 'turns'; chat turns use the target's chat template), "
                        "or a default set's bare name (%s)" % ", ".join(_DEFAULT_SETS))
    p.add_argument("--num-prompts", type=int, default=16, help="prompts taken from each set")
    p.add_argument("--warmup-prompts", type=int, default=4,
                   help="held-out prompts per set (the set's last ones) sent in every mode before a server is measured")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--methods", nargs="+", default=[m for m in METHODS if m != "graft_paper"], choices=METHODS)
    p.add_argument("--budgets", type=int, nargs="+", default=[24, 60], help="verify budgets N")
    p.add_argument("--depth", type=int, default=7, help="draft steps (EAGLE-3 and graft)")
    p.add_argument("--topk", type=int, default=10, help="draft top-k (EAGLE-3 and graft)")
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="sampling seeds (sampled mode)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--thresholds", type=float, nargs=3, default=list(STAGE_THRESHOLDS), metavar=("T1", "T2", "T3"),
                   help="graft_paper checkpoint thresholds at depths 1, 2 and depth-1")
    p.add_argument("--server-args", default="--dtype float32 --max-running-requests 32",
                   help="extra args for every server (one string; float32 keeps equality exact on CPU)")
    p.add_argument("--interleave", action="store_true",
                   help="hold every method's server up at once and run each (set, mode, concurrency, seed) on "
                        "all of them back to back (the order reversed every other run), the servers not being "
                        "measured paused (SIGSTOP), instead of one server after another: this machine's speed "
                        "drifts by a quarter between minutes, which a sequential run reads as a method's ratio "
                        "(memory: one server per method and N)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every cell on every server; with --interleave the server order is reversed "
                        "between them (ABC then CBA), so each cell's ratio does not depend on which server ran "
                        "first. Rates are averaged over the repeats; each repeat's ratios are in `per_repeat`")
    p.add_argument("--json", default="bench_out/bench.json", help="output JSON path (plots beside it)")
    a = p.parse_args(argv)
    a.prompt_sets = [_DEFAULT_SETS.get(spec, spec) for spec in a.prompt_sets]
    for spec in a.prompt_sets:
        name, eq, path = spec.partition("=")
        if not (name and eq and path):
            p.error(f"--prompt-sets: {spec!r} is neither NAME=JSONL nor one of {sorted(_DEFAULT_SETS)}")
    return a


def _render_chat(target: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)

    def render(msg: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                       add_generation_prompt=True)

    return render, tok


def _graft_state(url: str) -> Optional[Dict[str, Any]]:
    """The graft worker's cumulative statistics (``/server_info``), or None for other servers."""
    info = httpx.get(f"{url}/server_info", timeout=60).json()
    return info["internal_states"][0].get("graft", {}).get("worker")


def main(argv: List[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code (1 when any greedy output differs)."""
    a = _parse(sys.argv[1:] if argv is None else argv)
    render, tok = _render_chat(a.target)
    sets, warmup = {}, {}
    for spec in a.prompt_sets:
        name, _, path = spec.partition("=")
        sets[name], warmup[name] = split_warmup(load_prompts(path, None, render), a.num_prompts, a.warmup_prompts)
    methods: List[MethodSpec] = build_methods(a.methods, a.budgets, a.depth, a.topk, a.draft, a.thresholds)
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: must be >= 1")
    runs = [(s, m, c, seed, k) for s in sets for m in a.modes for c in a.concurrency
            for seed in (a.seeds if m == "sampled" else [None]) for k in range(a.repeats)]
    out = Path(a.json)
    work = Path(tempfile.mkdtemp(prefix="graft_bench_"))
    rows: List[Dict[str, Any]] = []
    reference: Dict[str, List[List[int]]] = {}
    quality: Dict[str, Dict[str, Any]] = {}
    mismatches: List[str] = []
    bar = tqdm(total=len(methods) * len(runs), desc="bench", unit="run")
    per_cell: Dict[tuple, List[Dict[str, Any]]] = {}

    def measure(server: "_Server", run: tuple) -> None:
        set_name, mode, c, seed, repeat = run
        spec, srv = server.spec, server.srv
        bar.set_postfix_str(f"{spec.label} {set_name} {mode} c={c}")
        params = sampling_params(a.max_tokens, **(SAMPLED if mode == "sampled" else {}))
        if seed is not None:
            params["sampling_seed"] = seed
        flushed = set_name in server.sent
        if flushed:  # these prompts' answers are in the server's caches: forget them first
            _flush(srv.url)
            _warm_up_mode(srv.url, warmup[set_name], mode, a)
        server.sent.add(set_name)
        before = _graft_state(srv.url)
        result = run_prompts_sync(srv.url, sets[set_name], c, params)
        after = _graft_state(srv.url)
        row = {"method": spec.method, "label": spec.label, "num_draft_tokens": spec.num_draft_tokens,
               "prompt_set": set_name, "mode": mode, "concurrency": c, "seed": seed, "repeat": repeat,
               "startup_s": srv.startup_s, "flushed": flushed, **summarize(result, spec.num_draft_tokens or 1)}
        if before is not None and after is not None:
            row["calibration"] = calibration_delta(before, after)
            row["draft_forwards"] = {k: after["draft_forwards"][k] - before["draft_forwards"][k]
                                     for k in after["draft_forwards"]}
            widths = _width_rounds(before, after)
            if widths:  # the batch budget: the mean width it verified per request and round
                row["verify_widths"] = widths
                row["verified_tokens_per_step"] = sum(int(w) * k for w, k in widths.items()) / sum(widths.values())
            row["budget"] = _budget_view(before, after, c)
        outputs = [r.output_ids for r in result.results]
        if spec.method == "nospec" and c == min(a.concurrency):
            if mode == "greedy":
                reference[set_name] = outputs
            if seed in (None, a.seeds[0]):
                quality.setdefault(set_name, {})[mode] = text_quality(outputs, tok)
        elif spec.method != "nospec" and mode == "greedy":
            server.greedy.append((set_name, c, outputs, row))
        per_cell.setdefault((spec.label, set_name, mode, c), []).append(row)
        bar.update(1)

    def server_of(spec: MethodSpec, stack: contextlib.ExitStack) -> SGLangServer:
        args = spec.server_args() + (a.server_args.split() if a.server_args else [])
        srv = SGLangServer(a.target, args, log_path=str(work / f"{spec.label}.log"))
        stack.callback(srv.stop)
        return srv

    def start(spec: MethodSpec, stack: contextlib.ExitStack) -> "_Server":
        bar.set_postfix_str(f"{spec.label}: starting server")
        srv = server_of(spec, stack).start()
        _warm_up(srv.url, warmup, sets, a)
        return _Server(spec, srv)

    servers: List[_Server] = []
    if a.interleave:
        with contextlib.ExitStack() as stack:
            bar.set_postfix_str(f"starting {len(methods)} servers")
            everyone = start_all([server_of(spec, stack) for spec in methods])   # at once: starts overlap
            servers = [_Server(spec, srv) for spec, srv in zip(methods, everyone)]
            for server in servers:
                with alone(server.srv, everyone):
                    _warm_up(server.srv.url, warmup, sets, a)
            for i, run in enumerate(runs):
                for server in interleave_order(servers, i):
                    with alone(server.srv, everyone):   # the others paused: they steal no time slices
                        measure(server, run)
    else:
        for spec in methods:
            with contextlib.ExitStack() as stack:
                server = start(spec, stack)
                servers.append(server)
                for run in runs:
                    measure(server, run)
    for server in servers:   # greedy outputs against no-spec's (known once every server has run)
        for set_name, c, outputs, row in server.greedy:
            if set_name in reference:
                bad = equal_outputs(reference[set_name], outputs)
                row["outputs_equal_nospec"] = bad is None
                if bad is not None:
                    mismatches.append(f"{server.spec.label} {set_name} c={c}: prompt {sets[set_name][bad].pid}")
    for group in per_cell.values():   # one row per cell, averaged over the seeds and repeats
        rows.append(_mean_row(group) if len(group) > 1 else group[0])
    bar.close()
    add_ratios(rows)
    if a.repeats > 1:
        _add_per_repeat(rows, per_cell)
    payload = {"args": vars(a), "num_prompts": {k: len(v) for k, v in sets.items()},
               "warmup_prompts": {k: [p.pid for p in v] for k, v in warmup.items()}, "text_quality": quality,
               "rows": rows, "mismatches": mismatches}
    write_json(out, payload)
    plots = write_plots(rows, out.parent, stem=out.stem)
    print(markdown_table(rows))
    print(f"\nJSON: {out}\nplots: {', '.join(plots)}")
    if mismatches:
        print("GREEDY OUTPUT MISMATCH vs no-spec: " + "; ".join(mismatches), file=sys.stderr)
        return 1
    return 0


@dataclass
class _Server:
    """One method's running server in a benchmark: its spec, its `SGLangServer` (``startup_s``: the
    seconds it took to start), the prompt sets it was sent (`_flush`) and its greedy rows waiting for
    the no-spec check."""

    spec: MethodSpec
    srv: Any
    sent: set = field(default_factory=set)
    greedy: List[tuple] = field(default_factory=list)


def _warm_up(url: str, warmup: Dict[str, list], sets: Dict[str, list], a: argparse.Namespace) -> None:
    """Send every set's held-out warm-up prompts (`split_warmup`) once in every measured mode
    (sampled: seed ``max(seeds) + 1``, not a measured one) at concurrency 1, then the measured runs
    start from a warm server: its calibration past the priors in both modes (the issue-12 criterion
    is calibration *after warm-up*), its retrieval indexes holding traffic that is not the measured
    prompts' answers. Every method's server gets the same warm-up. Without held-out prompts
    (``--warmup-prompts 0``) two short greedy requests still compile the server's paths. Then one
    short wave at every measured concurrency above 1 (prompts cycled; 16 tokens each) brings every
    batch size's first-use cost forward."""
    if not any(warmup.values()):
        run_prompts_sync(url, next(iter(sets.values()))[:2], 1, sampling_params(16))
    else:
        for prompts in warmup.values():
            for mode in a.modes:
                _warm_up_mode(url, prompts, mode, a)
    # every measured batch size once: SGLang compiles its draft top-k step (torch.compile,
    # spec_utils.py:437) again the first time a batch holds more than one request, seconds on a CPU
    # that would otherwise land in the first measured cell of that concurrency
    pool = [p for prompts in warmup.values() for p in prompts] or next(iter(sets.values()))[:2]
    for c in sorted(set(a.concurrency) - {1}):
        run_prompts_sync(url, [pool[i % len(pool)] for i in range(c)], c, sampling_params(16))


def _warm_up_mode(url: str, prompts: list, mode: str, a: argparse.Namespace) -> None:
    """Send held-out warm-up ``prompts`` once in ``mode`` at concurrency 1 (sampled: seed
    ``max(seeds) + 1``); nothing when there are none."""
    if not prompts:
        return
    params = sampling_params(a.max_tokens, **(SAMPLED if mode == "sampled" else {}))
    if mode == "sampled":
        params["sampling_seed"] = max(a.seeds) + 1
    run_prompts_sync(url, prompts, 1, params)


def _flush(url: str, tries: int = 20) -> None:
    """SGLang's ``/flush_cache`` before a run that repeats a prompt set this server was already
    sent (another mode, seed or concurrency): the radix cache and what speculation keeps of earlier
    requests' text (NGRAM's trie, graft's output index and successor table) are forgotten, so a
    repeated prompt's answer is not retrieved from the run before. The calibration and the batch
    budget's timings stay (statistics, not text). The scheduler flushes only when idle; a refusal
    is retried.

    Raises:
        RuntimeError: the server refused every try.
    """
    for _ in range(tries):
        r = httpx.post(f"{url}/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(f"/flush_cache refused {tries} times: {r.status_code} {r.text[:200]}")


def _count_delta(before: Dict[str, Any], after: Dict[str, Any], field: str) -> Dict[str, float]:
    """The positive key-wise growth of the count dict ``field`` between two ``/server_info`` views
    (keys that did not grow left out)."""
    b = before.get(field) or {}
    grown = {k: v - b.get(k, 0) for k, v in (after.get(field) or {}).items()}
    return {k: v for k, v in grown.items() if v > 0}


def _width_rounds(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, int]:
    """Decode rounds per verify width during one run (``/server_info`` ``verify_widths`` delta)."""
    return _count_delta(before, after, "verify_widths")


def _budget_view(before: Dict[str, Any], after: Dict[str, Any], concurrency: int) -> Optional[Dict[str, Any]]:
    """What the batch budget did during one run: its rounds per reason (``explore``, ``best``, ...;
    `BatchBudget.summary` delta) and, for the batch-size buckets (`size_bucket`) a run at
    ``concurrency`` reaches, the round times (ms per width) it priced with before and after the run,
    its corrections and the deferred catch-up charged per plain round, and the tokens emitted and wall
    seconds spent per width during the run (their ratio: what each width's rounds realised). None for a
    server without a budget."""
    b, a = before.get("batch_budget") or {}, after.get("batch_budget") or {}
    if "rounds_by_reason" not in a:
        return None
    delta = functools.partial(_count_delta, b, a)
    buckets = {str(size_bucket(n)) for n in range(1, max(1, concurrency) + 1)}
    return {"rounds_by_reason": delta("rounds_by_reason"),
            "round_ms_before": {k: v for k, v in (b.get("round_ms") or {}).items() if k in buckets},
            "round_ms": {k: v for k, v in (a.get("round_ms") or {}).items() if k in buckets},
            "correction": a.get("correction"),
            "width_correction": {k: v for k, v in (a.get("width_correction") or {}).items()
                                 if k.split("x")[0] in buckets},
            "catch_up_ms_per_plain_round": {k: v for k, v in (a.get("catch_up_ms_per_plain_round") or {}).items()
                                            if k in buckets},
            "cost_model": a.get("cost_model"),
            "tokens_by_width": delta("tokens_by_width"),
            "seconds_by_width": {k: round(v, 3) for k, v in delta("seconds_by_width").items()},
            "tokens_by_bucket_width": delta("tokens_by_bucket_width"),
            "seconds_by_bucket_width": {k: round(v, 3) for k, v in delta("seconds_by_bucket_width").items()}}


def _add_per_repeat(rows: List[Dict[str, Any]], per_cell: Dict[tuple, List[Dict[str, Any]]]) -> None:
    """``per_repeat`` on every row: its cell's ratios (`add_ratios`) computed within each repeat apart,
    {"tokens_per_s": [...], "speedup_vs_nospec": [...], "vs_best_fixed": [...] (graft rows)}, in
    repeat order: the spread of one cell's ratio between runs a few minutes apart."""
    repeats = sorted({g["repeat"] for group in per_cell.values() for g in group})
    by_repeat = []
    for k in repeats:
        rk = [_mean_row(part) if len(part) > 1 else part[0]
              for part in ([g for g in group if g["repeat"] == k] for group in per_cell.values()) if part]
        add_ratios(rk)
        by_repeat.append({(r["label"], r["prompt_set"], r["mode"], r["concurrency"]): r for r in rk})
    for r in rows:
        key = (r["label"], r["prompt_set"], r["mode"], r["concurrency"])
        got = [b[key] for b in by_repeat if key in b]
        r["per_repeat"] = {f: [x.get(f) for x in got] for f in ("tokens_per_s", "speedup_vs_nospec", "vs_best_fixed")
                           if any(x.get(f) is not None for x in got)}


def _mean_row(group: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row for a (set, mode, concurrency) run more than once (sampling seeds, ``--repeats``):
    rates and ``output_tokens`` averaged over the runs; ``verify_steps``, ``accept_hist``, rounds per
    width (``verify_widths``), draft forwards and the budget's rounds, tokens and seconds per reason and
    width summed; the budget's prices as after the last run; ``outputs_equal_nospec`` only if every
    run's were; each run's tau in ``tau_per_seed``, its seed in ``seed`` and its repeat in ``repeat``."""
    row = dict(group[0])
    row["seed"] = [g["seed"] for g in group]
    row["repeat"] = [g.get("repeat", 0) for g in group]
    row["tau_per_seed"] = [g["tau"] for g in group]
    for key in ("tau", "tokens_per_s", "wall_s", "mean_latency_s", "output_tokens", "verified_tokens_per_step"):
        row[key] = sum(g[key] for g in group) / len(group)
    row["verify_steps"] = sum(g["verify_steps"] for g in group)
    row["accept_hist"] = sum_histograms(g["accept_hist"] for g in group)
    shares = [g["grafted_accept_share"] for g in group if g.get("grafted_accept_share") is not None]
    row["grafted_accept_share"] = sum(shares) / len(shares) if shares else None
    if "calibration" in row:
        row["calibration"] = merge_calibration([g["calibration"] for g in group])
    if any("outputs_equal_nospec" in g for g in group):   # equal only if every run's outputs were
        row["outputs_equal_nospec"] = all(g.get("outputs_equal_nospec", True) for g in group)
    for key in ("verify_widths", "draft_forwards"):
        if key in row:
            row[key] = _sum_counts(g.get(key) for g in group)
    if row.get("budget"):
        row["budget"] = dict(group[-1]["budget"])
        for key in ("rounds_by_reason", "tokens_by_width", "seconds_by_width", "tokens_by_bucket_width",
                    "seconds_by_bucket_width"):
            row["budget"][key] = _sum_counts((g.get("budget") or {}).get(key) for g in group)
    return row


def _sum_counts(dicts) -> Dict[str, float]:
    """Key-wise sum of count dicts (None entries skipped)."""
    total: Counter = Counter()
    for d in dicts:
        total.update(d or {})
    return dict(total)


if __name__ == "__main__":
    sys.exit(main())
