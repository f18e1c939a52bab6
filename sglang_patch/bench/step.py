"""``python -m sglang_patch.bench.step``: the per-round graft step against SGLang's own EAGLE build.

Both methods turn the same dense EAGLE draft (SGLang's ``select_top_k_tokens`` layout, top-k x depth)
into a verify input, in the same process and run:

* ``eagle``: SGLang 0.5.23's ``organize_draft_results`` + ``build_tree_kernel_efficient``
  (``eagle_utils.py:100,138``), the tree kernel counted as one op, as on a GPU where it is one JIT
  kernel (on CPU the plugin's torch replacement runs in its place, uncounted);
* ``graft``: ``GraftPlanner.build`` (graft_spec/step.py) of the dense tree as the SGLang worker hands
  it over (`DenseDraft`) with the default config (no checkpoints): calibrated rerank, successor
  expansion, re-anchoring of the host candidate buffer, merge / dedupe / select, layout.
* ``graft_fused``: the same build with every fused kernel of graft_spec/kernels/ called as its
  custom op (one op each; on CPU the op's implementation is the torch reference, so its time here
  is the reference's): the launches the GPU path runs. Parts without a fused kernel yet run their
  torch ops as in ``graft``.

Per row: ``ops_per_round`` (aten ops dispatched, views excluded: each is at least one kernel on a
GPU), ``syncs_per_round`` (ops that read device data on the host, copy between devices or have
data-dependent shapes: ``_local_scalar_dense``, ``nonzero``, ``lift_fresh``, cross-device
``_to_copy``...), ``host_us_per_round`` (median wall time of the call for the whole batch; on this
CPU it includes the compute). Graft rows add the host-side work that runs off the critical path
(``host_side_us_per_round``: suffix index proposals + buffer fill, overlapped with drafting on a GPU)
and the device bookkeeping after verify (``observe_ops_per_round``, ``observe_syncs_per_round``).
``--eager-gate`` adds the eager gated round (no CUDA graphs, the default expected-gain stop gate):
``graft_eager_gated`` = ``GraftPlanner.stop_gate`` + ``build`` reusing the gate's retrieved
candidates (what the SGLang worker runs), ``graft_eager_gated_unshared`` = the same with ``build``
pricing them again (the eager round before the two shared them). ``--inductor`` adds ``graft_inductor`` rows: the step compiled by ``torch.compile(fullgraph=True)``
(inductor's C++ backend here, its Triton backend on a GPU), ``ops_per_round`` = the kernels inductor
generated for it (its syncs are 0 by construction: a fullgraph compile has no host read).

Usage::

    python -m sglang_patch.bench.step --json bench_out/step.json [--batches 1,16,64] [--nodes 24,60] [--eager-gate]
        [--by-function]   # graft rows: ops per graft_spec function (``ops_by_function``)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
import traceback
import contextlib
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graft_spec.config import GraftConfig
from graft_spec.pipeline import (DenseDraft, GraftPlanner, dense_draft_candidates, eagle_step, fused_ops_everywhere,
                                 on_path_from_accept_index)

#: ops that only re-describe memory (no kernel on a GPU)
VIEW_OPS = frozenset({"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
                      "t", "transpose", "as_strided", "alias", "detach", "split", "unbind", "diagonal",
                      "unflatten", "view_as", "split_with_sizes", "_reshape_alias", "lift_fresh"})
#: ops that read device data on the host, move it between devices or have data-dependent shapes
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique",
                      "_unique2", "lift_fresh", "lift_fresh_copy"})
SHAPES = {24: (4, 4), 60: (10, 7)}


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops (views excluded) and host syncs (see module docstring).

    With ``by_function`` it also attributes each op to every ``graft_spec`` function on the Python
    stack when it was dispatched (`functions`: ``"module.py:function"`` -> ops, inclusive: an op
    counts for its function and for each caller), which costs a stack walk per op.
    """

    def __init__(self, by_function: bool = False):
        super().__init__()
        self.ops = self.syncs = 0
        self.paused = False
        self.names: dict[str, int] = {}
        self.by_function = by_function
        self.functions: dict[str, int] = {}

    def _attribute(self) -> None:
        seen = set()
        for frame in traceback.extract_stack():
            path = frame.filename.replace("\\", "/")
            if "/graft_spec/" not in path:
                continue
            key = f"{path.split('/graft_spec/')[-1]}:{frame.name}"
            if key not in seen:
                seen.add(key)
                self.functions[key] = self.functions.get(key, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if not self.paused:
            if name in SYNC_OPS or (name == "_to_copy" and "device" in kwargs and args
                                    and torch.device(kwargs["device"]) != args[0].device):
                self.syncs += 1
            if name not in VIEW_OPS:
                self.ops += 1
                self.names[name] = self.names.get(name, 0) + 1
                if self.by_function:
                    self._attribute()
        return func(*args, **kwargs)

    @contextmanager
    def as_one_op(self):
        """Count everything inside as one op (a fused kernel on a GPU)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False
            self.ops += 1


class _Stream:
    """Token stream that repeats phrases from a small phrase book (so suffix matches happen)."""

    def __init__(self, rng: random.Random, vocab: int, book: list[list[int]]):
        self.rng, self.vocab, self.book = rng, vocab, book
        self.buf: list[int] = []

    def take(self, n: int) -> list[int]:
        while len(self.buf) < n:
            if self.rng.random() < 0.7:
                self.buf.extend(self.rng.choice(self.book))
            else:
                self.buf.extend(self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 6)))
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


class Workload(NamedTuple):
    """A planner serving ``b`` synthetic requests whose streams repeat phrases (suffix matches
    happen), each started with a 512-token prompt; ``ctx`` holds their context lengths."""

    planner: GraftPlanner
    streams: list
    rids: list
    ctx: list
    topk: int
    depth: int
    rng: random.Random
    gen: torch.Generator


def workload(b: int, n: int, vocab: int, seed: int = 0, device: str | torch.device = "cpu") -> Workload:
    """The step benchmarks' setup for batch ``b`` and budget ``n`` (draft shape from `SHAPES`)."""
    topk, depth = SHAPES.get(n, (4, 4))
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=depth)
    rng = random.Random(seed)
    planner = GraftPlanner(cfg, vocab_size=vocab, device=device, max_batch=b, max_slots=b)
    book = [[rng.randrange(vocab) for _ in range(rng.randint(4, 16))] for _ in range(200)]
    streams = [_Stream(random.Random(seed * 1000 + i), vocab, book) for i in range(b)]
    rids = list(range(b))
    ctx = []
    for r, s in zip(rids, streams):
        prompt = s.take(512)
        planner.start_request(r, prompt)
        ctx.append(len(prompt))
    return Workload(planner, streams, rids, ctx, topk, depth, rng, torch.Generator().manual_seed(seed))


def dense_lists(b: int, topk: int, depth: int, vocab: int, gen: torch.Generator):
    """Random dense EAGLE lists in SGLang's layout: (scores, tokens, parents) per step."""
    sl, tl, pl, fs = [], [], [], None
    for i in range(depth):
        shape = (b, topk) if i == 0 else (b, topk, topk)
        p = torch.softmax(torch.randn(*shape, generator=gen) * 2, -1).sort(-1, descending=True).values
        (s, t, pa), fs, _ = eagle_step(i, p, torch.randint(0, vocab, shape, generator=gen), fs)
        sl.append(s)
        tl.append(t)
        pl.append(pa)
    return sl, tl, pl


def _eagle_build(sl, tl, pl, roots, seq_lens, n, topk, depth, counter: OpCounter):
    from sglang.srt.speculative import eagle_utils as eu
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    kernel = eu.build_tree_kernel_efficient_func

    def one_kernel(*args, **kwargs):
        with counter.as_one_op():
            return kernel(*args, **kwargs)

    eu.build_tree_kernel_efficient_func = one_kernel
    try:
        parent_list, top_idx, draft_tokens = eu.organize_draft_results(sl, tl, pl, n)
        return eu.build_tree_kernel_efficient(roots, parent_list, top_idx, draft_tokens, seq_lens, 0, topk, depth,
                                              n, TreeMaskMode.QLEN_ONLY, None)
    finally:
        eu.build_tree_kernel_efficient_func = kernel


def _load_sglang() -> None:
    """SGLang with the plugin's hooks applied (the CPU layer supplies the tree kernel here)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def bench_shape(batch: int, n: int, rounds: int, vocab: int, inductor: bool, seed: int = 0,
                eager_gate: bool = False, by_function: bool = False) -> list[dict]:
    planner, streams, rids, ctx, topk, depth, rng, gen = workload(batch, n, vocab, seed)
    roots = torch.tensor([planner.retriever.sources[0]._tries[r].hist[-1] for r in rids])
    slots = torch.arange(batch)
    sampled = torch.zeros(batch, dtype=torch.bool)
    compiled, kernels = None, 0
    if inductor:
        compiled = torch.compile(lambda *a: planner.step(*a), fullgraph=True, dynamic=False)
    rows = {m: {"ops": [], "syncs": [], "t": []}
            for m in ("graft", "graft_fused", "eagle", "graft_inductor", "graft_eager_gated", "graft_eager_gated_unshared")}
    host_t = []
    obs_ref, obs_fused = {"ops": [], "syncs": []}, {"ops": [], "syncs": []}
    warm = 3
    for it in range(rounds + warm):
        sl, tl, pl = dense_lists(batch, topk, depth, vocab, gen)
        seq = torch.tensor(ctx) - 1
        t0 = time.perf_counter()
        host = planner.host_candidates(rids)
        t1 = time.perf_counter()
        scores = torch.cat([x.reshape(batch, -1) for x in sl], 1)
        tokens = torch.cat(tl, 1)
        plist = torch.cat([x.reshape(batch, -1) for x in pl[:-1]], 1)
        # timed passes run without the counter (its Python dispatch hook costs more than the ops)
        def graft_build():   # the dense tree as the SGLang worker hands it over
            return planner.build(DenseDraft(scores, tokens, plist, topk, depth), roots, host, slots, seq, sampled)

        t2 = time.perf_counter()
        out = graft_build()
        t3 = time.perf_counter()
        with OpCounter(by_function=by_function and it == rounds + warm - 1) as c:
            graft_build()
        if c.by_function:
            functions = c.functions
        with fused_ops_everywhere():
            tf = time.perf_counter()
            graft_build()
            tf = time.perf_counter() - tf
            with OpCounter() as cf:
                graft_build()
        null = OpCounter()
        t4 = time.perf_counter()
        _eagle_build(sl, tl, pl, roots, seq, n, topk, depth, null)
        t5 = time.perf_counter()
        with OpCounter() as ce:
            _eagle_build(sl, tl, pl, roots, seq, n, topk, depth, ce)
        if eager_gate:
            draft = DenseDraft(scores, tokens, plist, topk, depth)

            def gated(shared: bool):
                gate = planner.stop_gate(roots, host, slots, seq, sampled)
                return planner.build(draft, roots, host, slots, seq, sampled,
                                     retrieved=gate.retrieved if shared else None)

            for method, shared in (("graft_eager_gated", True), ("graft_eager_gated_unshared", False)):
                tg = time.perf_counter()
                gated(shared)
                tg = time.perf_counter() - tg
                with OpCounter() as cg:
                    gated(shared)
                if it >= warm:
                    rows[method]["ops"].append(cg.ops)
                    rows[method]["syncs"].append(cg.syncs)
                    rows[method]["t"].append(tg)
        if compiled is not None:
            est = planner.calibrator.table
            prev = planner.history.gather(slots)
            args = (dense_draft_candidates(scores, tokens, plist, topk, depth), roots, host, *prev, seq, sampled, est)
            if it == 0:
                from torch._inductor import metrics

                before = metrics.generated_kernel_count
                compiled(*args)
                kernels = metrics.generated_kernel_count - before
            t6 = time.perf_counter()
            compiled(*args)
            t7 = time.perf_counter()
        # a verify outcome: the root plus a random prefix of its first chain
        accept = torch.full((batch, n), -1, dtype=torch.int64)
        accept[:, 0] = torch.arange(batch) * n
        lens = torch.ones(batch, dtype=torch.int64)
        committed = torch.zeros(batch, n, dtype=torch.int64)
        committed[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        # observe: the reference on even rounds, the fused ops on odd ones (each round observes once)
        on_path = on_path_from_accept_index(accept, n)
        topk_ids = torch.randint(0, vocab, (batch, n, 8), generator=gen)
        fused_round = it % 2 == 1
        with fused_ops_everywhere() if fused_round else contextlib.nullcontext(), OpCounter() as co:
            planner.observe(out, on_path, topk_ids, committed, lens, slots)
        new = [s.take(rng.randint(1, 4)) for s in streams]
        for r, toks in zip(rids, new):
            planner.extend(r, toks)
            ctx[r] += len(toks)
        roots = torch.tensor([toks[-1] for toks in new])
        if it >= warm:
            rows["graft"]["ops"].append(c.ops)
            rows["graft"]["syncs"].append(c.syncs)
            rows["graft"]["t"].append(t3 - t2)
            rows["graft_fused"]["ops"].append(cf.ops)
            rows["graft_fused"]["syncs"].append(cf.syncs)
            rows["graft_fused"]["t"].append(tf)
            rows["eagle"]["ops"].append(ce.ops)
            rows["eagle"]["syncs"].append(ce.syncs)
            rows["eagle"]["t"].append(t5 - t4)
            if compiled is not None:   # a dispatch mode cannot run inside compiled code
                rows["graft_inductor"]["ops"].append(kernels)
                rows["graft_inductor"]["syncs"].append(0)
                rows["graft_inductor"]["t"].append(t7 - t6)
            host_t.append(t1 - t0)
            obs = obs_fused if fused_round else obs_ref
            obs["ops"].append(co.ops)
            obs["syncs"].append(co.syncs)
    out_rows = []
    for method, r in rows.items():
        if not r["t"]:
            continue
        row = {"method": method, "batch": batch, "num_draft_tokens": n, "topk": topk, "depth": depth,
               "ops_per_round": statistics.median(r["ops"]), "syncs_per_round": statistics.median(r["syncs"]),
               "host_us_per_round": round(1e6 * statistics.median(r["t"]), 1),
               "host_us_per_round_min": round(1e6 * min(r["t"]), 1)}
        if method in ("graft", "graft_fused"):
            obs = obs_fused if method == "graft_fused" else obs_ref
            row.update(host_side_us_per_round=round(1e6 * statistics.median(host_t), 1),
                       host_to_device_copies_per_round=1 if planner.buffer.width else 0,
                       observe_ops_per_round=statistics.median(obs["ops"]) if obs["ops"] else None,
                       observe_syncs_per_round=statistics.median(obs["syncs"]) if obs["syncs"] else None)
            if by_function and method == "graft":   # last round's ops per graft_spec function, largest first
                row["ops_by_function"] = dict(sorted(functions.items(), key=lambda kv: -kv[1]))
        out_rows.append(row)
    return out_rows


def ratios(rows: list[dict]) -> list[dict]:
    """graft / eagle per (batch, N), side by side: build ops, time, and for graft the round's build +
    observe ops (``round_ops_ratio``; EAGLE's round has no observe)."""
    by = {(r["method"], r["batch"], r["num_draft_tokens"]): r for r in rows}
    out = []
    for (m, b, n), r in sorted(by.items()):
        e = by.get(("eagle", b, n))
        if m == "eagle" or e is None:
            continue
        row = {"method": m, "batch": b, "num_draft_tokens": n,
               "ops_ratio": round(r["ops_per_round"] / max(e["ops_per_round"], 1), 2),
               "host_us_ratio": round(r["host_us_per_round"] / max(e["host_us_per_round"], 1e-9), 2),
               "syncs": r["syncs_per_round"]}
        if r.get("observe_ops_per_round") is not None:   # the whole round's device work: build + observe
            row["round_ops_ratio"] = round((r["ops_per_round"] + r["observe_ops_per_round"])
                                           / max(e["ops_per_round"], 1), 2)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--nodes", default="24,60")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3 vocabulary size by default")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--inductor", action="store_true", help="also time the step compiled by torch.compile")
    ap.add_argument("--by-function", action="store_true",
                    help="graft rows: the last round's ops per graft_spec function (inclusive of callees)")
    ap.add_argument("--eager-gate", action="store_true",
                    help="also count and time the eager gated round (stop gate + build), shared and unshared")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _load_sglang()
    rows = []
    for n in [int(x) for x in args.nodes.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            for row in bench_shape(b, n, args.rounds, args.vocab, args.inductor, eager_gate=args.eager_gate,
                                   by_function=args.by_function):
                rows.append(row)
                print(json.dumps(row))
    payload = {
        "unit": "per decode round for the whole batch; host_us = median wall time of the call",
        "targets": {"graft syncs_per_round": 0, "graft ops_per_round": "<= 1.5 x eagle",
                    "graft_fused ops_per_round + observe_ops_per_round": "<= 1.5 x eagle",
                    "graft host_us_per_round at batch 64": "<= 2 x eagle"},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "rows": rows, "ratios": ratios(rows)}
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2) + "\n")
    for r in payload["ratios"]:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
