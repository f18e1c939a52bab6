"""What a plain (verify width 1) graft round costs against a no-spec decode step, on this machine.

Two servers, one after the other, same target and prompts: no speculation, and graft with every
request opted out of speculation (``custom_params: {"graft_speculate": false}``), so every graft
round is the batch budget's width-1 round (SGLang's ``steps = 0`` path: verify-mode forward plus
the EAGLE draft extend). Each sends the 20 dev code prompts (token-healed, repeated to
``--requests``) with ``--concurrency`` in flight, ``ignore_eos`` and ``--max-tokens`` new tokens,
after one warm-up wave. Prints one JSON line per server and the ratio (docs/sglang_graft.md, "The
batch budget").

    .venv/bin/python scripts/bench_plain_round.py --json bench_out/plain_round.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_patch.bench.prompts import completion_text  # noqa: E402
from sglang_patch.launcher import SGLangServer  # noqa: E402
from sglang_patch.verify_widths import OPT_OUT_KEY  # noqa: E402


def run(models: Path, graft: bool, prompts: list, concurrency: int, max_tokens: int) -> dict:
    """tokens/s of one server over ``prompts`` (after a warm-up wave of ``concurrency`` requests)."""
    args = ["--dtype", "float32", "--max-running-requests", str(concurrency)]
    if graft:
        args += ["--speculative-algorithm", "graft", "--speculative-draft-model-path", str(models / "draft"),
                 "--speculative-num-steps", "4", "--speculative-eagle-topk", "4",
                 "--speculative-num-draft-tokens", "24"]
    params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if graft:
        params["custom_params"] = {OPT_OUT_KEY: False}

    with SGLangServer(str(models / "target"), args) as srv:
        def gen(ids):
            r = httpx.post(f"{srv.url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=600)
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(gen, prompts[:concurrency]))
            t0 = time.perf_counter()
            tokens = sum(pool.map(gen, prompts))
            dt = time.perf_counter() - t0
    return {"method": "graft_plain_rounds" if graft else "nospec", "tokens": tokens, "seconds": round(dt, 2),
            "tokens_per_s": round(tokens / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=REPO / "models" / "default")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(a.models / "target"))
    rows = [json.loads(x) for x in (REPO / "data" / "humaneval_dev.jsonl").read_text().splitlines()]
    ids = [tok.encode(completion_text(r["prompt"]), add_special_tokens=False) for r in rows]
    prompts = (ids * (a.requests // len(ids) + 1))[: a.requests]
    out = [run(a.models, graft, prompts, a.concurrency, a.max_tokens) for graft in (False, True)]
    for row in out:
        print(json.dumps(row))
    result = {"args": {k: str(v) for k, v in vars(a).items()}, "rows": out,
              "plain_over_nospec": round(out[1]["tokens_per_s"] / out[0]["tokens_per_s"], 3)}
    print(json.dumps({"plain_over_nospec": result["plain_over_nospec"]}))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
