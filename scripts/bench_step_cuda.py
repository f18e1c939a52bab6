#!/usr/bin/env python
"""The per-round graft step on a CUDA device: eager launch cost vs one CUDA-graph replay.

    python scripts/bench_step_cuda.py --json bench_out/step_cuda.json [--batches 1,16,64] [--nodes 24,60]

For each (batch B, budget N) the same `GraftPlanner` (default config: calibrated expected-gain
selection, successor table, device lookup, host suffix candidates; Qwen3 vocabulary 151936) runs

* ``eager``: `GraftPlanner.build` + `GraftPlanner.observe` called from Python, as SGLang's worker runs
  them after the draft graph (wall time per round with a device synchronise at the end; this is the
  launch-bound cost the GPU sees when nothing else hides it);
* ``graphs``: what the worker runs on CUDA: `graft_spec.graphs.StepGraphs` replays ``build`` from a
  CUDA graph (input copies, one replay; the outputs are views) and ``observe`` replays its own
  graph over the build graph's outputs (the successor table's top-k of the verify logits and one
  load op, one replay; wall time per round with a synchronise). ``topk_ms`` is that top-k alone
  (``[B * N, vocab]`` bf16 logits), part of the observe figures. Capture succeeding is itself the
  check that the step has no host read, no host-to-device copy of a fresh Python value and no
  data-dependent shape; every replayed tree is compared with an eager build of the same inputs;
* ``host_side``: the host work that runs off the critical path (suffix proposals + buffer fill for
  the batch, CPU wall time), overlapped with drafting on a GPU.

Rows also carry the kernels one build replay, one whole replayed build (with its input copies; the
outputs are views) and one observe launch (from the profiler), and whether
the last replayed tree equals an eager build of the same inputs (the replays run back to back, with
no eager build between them, as in the server) and that build equals one with every fused kernel's
torch reference (``fused_trees_equal_reference``). ``--forward`` adds, in the same run, the verify
forward of a Qwen3-8B-shaped target (``configs/shapes/qwen3-8b.json``: transformers' Qwen3, random
bf16 weights, N tokens per request over a ``--cache-len`` KV cache), an EAGLE-3 head round
(``configs/shapes/qwen3-8b-eagle3.json``) and the step's share of the graft round.
Needs a CUDA device (exit 2 without one; ``--device cpu`` is an eager-only dry run, with
``--layers`` / ``--forward-vocab`` small). Figures: docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graft_spec.graphs import StepGraphs  # noqa: E402
from graft_spec.kernels.dispatch import REFERENCE_ENV  # noqa: E402
from graft_spec.step import DenseDraft  # noqa: E402
from sglang_patch.bench.step import dense_lists, workload  # noqa: E402  (no engine import)


@contextlib.contextmanager
def _reference_kernels():
    """The torch references instead of the fused kernels (``GRAFT_REFERENCE_KERNELS=1``, read per call)."""
    saved = os.environ.get(REFERENCE_ENV)
    os.environ[REFERENCE_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[REFERENCE_ENV]
        else:
            os.environ[REFERENCE_ENV] = saved


def _median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 4)


def _kernels(fn, sync) -> int:
    """Device kernels one call of ``fn`` launches (the profiler's CUDA events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def _qwen3(shape: dict, layers: int, vocab: int, device: torch.device, dtype: torch.dtype):
    """transformers' Qwen3 with the attention / MLP shapes of ``shape`` (a config.json), ``layers``
    layers and ``vocab`` output rows, random weights, on ``device`` in ``dtype``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                      num_hidden_layers=layers, num_attention_heads=shape["num_attention_heads"],
                      num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                      vocab_size=vocab, tie_word_embeddings=False, max_position_embeddings=40960)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                   # weights made in ``dtype`` on the device directly
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)


@torch.no_grad()
def forward_ms(model, b: int, tokens: int, cache_len: int, rounds: int, sync, embeds: int = 0) -> float:
    """Median ms of one eager forward of ``tokens`` new tokens per request over a ``cache_len``-token
    KV cache (the new tokens are cropped off after every call). ``embeds`` > 0: the input is
    ``[b, tokens, embeds]`` hidden states through a ``embeds -> hidden`` projection first (the
    EAGLE-3 head's fc over three captured layers)."""
    dev, dtype = model.device, model.dtype
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    cache = model.model(torch.randint(0, vocab, (b, cache_len), device=dev), use_cache=True).past_key_values
    fc = torch.nn.Linear(embeds, hidden, bias=False, device=dev, dtype=dtype) if embeds else None
    x = (torch.randn(b, tokens, embeds, device=dev, dtype=dtype) if embeds
         else torch.randint(0, vocab, (b, tokens), device=dev))
    times = []
    for it in range(rounds + 3):
        sync()
        t0 = time.perf_counter()
        if fc is not None:
            model(inputs_embeds=fc(x), past_key_values=cache, use_cache=True)
        else:
            model(x, past_key_values=cache, use_cache=True)
        sync()
        if it >= 3:
            times.append(time.perf_counter() - t0)
        cache.crop(-tokens)                          # back to ``cache_len`` tokens
    return _median_ms(times)


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
                "committed": torch.randint(0, vocab, (b, n), generator=gen).to(dev)}, host_s

    def dense(x):
        """The draft as the server hands it over: SGLang's dense tree, read as it is by the step."""
        return DenseDraft(x["scores"], x["tokens"], x["plist"], topk, depth)

    def build(x, sampled):
        return planner.build(dense(x), x["roots"], x["host"], slots, x["seq"], sampled)

    # the target's verify logits, one row per node (the observe takes the successor table's top-k of them)
    logits = torch.randn(b * n, vocab, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)

    def observe(out, x):
        """A verify outcome: the root's first child chain up to x["accept"] nodes, then bookkeeping
        from SGLang's layout (`GraftPlanner.observe_verified`, as the server calls it)."""
        idx = torch.arange(n, device=dev)
        first_chain = (out.depth == idx) & (idx <= x["accept"][:, None])
        accept = torch.where(first_chain, idx + torch.arange(b, device=dev)[:, None] * n, -1)
        return planner.observe_verified(out, accept, logits, x["committed"], x["accept"] + 1, slots)

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

    # ---- graphs: the product's StepGraphs (graft_spec/graphs.py) replays build and observe
    graphs = StepGraphs(planner, topk, depth, buckets=[b])
    try:
        graphs.capture()
    except Exception as exc:  # report, do not hide: capture failing means a host read or copy
        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
        return row
    planner.graphs = graphs                        # planner.observe replays after a replayed build
    graph_t = []
    for it in range(rounds + 3):
        x, _ = inputs()
        sampled = torch.zeros(b, dtype=torch.bool, device=dev)
        args = (dense(x), x["roots"], x["host"], slots, x["seq"], sampled)
        sync()
        t0 = time.perf_counter()
        out = graphs.build(*args)                  # no eager build between replays: the server's path
        last = (args, out.tree.tokens.clone(), out.tree.parents.clone(), out.mask.clone())
        observe(out, x)
        sync()
        if it >= 3:
            graph_t.append(time.perf_counter() - t0)
        advance()
    # the last replayed tree against an eager build of the same inputs and calibrator state, which the
    # replays left as eager rounds would (tests/test_core_graphs.py)
    ref = planner.build_eager(*last[0])
    equal = [bool(torch.equal(last[1], ref.tree.tokens) and torch.equal(last[2], ref.tree.parents)
                  and torch.equal(last[3], ref.mask))]
    with _reference_kernels():   # the same build with the torch reference of every fused kernel, on the device
        torch_ref = planner.build_eager(*last[0])
    row["fused_trees_equal_reference"] = bool(torch.equal(ref.tree.tokens, torch_ref.tree.tokens)
                                               and torch.equal(ref.tree.parents, torch_ref.tree.parents)
                                               and torch.equal(ref.mask, torch_ref.mask))
    graph, _ = graphs._graphs[(b, n)]
    kernels = _kernels(lambda: graph.replay(), sync)
    x, _ = inputs()
    args = (dense(x), x["roots"], x["host"], slots, x["seq"], torch.zeros(b, dtype=torch.bool, device=dev))
    build_kernels = _kernels(lambda: graphs.build(*args), sync)   # input copies + replay (the outputs are views)
    out = graphs.build(*args)
    observe_kernels = _kernels(lambda: observe(out, x), sync)
    topk_t = []
    for it in range(rounds + 3):
        sync()
        t0 = time.perf_counter()
        torch.topk(logits, planner.successor_k, dim=-1)
        sync()
        if it >= 3:
            topk_t.append(time.perf_counter() - t0)
    row.update(graphs_ms_per_round=_median_ms(graph_t), topk_ms=_median_ms(topk_t), graph_kernels_per_replay=kernels,
               build_kernels_per_round=build_kernels,
               observe_kernels_per_round=observe_kernels,
               graph_trees_equal_eager=all(equal), replays=graphs.replays,
               observe_replays=graphs.observe_replays,
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
    ap.add_argument("--forward", action="store_true",
                    help="also time the target's verify forward and the EAGLE-3 head's draft steps")
    ap.add_argument("--target-shape", default=str(REPO / "configs" / "shapes" / "qwen3-8b.json"))
    ap.add_argument("--head-shape", default=str(REPO / "configs" / "shapes" / "qwen3-8b-eagle3.json"))
    ap.add_argument("--cache-len", type=int, default=1024, help="KV-cache tokens per request under the verify")
    ap.add_argument("--layers", type=int, default=0, help="target layers (0: the shape's; small for a dry run)")
    ap.add_argument("--forward-vocab", type=int, default=0, help="output rows (0: the shapes'; small for a dry run)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_step_cuda: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    models = None
    if args.forward:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        ts, hs = json.loads(Path(args.target_shape).read_text()), json.loads(Path(args.head_shape).read_text())
        models = (_qwen3(ts, args.layers or ts["num_hidden_layers"], args.forward_vocab or ts["vocab_size"], dev, dtype),
                  _qwen3(hs, 1, args.forward_vocab or hs["draft_vocab_size"], dev, dtype), 3 * hs["hidden_size"])
    rows = []
    for n in [int(v) for v in args.nodes.split(",")]:
        for b in [int(v) for v in args.batches.split(",")]:
            row = bench_shape(b, n, args.rounds, args.vocab, device=args.device)
            if models is not None:
                target, head, embeds = models
                topk, depth = row["topk"], row["depth"]
                verify = forward_ms(target, b, n, args.cache_len, args.rounds, sync)
                first = forward_ms(head, b, 1, args.cache_len, args.rounds, sync, embeds)
                later = forward_ms(head, b, topk, args.cache_len, args.rounds, sync, embeds)
                step = row.get("graphs_ms_per_round", row["eager_ms_per_round"])
                head_round = first + (depth - 1) * later
                row.update(verify_forward_ms=verify, eagle3_head_round_ms=round(head_round, 4),
                           step_over_verify=round(step / verify, 4),
                           step_share_of_round=round(step / (verify + head_round + step), 4))
            print(json.dumps(row), flush=True)
            rows.append(row)
    payload = {"unit": "ms per decode round for the whole batch (build + observe)",
               "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
               "torch": torch.__version__, "rows": rows}
    if models is not None:
        payload["forward"] = {
            "target": Path(args.target_shape).name, "head": Path(args.head_shape).name, "cache_len": args.cache_len,
            "layers": models[0].config.num_hidden_layers, "dtype": str(models[0].dtype),
            "how": "transformers Qwen3, random weights, eager (no CUDA graph): an engine's graph-replayed "
                   "forward is faster at small batch, so the step's share here is a lower bound; the head "
                   "round is its first step (1 token per request) and depth - 1 steps of top-k tokens, each a "
                   "fc over three captured layers, one decoder layer and the draft vocabulary's lm_head"}
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
