#!/usr/bin/env python
"""The per-round graft step on a CUDA device: eager launch cost vs one CUDA-graph replay.

    python scripts/bench_step_cuda.py --json bench_out/step_cuda.json [--batches 1,16,64] [--nodes 24,60]

For each (batch B, budget N) the same `GraftPlanner` (default config: calibrated expected-gain
selection, successor table, device lookup, host suffix candidates; Qwen3 vocabulary 151936) runs

* ``eager``: `GraftPlanner.build` + `GraftPlanner.observe` called from Python, as SGLang's worker runs
  them after the draft graph (wall time per round with a device synchronise at the end; this is the
  launch-bound cost the GPU sees when nothing else hides it);
* ``graphs``: what the worker runs on CUDA: `graft_spec.graphs.StepGraphs` replays ``build`` from a
  CUDA graph (input copies, one replay, output clones) and ``observe`` runs eagerly (wall time per
  round with a synchronise). Capture succeeding is itself the check that the step has no host read,
  no host-to-device copy of a fresh Python value and no data-dependent shape; every replayed tree
  is compared with an eager build of the same inputs;
* ``host_side``: the host work that runs off the critical path (suffix proposals + buffer fill for
  the batch, CPU wall time), overlapped with drafting on a GPU.

Rows also carry the number of kernels one replay runs (from the profiler) and the trees' equality.
Needs a CUDA device (exit 2 without one; ``--device cpu`` is an eager-only dry run). Figures: docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graft_spec.graphs import StepGraphs  # noqa: E402
from graft_spec.pipeline import on_path_from_accept_index  # noqa: E402
from graft_spec.step import dense_draft_candidates  # noqa: E402
from sglang_patch.bench.step import dense_lists, workload  # noqa: E402  (no engine import)


def _median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 4)


def bench_shape(b: int, n: int, rounds: int, vocab: int, seed: int = 0, device: str = "cuda") -> dict:
    """One (batch, N) row: eager and graph-replayed step + bookkeeping on ``device`` (eager only
    when it is not CUDA: a dry run of the script itself)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    planner, streams, rids, ctx, topk, depth, rng, gen = workload(b, n, vocab, seed, dev)
    slots = torch.arange(b, device=dev)

    def inputs():
        """One round's fresh inputs (host side timed separately)."""
        sl, tl, pl = dense_lists(b, topk, depth, vocab, gen)
        t0 = time.perf_counter()
        host = planner.host_candidates(rids)
        host_s = time.perf_counter() - t0
        return {"scores": torch.cat([x.reshape(b, -1) for x in sl], 1).to(dev),
                "tokens": torch.cat(tl, 1).to(dev),
                "plist": torch.cat([x.reshape(b, -1) for x in pl[:-1]], 1).to(dev),
                "roots": torch.tensor([s.buf[0] if s.buf else 0 for s in streams], device=dev),
                "seq": torch.tensor(ctx, device=dev) - 1,
                "host": host,
                "accept": torch.randint(0, 3, (b,), generator=gen).to(dev),
                "topk_ids": torch.randint(0, vocab, (b, n, planner.successor.k), generator=gen).to(dev),
                "committed": torch.randint(0, vocab, (b, n), generator=gen).to(dev)}, host_s

    def build(x, sampled):
        return planner.build(dense_draft_candidates(x["scores"], x["tokens"], x["plist"], topk, depth), x["roots"],
                             x["host"], slots, x["seq"], sampled)

    def observe(out, x):
        """A verify outcome: the root's first child chain up to x["accept"] nodes, then bookkeeping."""
        idx = torch.arange(n, device=dev)
        first_chain = (out.depth == idx) & (idx <= x["accept"][:, None])
        accept = torch.where(first_chain, idx + torch.arange(b, device=dev)[:, None] * n, -1)
        return planner.observe(out, on_path_from_accept_index(accept, n), x["topk_ids"], x["committed"],
                               x["accept"] + 1, slots)

    def round_fn(x):
        """build + observe of one round (the device work between draft and the next draft)."""
        out = build(x, torch.zeros(b, dtype=torch.bool, device=dev))
        return out, observe(out, x)

    def advance():
        for r, s in zip(rids, streams):
            toks = s.take(rng.randint(1, 4))
            planner.extend(r, toks)
            ctx[r] += len(toks)

    # ---- eager
    eager_t, host_t = [], []
    for it in range(rounds + 5):
        x, hs = inputs()
        sync()
        t0 = time.perf_counter()
        round_fn(x)
        sync()
        if it >= 5:
            eager_t.append(time.perf_counter() - t0)
            host_t.append(hs)
        advance()

    row = {"batch": b, "num_draft_tokens": n, "topk": topk, "depth": depth,
           "eager_ms_per_round": _median_ms(eager_t), "host_side_ms_per_round": _median_ms(host_t)}
    if dev.type != "cuda":
        return row

    # ---- graphs: the product's StepGraphs (graft_spec/graphs.py) replays build; observe stays eager
    graphs = StepGraphs(planner, topk + (depth - 1) * topk * topk, buckets=[b])
    try:
        graphs.capture()
    except Exception as exc:  # report, do not hide: capture failing means a host read or copy
        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
        return row
    graph_t, equal = [], []
    for it in range(rounds + 3):
        x, _ = inputs()
        sampled = torch.zeros(b, dtype=torch.bool, device=dev)
        args = (dense_draft_candidates(x["scores"], x["tokens"], x["plist"], topk, depth), x["roots"], x["host"],
                slots, x["seq"], sampled)
        ref = planner.build(*args)
        sync()
        t0 = time.perf_counter()
        out = graphs.build(*args)
        observe(out, x)
        sync()
        if it >= 3:
            graph_t.append(time.perf_counter() - t0)
        equal.append(bool(torch.equal(out.tree.tokens, ref.tree.tokens) and torch.equal(out.tree.parents, ref.tree.parents)
                          and torch.equal(out.mask, ref.mask)))
        advance()
    graph, _ = graphs._graphs[(b, n)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        sync()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    row.update(graphs_ms_per_round=_median_ms(graph_t), graph_kernels_per_replay=kernels,
               graph_trees_equal_eager=all(equal), replays=graphs.replays,
               eager_over_graphs=round(statistics.median(eager_t) / max(statistics.median(graph_t), 1e-9), 2))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--nodes", default="24,60")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3 vocabulary size by default")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for an eager-only dry run")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_step_cuda: no CUDA device", file=sys.stderr)
        return 2
    rows = []
    for n in [int(v) for v in args.nodes.split(",")]:
        for b in [int(v) for v in args.batches.split(",")]:
            row = bench_shape(b, n, args.rounds, args.vocab, device=args.device)
            print(json.dumps(row), flush=True)
            rows.append(row)
    payload = {"unit": "ms per decode round for the whole batch (build + observe)",
               "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
               "torch": torch.__version__, "rows": rows}
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
