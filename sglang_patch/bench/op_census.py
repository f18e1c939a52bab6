"""``python -m sglang_patch.bench.op_census``: torch ops a server dispatches per decode round, no-spec
against graft's plain rounds.

On a GPU every op of a round is a kernel launch of a few microseconds, so the ops a plain round
dispatches beyond a no-speculation decode step are what it costs there beyond it; on this CPU the
count is deterministic where wall time is not. With ``GRAFT_OP_CENSUS=<path prefix>`` in a server's
environment the plugin wraps SGLang's ``Scheduler.run_batch`` and ``Scheduler.process_batch_result``
(``managers/scheduler.py``) in a counting ``TorchDispatchMode`` and writes, every 32 decode rounds,
``<prefix>.<pid>.json``: per (phase, forward mode, batch size) the rounds seen and the mean ops per
round. The tool starts a no-spec server and a graft server whose rounds are all plain
(``batch_budget.schedule: [1]``), sends the same requests to each (greedy and sampled) and prints the
ops per decode round of both, phase by phase, at every batch size it saw.

    python -m sglang_patch.bench.op_census --target models/default/target --draft models/default/draft \\
        --json bench_out/op_census.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List

from sglang_patch.bench.client import run_prompts_sync, sampling_params
from sglang_patch.bench.methods import MethodSpec
from sglang_patch.bench.prompts import load_prompts
from sglang_patch.hooks import register_hook
from sglang_patch.launcher import SGLangServer

__all__ = ["ENV", "register_op_census", "main"]

#: Environment variable holding the output path prefix (unset: nothing is registered).
ENV = "GRAFT_OP_CENSUS"
_TARGETS = {"run_batch": "sglang.srt.managers.scheduler.Scheduler.run_batch",
            "process_batch_result": "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
            "get_next_batch_to_run": "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
            "ingest_requests": "sglang.srt.managers.scheduler.Scheduler.ingest_requests",
            "batch_copy": "sglang.srt.managers.schedule_batch.ScheduleBatch.copy"}
_counts: Dict[tuple, List[int]] = defaultdict(lambda: [0, 0, 0])   # key -> [rounds, ops, max ops of a round]
_names: Dict[tuple, Dict[str, int]] = defaultdict(lambda: defaultdict(int))   # key -> op name -> count
_decode_rounds = [0]


def _mode(batch) -> str:
    mode = getattr(batch, "forward_mode", None)
    return getattr(mode, "name", str(mode))


def _counting(phase: str):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0
        names: Dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            name = str(func)
            Count.names[name] = Count.names.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    timing = os.environ.get(ENV + "_MODE") == "time"

    def around(orig, scheduler, *args, **kwargs):
        batch = args[0] if phase in ("run_batch", "process_batch_result") else (
            scheduler if phase == "batch_copy" else kwargs.get("running_batch"))
        key_mode, bs = _mode(batch), len(getattr(batch, "reqs", ()) or ())
        args = (args[0],) + args[1:] if args else ()
        Count.n, Count.names = 0, {}
        if timing:   # wall time only (microseconds), no dispatch mode in the way
            t0 = time.perf_counter()
            out = orig(scheduler, *args, **kwargs)
            Count.n = int((time.perf_counter() - t0) * 1e6)
        else:
            with Count():
                out = orig(scheduler, *args, **kwargs)
        entry = _counts[(phase, key_mode, bs)]
        entry[0] += 1
        entry[1] += Count.n
        entry[2] = max(entry[2], Count.n)
        names = _names[(phase, key_mode, bs)]
        for k, v in Count.names.items():
            names[k] += v
        if phase == "run_batch" and key_mode == "DECODE":
            _decode_rounds[0] += 1
            if _decode_rounds[0] % 32 == 0:
                _dump()
        return out

    return around


def _dump() -> None:
    path = f"{os.environ[ENV]}.{os.getpid()}.json"
    rows = [{"phase": p, "mode": m, "batch_size": b, "rounds": r, "ops_per_round": ops / r, "max": most,
             "by_op": {k: v / r for k, v in _names[(p, m, b)].items()}}
            for (p, m, b), (r, ops, most) in sorted(_counts.items()) if r]
    Path(path).write_text(json.dumps(rows))


def register_op_census() -> bool:
    """Register the counting hooks in a scheduler process when ``GRAFT_OP_CENSUS`` is set (SGLang's
    ``AROUND`` hooks, applied right after the plugins register). Returns True when registered."""
    if not os.environ.get(ENV):
        return False
    done = False
    for phase, target in _TARGETS.items():
        done |= register_hook(target, _counting(phase), "AROUND", only_if_imported="sglang.srt.managers.scheduler")
    return done


#: Ops that launch no kernel on a GPU (views and metadata), and the one that reads a value to the host.
VIEW_OPS = frozenset(f"aten.{n}" for n in (
    "view.default", "_unsafe_view.default", "slice.Tensor", "select.int", "unsqueeze.default", "squeeze.dim",
    "squeeze.default", "t.default", "transpose.int", "permute.default", "expand.default", "alias.default",
    "as_strided.default", "split.Tensor", "split_with_sizes.default", "unbind.int", "detach.default",
    "lift_fresh.default", "reshape.default", "movedim.int", "narrow.default"))
SYNC_OP = "aten._local_scalar_dense.default"


def kernels_and_syncs(by_op: Dict[str, float]) -> tuple:
    """``(kernels, syncs)`` per round from an op histogram: every op that is not a view, and the
    host reads of a value (``.item()``, ``int(tensor)``)."""
    syncs = by_op.get(SYNC_OP, 0.0)
    return sum(v for k, v in by_op.items() if k not in VIEW_OPS) - syncs, syncs


def _merge(prefix: Path) -> Dict[str, Dict[str, float]]:
    """``{"<phase> <mode> bs<b>": ops per round}`` over the files one server wrote."""
    out: Dict[str, Dict[str, float]] = {}
    for f in prefix.parent.glob(prefix.name + ".*.json"):
        for row in json.loads(f.read_text()):
            kernels, syncs = kernels_and_syncs(row["by_op"])
            out[f"{row['phase']} {row['mode']} bs{row['batch_size']}"] = {
                "rounds": row["rounds"], "ops_per_round": round(row["ops_per_round"], 1),
                "kernels_per_round": round(kernels, 1), "syncs_per_round": round(syncs, 2),
                "by_op": {k: round(v, 2) for k, v in row["by_op"].items()}}
    return out


def main(argv: List[str] | None = None) -> int:
    """Run both servers, the same requests on each; print and write the ops per round."""
    p = argparse.ArgumentParser(prog="python -m sglang_patch.bench.op_census", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--budget", type=int, default=24)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--prompts", default="data/humaneval_dev.jsonl")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", default="bench_out/op_census.json")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    texts = load_prompts(a.prompts, a.requests)
    work = Path(tempfile.mkdtemp(prefix="graft_census_"))
    result: Dict[str, Any] = {"args": vars(a), "servers": {}}
    for name in ("nospec", "graft_plain"):
        spec = MethodSpec("nospec", "nospec") if name == "nospec" else \
            MethodSpec("graft", "graft_plain", a.budget, a.depth, a.topk, a.draft)
        env = {ENV: str(work / name)}
        if name == "graft_plain":
            env["GRAFTCFG_BATCH_BUDGET__SCHEDULE"] = "[1]"
        with SGLangServer(a.target, spec.server_args() + ["--dtype", "float32", "--max-running-requests", "32"],
                          env=env, log_path=str(work / f"{name}.log")) as srv:
            for c in a.concurrency:
                for mode in ({}, {"temperature": 0.8, "top_p": 0.95}):
                    run_prompts_sync(srv.url, texts, c, {**sampling_params(a.max_tokens, **mode), "ignore_eos": True,
                                                         "sampling_seed": 1})
            time.sleep(1.0)
        result["servers"][name] = _merge(work / name)
    ns, gp = result["servers"]["nospec"], result["servers"]["graft_plain"]
    print(f"{'phase / mode / batch':34s} {'no-spec ops':>11s} {'plain ops':>9s} {'no-spec kernels':>15s} "
          f"{'plain kernels':>13s} {'extra':>6s} {'syncs':>11s}")
    for key in sorted(set(ns) | set(gp)):
        x, y = ns.get(key, {}), gp.get(key, {})
        cells = [x.get("ops_per_round"), y.get("ops_per_round"), x.get("kernels_per_round"), y.get("kernels_per_round")]
        extra = f"{cells[3] - cells[2]:+.1f}" if cells[2] is not None and cells[3] is not None else "-"
        syncs = f"{x.get('syncs_per_round', '-')}/{y.get('syncs_per_round', '-')}"
        print(f"{key:34s} " + " ".join(f"{'-' if v is None else v:>{w}}" for v, w in zip(cells, (11, 9, 15, 13)))
              + f" {extra:>6s} {syncs:>11s}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
