"""Host-time benchmark of the Graft core per decode step (CPU, no model).

Measures, per request per step, in microseconds (median over steps of wall time;
``plan_us_min`` is the fastest step and ``plan_cpu_us`` the median thread CPU time, both
guides to the uncontended cost on a shared machine):

* ``plan_us``: `GraftPlanner.build` = prune -> retrieve (successor + suffix) -> graft;
  the number the <= 50 us/request/step target (batch 64) refers to.
* ``extend_us``: feeding the committed tokens to the retrieval sources
  (`GraftPlanner.extend`, once per request).
* ``observe_us``: successor-matrix update from target top-k at every node.
* ``rerank_us``: `eagle_rerank` from SGLang-format per-step lists (engine side).
* ``derive_us``: ancestor mask + positions + sibling links of the hybrid tree.

Workload: synthetic requests over a Qwen3-sized vocabulary whose token streams repeat
phrases (so suffix matches and successor hits happen), 512-token prompts, 1-4 committed
tokens per step, random EAGLE trees. Usage::

    python -m graft_spec.bench_core --json bench_out/core.json [--batches 1,16,64] [--nodes 24,60]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from .config import GraftConfig
from .pipeline import GraftPlanner
from .tree import eagle_rerank, eagle_step

SHAPES = {  # N -> (topk, depth, checkpoints): quick.yaml / qwen3-8b.yaml shapes
    24: (4, 4, [(1, 0.35, 6), (2, 0.25, 12), (4, 0.15, 18)]),
    60: (10, 7, [(1, 0.35, 8), (2, 0.25, 24), (6, 0.15, 40)]),
}


def _shape(n: int):
    if n in SHAPES:
        return SHAPES[n]
    topk, depth = 4, 4
    while topk + (depth - 1) * topk * topk < n - 1:
        topk += 1
    return topk, depth, [(1, 0.35, max(1, n // 4)), (2, 0.25, max(2, n // 2))]


class _Stream:
    """Token stream that repeats phrases from a small phrase book."""

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


def _eagle_lists(b: int, topk: int, depth: int, vocab: int, gen: torch.Generator):
    sl, tl, pl, fs = [], [], [], None
    for i in range(depth):
        shape = (b, topk) if i == 0 else (b, topk, topk)
        p = torch.softmax(torch.randn(*shape, generator=gen) * 2, -1)
        p, _ = p.sort(-1, descending=True)
        ids = torch.randint(0, vocab, shape, generator=gen)
        (s, t, pa), fs, _ = eagle_step(i, p, ids, fs)
        sl.append(s)
        tl.append(t)
        pl.append(pa)
    return sl, tl, pl


def bench_one(batch: int, n: int, steps: int, vocab: int, seed: int = 0) -> dict:
    topk, depth, stages = _shape(n)
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=depth,
                      checkpoints=[{"depth": d, "threshold": t, "keep": k} for d, t, k in stages])
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    planner = GraftPlanner(cfg, vocab_size=vocab)
    book = [[rng.randrange(vocab) for _ in range(rng.randint(4, 16))] for _ in range(200)]
    streams = [_Stream(random.Random(seed * 1000 + i), vocab, book) for i in range(batch)]
    req = list(range(batch))
    roots = []
    for r, s in zip(req, streams):
        prompt = s.take(512)
        planner.start_request(r, prompt)
        roots.append(prompt[-1])
    t_plan, t_ext, t_obs, t_rr, t_der, c_plan, c_ext = [], [], [], [], [], [], []
    stage_counts: dict[int, int] = {}
    retrieved = 0
    warm = 3
    for step in range(steps + warm):
        lists = _eagle_lists(batch, topk, depth, vocab, gen)
        root_t = torch.tensor(roots)
        t0 = time.perf_counter()
        draft = eagle_rerank(*lists, root_t, n)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        tree = planner.build(draft, req)
        c2 = time.thread_time()
        t2 = time.perf_counter()
        tree.mask()
        tree.positions(torch.full((batch,), 600))
        tree.links()
        t3 = time.perf_counter()
        topk_ids = torch.randint(0, vocab, (batch, n, 8), generator=gen)
        planner.observe(tree, topk_ids)
        t4 = time.perf_counter()
        new = [s.take(rng.randint(1, 4)) for s in streams]
        t5 = time.perf_counter()
        c5 = time.thread_time()
        for r, toks in zip(req, new):
            planner.extend(r, toks)
        c6 = time.thread_time()
        t6 = time.perf_counter()
        roots = [toks[-1] for toks in new]
        if step >= warm:
            t_rr.append(t1 - t0)
            t_plan.append(t2 - t1)
            c_plan.append(c2 - c1)
            t_der.append(t3 - t2)
            t_obs.append(t4 - t3)
            t_ext.append(t6 - t5)
            c_ext.append(c6 - c5)
            for s in planner.last_info.prune.stage.tolist():
                stage_counts[s] = stage_counts.get(s, 0) + 1
            retrieved += int((tree.source == 1).sum())
    per = lambda xs: 1e6 * statistics.median(xs) / batch  # noqa: E731
    return {
        "batch": batch, "num_draft_tokens": n, "topk": topk, "depth": depth, "steps": steps,
        "plan_us": round(per(t_plan), 2),
        "plan_us_min": round(1e6 * min(t_plan) / batch, 2),
        "plan_cpu_us": round(per(c_plan), 2),
        "extend_us": round(per(t_ext), 2),
        "extend_cpu_us": round(per(c_ext), 2),
        "plan_plus_extend_us": round(per(t_plan) + per(t_ext), 2),
        "plan_plus_extend_cpu_us": round(per(c_plan) + per(c_ext), 2),
        "observe_us": round(per(t_obs), 2),
        "rerank_us": round(per(t_rr), 2),
        "derive_us": round(per(t_der), 2),
        "retrieved_nodes_per_request": round(retrieved / (steps * batch), 2),
        "stage_hist": {str(k): v for k, v in sorted(stage_counts.items())},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--nodes", default="24,60")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3 vocabulary size by default")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: host-side per-step work; 0 = torch default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for n in [int(x) for x in args.nodes.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            row = bench_one(b, n, args.steps, args.vocab)
            rows.append(row)
            print(json.dumps(row))
    out = {"unit": "microseconds per request per decode step (median over steps)",
           "target": "plan_us <= 50 at batch 64",
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "results": rows}
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
