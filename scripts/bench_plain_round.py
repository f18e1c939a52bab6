"""What a plain (verify width 1) graft round costs against a no-spec decode step, on this machine.

Servers one after the other, same target and prompts: no speculation; graft with every request
opted out of speculation (``custom_params: {"graft_speculate": false}``), so every graft round is
the batch budget's width-1 round (SGLang's ``steps = 0`` path: a verify-mode forward of the root),
with the draft extend deferred to a catch-up (``batch_budget.defer_draft_extend``, the default:
one extend per ``N`` plain rounds here); and the same with SGLang's draft extend after every plain
round (``defer_draft_extend: false``). Graft runs SGLang's overlap scheduler (its default, kept on
CPU) except in the ``_synchronous`` row (``--disable-overlap-schedule``). Each sends the 20 dev code
prompts (token-healed, repeated to ``--requests``) with ``--concurrency`` in flight, ``ignore_eos``
and ``--max-tokens`` new tokens, after one warm-up wave; ``--repeats`` rounds of the rows,
interleaved (this machine's speed drifts between minutes). Prints one JSON line per server and the
median ratios (docs/sglang_graft.md, "The batch budget").

    .venv/bin/python scripts/bench_plain_round.py --json bench_out/plain_round.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_patch.bench.client import run_prompts_sync, sampling_params  # noqa: E402
from sglang_patch.bench.methods import MethodSpec  # noqa: E402
from sglang_patch.bench.prompts import BenchPrompt, load_prompts  # noqa: E402
from sglang_patch.launcher import SGLangServer  # noqa: E402
from sglang_patch.verify_widths import OPT_OUT_KEY  # noqa: E402

#: row name -> (graft?, server environment, extra server arguments)
ROWS = {
    "nospec": (False, {}, []),
    "graft_plain_deferred_extend": (True, {"GRAFTCFG_BATCH_BUDGET__DEFER_DRAFT_EXTEND": "true"}, []),
    "graft_plain_deferred_extend_synchronous": (True, {"GRAFTCFG_BATCH_BUDGET__DEFER_DRAFT_EXTEND": "true"},
                                                ["--disable-overlap-schedule"]),
    "graft_plain_extend_every_round": (True, {"GRAFTCFG_BATCH_BUDGET__DEFER_DRAFT_EXTEND": "false"}, []),
}


def run(models: Path, row: str, prompts: list[BenchPrompt], concurrency: int, max_tokens: int) -> dict:
    """tokens/s of one server over ``prompts`` (after a warm-up wave of ``concurrency`` requests)."""
    graft, env, extra = ROWS[row]
    method = (MethodSpec("graft", "graft_n24", 24, 4, 4, str(models / "draft")) if graft
              else MethodSpec("nospec", "nospec"))
    params = {**sampling_params(max_tokens), "ignore_eos": True}
    if graft:
        params["custom_params"] = {OPT_OUT_KEY: False}
    args = ["--dtype", "float32", "--max-running-requests", str(concurrency), *method.server_args(), *extra]
    with SGLangServer(str(models / "target"), args, env=env) as srv:
        run_prompts_sync(srv.url, prompts[:concurrency], concurrency, params)
        res = run_prompts_sync(srv.url, prompts, concurrency, params)
    tokens = sum(r.completion_tokens for r in res.results)
    return {"method": row, "tokens": tokens, "seconds": round(res.wall_s, 2),
            "tokens_per_s": round(tokens / res.wall_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=REPO / "models" / "default")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    code = load_prompts(REPO / "data" / "humaneval_dev.jsonl")
    prompts = (code * (a.requests // len(code) + 1))[: a.requests]
    out = []
    for _ in range(a.repeats):
        for row in ROWS:
            out.append(run(a.models, row, prompts, a.concurrency, a.max_tokens))
            print(json.dumps(out[-1]), flush=True)
    median = {row: statistics.median(r["tokens_per_s"] for r in out if r["method"] == row) for row in ROWS}
    base = median["nospec"]
    result = {"args": {k: str(v) for k, v in vars(a).items()}, "rows": out, "median_tokens_per_s": median,
              "over_nospec": {row: round(v / base, 3) for row, v in median.items() if row != "nospec"}}
    print(json.dumps({"over_nospec": result["over_nospec"]}))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
