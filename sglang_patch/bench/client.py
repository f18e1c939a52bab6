"""Async HTTP client that sends a prompt set to one SGLang server at a fixed concurrency."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

import httpx

from sglang_patch.bench.prompts import BenchPrompt


@dataclass
class RequestResult:
    """What one ``/generate`` call returned.

    Attributes:
        pid: prompt id.
        output_ids: generated token ids (int), as the server reports them.
        completion_tokens: number of generated tokens.
        verify_ct: speculative verify steps for this request (0 without speculation).
        correct_drafts_histogram: index i = number of verify steps that accepted i draft tokens
            (accept length i + 1, bonus included); empty without speculation.
        latency_s: wall time of the request in seconds.
        graft_src: Graft's per-token source letters (``meta_info["graft_src"]``: one per accepted
            node's source, `graft_spec.sources.SOURCE_LETTERS`, and ``t`` for the target's token);
            empty otherwise.
        meta: the full ``meta_info`` dict.
    """

    pid: str
    output_ids: List[int]
    completion_tokens: int
    verify_ct: int
    correct_drafts_histogram: List[int]
    latency_s: float
    graft_src: str = ""
    meta: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    """One prompt set at one concurrency against one server.

    Attributes:
        results: per-prompt results in prompt order.
        wall_s: wall time from the first request sent to the last answer, seconds.
    """

    results: List[RequestResult]
    wall_s: float


def sampling_params(max_tokens: int, temperature: float = 0.0, top_p: float = 1.0) -> Dict[str, Any]:
    """SGLang ``sampling_params`` for the benchmark (``ignore_eos`` off so outputs are natural)."""
    return {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p}


async def _one(client: httpx.AsyncClient, url: str, prompt: BenchPrompt, params: Dict[str, Any],
               sem: asyncio.Semaphore) -> RequestResult:
    async with sem:
        t0 = time.perf_counter()
        resp = await client.post(f"{url}/generate", json={"text": prompt.text, "sampling_params": params})
        dt = time.perf_counter() - t0
    resp.raise_for_status()
    body = resp.json()
    meta = body.get("meta_info", {})
    return RequestResult(
        pid=prompt.pid,
        output_ids=list(body.get("output_ids") or []),
        completion_tokens=int(meta.get("completion_tokens", 0)),
        verify_ct=int(meta.get("spec_verify_ct", 0) or 0),
        correct_drafts_histogram=list(meta.get("spec_correct_drafts_histogram") or []),
        latency_s=dt,
        graft_src=str(meta.get("graft_src") or ""),
        meta=meta,
    )


async def run_prompts(url: str, prompts: Sequence[BenchPrompt], concurrency: int,
                      params: Dict[str, Any], timeout_s: float = 600.0) -> RunResult:
    """Send every prompt to ``url`` with at most ``concurrency`` requests in flight.

    Raises:
        httpx.HTTPError: a request failed (the benchmark treats any failure as fatal).
    """
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[_one(client, url, p, params, sem) for p in prompts])
        wall = time.perf_counter() - t0
    return RunResult(list(results), wall)


def run_prompts_sync(url: str, prompts: Sequence[BenchPrompt], concurrency: int,
                     params: Dict[str, Any], timeout_s: float = 600.0) -> RunResult:
    """Blocking wrapper of :func:`run_prompts`."""
    return asyncio.run(run_prompts(url, prompts, concurrency, params, timeout_s))
