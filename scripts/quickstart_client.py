#!/usr/bin/env python
"""Send real prompts to a running Graft SGLang server and report outputs and accept lengths.

    python scripts/quickstart_client.py --url http://127.0.0.1:PORT --prompts data/humaneval_dev.jsonl

Reads a JSONL file (HumanEval rows: ``prompt``; MT-Bench rows: first of ``turns``), sends each prompt
to SGLang's native ``/generate`` endpoint (greedy unless ``--temperature`` > 0), prints the output
and, per request, the accept length SGLang reports (``meta_info.spec_accept_length`` = completion
tokens / verify rounds, bonus included) and how many accepted tokens came from draft nodes and from
grafted (retrieved) nodes (``meta_info.graft_src``, one letter per output token). Ends with the mean
accept length over all requests (total completion tokens / total verify rounds). Exits non-zero if
the server does not answer or reports no speculative rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import httpx


def load_prompts(path: Path, n: int) -> list[tuple[str, str]]:
    """``[(id, prompt)]`` from HumanEval-style (``prompt``) or MT-Bench-style (``turns``) rows."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        text = row["prompt"] if "prompt" in row else row["turns"][0]
        rows.append((str(row.get("id", len(rows))), text))
        if len(rows) >= n:
            break
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--n", type=int, default=8, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()

    prompts = load_prompts(args.prompts, args.n)
    total_tokens = total_rounds = 0
    sources: Counter = Counter()
    with httpx.Client(base_url=args.url, timeout=600) as client:
        for pid, prompt in prompts:
            r = client.post("/generate", json={
                "text": prompt,
                "sampling_params": {"temperature": args.temperature, "top_p": args.top_p,
                                    "max_new_tokens": args.max_new_tokens},
            })
            r.raise_for_status()
            out = r.json()
            meta = out["meta_info"]
            rounds = int(meta.get("spec_verify_ct", 0))
            tokens = int(meta["completion_tokens"])
            src = Counter(meta.get("graft_src", []))
            total_tokens += tokens
            total_rounds += rounds
            sources.update(src)
            acc = f"{tokens / rounds:.2f}" if rounds else "n/a"
            print(f"=== {pid}: {tokens} tokens, {rounds} verify rounds, accept length {acc}, "
                  f"accepted draft={src['d']} grafted={src['r']}")
            print(prompt.rstrip()[-300:])
            print("--- output ---")
            print(out["text"].rstrip())
            print()
    if total_rounds == 0:
        print("quickstart: the server reported no speculative verify rounds", file=sys.stderr)
        return 1
    accepted = sources["d"] + sources["r"] + sources["p"]
    share = sources["r"] / accepted if accepted else 0.0
    print(f"mean accept length: {total_tokens / total_rounds:.3f} "
          f"({total_tokens} tokens / {total_rounds} verify rounds over {len(prompts)} prompts); "
          f"accepted draft tokens {sources['d']}, grafted tokens {sources['r']} ({share:.1%} of accepted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
