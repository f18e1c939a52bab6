"""Engine cases for graft's tree verification in vLLM (tests/test_vllm_engine.py): chunked prefill,
preemption and the prefix cache, in one engine per method.

``python tests/vllm_engine_cases.py METHOD OUT.json`` (in the engine venv; METHOD ``none`` or ``graft``)
starts one ``LLM`` (float32, shipped pair, K 4) with a prefill chunk of 64 tokens (prompts of up to
~300 tokens are prefilled in pieces while other requests verify trees) and a KV cache of `BLOCKS`
blocks of 32 tokens (8 requests at once cannot all stay resident: vLLM preempts and recomputes).
``graft`` runs with the prefix cache on, ``none`` with it off. It writes:

* ``single``: the greedy output of the first dev prompt, alone (48 tokens);
* ``repeat``: that prompt followed by its output, as token ids (with the cache on, the blocks the
  first request computed are hits), greedy output (24 tokens), and ``prefix_hits``, vLLM's
  ``vllm:prefix_cache_hits`` over that request;
* ``batch``: greedy outputs of 8 dev prompts, 48 tokens each, all submitted at once, and
  ``preemptions``, vLLM's ``vllm:num_preemptions`` over them;
* ``sampled``: `SAMPLES` draws of 3 tokens after the first prompt's first `SAMPLE_PROMPT_CHARS`
  characters (temperature 0.8, top-p 0.95):
  the first token comes from the prefill step, the next two from verification steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BLOCKS = 18
BLOCK_SIZE = 32
CHUNK = 64
SAMPLES = 300
SAMPLE_PROMPT_CHARS = 60


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:num_preemptions", "vllm:prefix_cache_hits"):
            out[m.name] = out.get(m.name, 0) + int(getattr(m, "value", 0))
    return out


def main() -> int:
    method, out_path = sys.argv[1], Path(sys.argv[2])
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_worker.bench import load_prompt_set

    spec = None if method == "none" else {"method": "graft", "model": "models/default/draft",
                                          "num_speculative_tokens": 4}
    llm = LLM(model="models/default/target", dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, disable_log_stats=False, speculative_config=spec, enable_chunked_prefill=True,
              max_num_batched_tokens=CHUNK, max_num_seqs=8, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=BLOCKS, enable_prefix_caching=method != "none")
    _, prompts = load_prompt_set("dev=data/humaneval_dev.jsonl+data/mtbench_dev.jsonl", 4)
    texts = [t for _, t in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    one = llm.generate(texts[:1], [greedy], use_tqdm=False)[0]
    first = list(one.prompt_token_ids) + list(one.outputs[0].token_ids)
    c0 = counters(llm)
    again = llm.generate([TokensPrompt(prompt_token_ids=first)], [SamplingParams(temperature=0, max_tokens=24)],
                         use_tqdm=False)
    c1 = counters(llm)
    outs = llm.generate(texts, [greedy] * len(texts), use_tqdm=False)
    c2 = counters(llm)
    # unseeded: vLLM-CPU 0.32 rewinds a seeded request's generator in a partial prefill with set_offset,
    # which CPU generators refuse (gpu_model_runner.py:3502), with or without speculation
    draws = llm.generate([texts[0][:SAMPLE_PROMPT_CHARS]] * SAMPLES,
                         SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3), use_tqdm=False)
    out_path.write_text(json.dumps({
        "single": list(one.outputs[0].token_ids),
        "repeat": list(again[0].outputs[0].token_ids),
        "batch": [list(o.outputs[0].token_ids) for o in outs],
        "prefix_hits": c1.get("vllm:prefix_cache_hits", 0) - c0.get("vllm:prefix_cache_hits", 0),
        "preemptions": c2.get("vllm:num_preemptions", 0) - c1.get("vllm:num_preemptions", 0),
        "sampled": [list(o.outputs[0].token_ids) for o in draws]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
