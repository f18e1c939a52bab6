"""EAGLE-3's per-position acceptance in SGLang against vLLM's, same head, chains of the same K.

Runs in the SGLang venv (``.venv``), after ``python -m vllm_worker.bench`` wrote its JSON in the engine
venv (its ``eagle3`` greedy rows at batch 1 hold vLLM's per-position counters and outputs)::
    .venv-vllm/bin/python -m vllm_worker.bench --methods eagle3 --modes greedy --json bench_out/vllm.json
    .venv/bin/python -m vllm_worker.sglang_compare bench_out/vllm.json --json bench_out/sglang_eagle3.json

SGLang 0.5.23 serves the same target and head on CPU (`sglang_patch.launcher.SGLangServer`, float32,
``--speculative-eagle-topk 1 --speculative-num-steps K --speculative-num-draft-tokens K+1``: one chain
of K per round). SGLang reports no per-position counts, so each request is streamed from ``/generate``
with ``--stream-interval 1``: one chunk per verify round (``meta_info.completion_tokens`` is
cumulative; the first chunk is the prefill's token), so a round's accepted drafts = its chunk - 1 and
position i's rate = rounds with at least i accepted / rounds. A request's last round shows only the
tokens up to ``max_new_tokens``, while vLLM's counters also count drafts accepted past it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from sglang_patch.launcher import SGLangServer
from vllm_worker.bench import load_prompt_set

__all__ = ["stream_rounds", "main"]


def stream_rounds(url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[int], dict]:
    """Greedy ``/generate`` streamed: (tokens per chunk, output ids, last meta_info)."""
    import httpx

    sizes, last, out, meta = [], 0, [], {}
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            j = json.loads(line[5:])
            n = j["meta_info"]["completion_tokens"]
            if n > last:
                sizes.append(n - last)
                last = n
            out, meta = j.get("output_ids") or out, j["meta_info"]
    return sizes, out, meta


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("vllm_json", help="vllm_worker.bench JSON with eagle3 greedy rows at batch 1")
    p.add_argument("--json", default=None)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer


    ref = json.loads(Path(args.vllm_json).read_text())
    a = ref["args"]
    k, n_new = a["k"], a["max_tokens"]
    tok = AutoTokenizer.from_pretrained(a["target"])
    srv = SGLangServer(model_path=a["target"], args=[
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", a["draft"],
        "--speculative-eagle-topk", "1", "--speculative-num-steps", str(k),
        "--speculative-num-draft-tokens", str(k + 1), "--dtype", "float32", "--stream-interval", "1"],
        env={}, log_path=str(Path(args.json or "sglang_compare.json").with_suffix(".log")),
        startup_timeout_s=args.startup_timeout)
    res = {}
    srv.start()
    try:
        for spec in a["sets"]:
            name, prompts = load_prompt_set(spec, a["prompts"])
            (row,) = [r for r in ref["rows"] if r["method"] == "eagle3" and r["set"] == name
                      and r["mode"] == "greedy" and r["batch"] == 1]
            per_pos, rounds, per_req = [0] * k, 0, []
            for i, (kind, text) in enumerate(prompts):
                if kind == "chat":
                    text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
                sizes, out, meta = stream_rounds(srv.url, tok(text)["input_ids"], n_new)
                for s in sizes[1:]:
                    rounds += 1
                    for j in range(min(s - 1, k)):
                        per_pos[j] += 1
                per_req.append({"chunks": sizes, "verify_ct": meta.get("spec_verify_ct"),
                                "vllm_drafts": row["per_call"][i]["drafts"], "equal": out == row["tokens"][i]})
            res[name] = {"sglang_rounds": rounds, "sglang_per_pos": per_pos, "vllm_drafts": row["drafts"],
                         "vllm_per_pos": row["per_pos"], "requests": per_req}
            print(f"{name}: rounds sglang {rounds} vllm {row['drafts']}; per position sglang "
                  f"{[round(x / rounds, 3) for x in per_pos]} vllm {[round(x / row['drafts'], 3) for x in row['per_pos']]}; "
                  f"outputs equal {all(r['equal'] for r in per_req)}", flush=True)
    finally:
        srv.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
