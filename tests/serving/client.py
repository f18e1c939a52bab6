"""Async HTTP client helpers for the serving tests (httpx, loopback only).

* `generate` - one ``POST /generate`` (token ids or text in, JSON out; the status code is kept).
* `stream_and_disconnect` - a streaming ``/generate`` whose client closes the connection after a
  few chunks (SGLang aborts the request: ``http_server.py`` ``create_abort_task``).
* `run_bounded` - run coroutines with at most ``concurrency`` in flight.
* `server_stats` / `wait_idle` - ``GET /server_info`` -> ``internal_states[0]["graft"]``
  (``sglang_patch.server_stats``), and polling until the server is idle again.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence

import httpx

#: Per-request HTTP timeout (s); the tests bound their total time themselves.
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Reply:
    """One HTTP answer: ``status``, parsed ``body`` (dict, or {"raw": text} when not JSON)."""

    status: int
    body: Dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def output_ids(self) -> List[int]:
        return list(self.body["output_ids"])


def payload(prompt, sampling: Dict[str, Any], **extra) -> Dict[str, Any]:
    """``/generate`` body: ``prompt`` is a str (``text``) or a list of token ids (``input_ids``)."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    return {key: prompt, "sampling_params": dict(sampling), **extra}


def _parse(r: httpx.Response) -> Reply:
    try:
        body = r.json()
    except (json.JSONDecodeError, ValueError):
        body = {"raw": r.text}
    if not isinstance(body, dict):
        body = {"value": body}
    return Reply(r.status_code, body)


async def generate(client: httpx.AsyncClient, url: str, body: Dict[str, Any]) -> Reply:
    """``POST {url}/generate`` with ``body``; never raises on HTTP error codes."""
    return _parse(await client.post(f"{url}/generate", json=body, timeout=REQUEST_TIMEOUT_S))


async def post(client: httpx.AsyncClient, url: str, path: str, body: Dict[str, Any]) -> Reply:
    """``POST {url}{path}`` (e.g. ``/v1/completions``); never raises on HTTP error codes."""
    return _parse(await client.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S))


@dataclass
class StreamResult:
    """What a disconnecting client saw: data chunks read, and whether the stream had ended."""

    chunks: int = 0
    ended: bool = False
    last: Optional[Dict[str, Any]] = None


async def stream_and_disconnect(client: httpx.AsyncClient, url: str, body: Dict[str, Any],
                                after_chunks: int = 2) -> StreamResult:
    """Stream ``/generate`` and close the connection after ``after_chunks`` data chunks.

    Leaving the ``stream`` context before the body is read closes the connection (httpx does not
    return a half-read connection to the pool), which is a client disconnect for the server.
    """
    res = StreamResult()
    async with client.stream("POST", f"{url}/generate", json={**body, "stream": True},
                             timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                res.ended = True
                break
            res.chunks += 1
            res.last = json.loads(data)
            if (res.last.get("meta_info", {}).get("finish_reason") or None) is not None:
                res.ended = True
            if res.chunks >= after_chunks:
                break
    return res


async def run_bounded(factories: Sequence[Callable[[], Awaitable[Any]]], concurrency: int) -> List[Any]:
    """Await every ``factory()`` with at most ``concurrency`` running; results in input order.

    Exceptions are returned in place of results (nothing is lost silently: callers assert).
    """
    sem = asyncio.Semaphore(concurrency)

    async def one(f):
        async with sem:
            try:
                return await f()
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                return exc

    return list(await asyncio.gather(*(one(f) for f in factories)))


def new_client(concurrency: int = 64) -> httpx.AsyncClient:
    """An AsyncClient with enough connections for ``concurrency`` requests in flight."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S)


# ---------------------------------------------------------------------------------- server stats
def server_stats(url: str) -> Dict[str, Any]:
    """``GET /server_info`` -> ``internal_states[0]["graft"]`` (see ``sglang_patch.server_stats``)."""
    info = httpx.get(f"{url}/server_info", timeout=60).json()
    return info["internal_states"][0]["graft"]


async def aserver_stats(client: httpx.AsyncClient, url: str) -> Dict[str, Any]:
    """Async `server_stats`."""
    info = (await client.get(f"{url}/server_info", timeout=60)).json()
    return info["internal_states"][0]["graft"]


def idle_problems(stats: Dict[str, Any], baseline: Dict[str, Any]) -> List[str]:
    """Why ``stats`` is not back at the idle ``baseline`` (empty list: idle).

    Idle: no running/waiting request, no KV slot in use (free + radix-evictable == capacity, as at
    the baseline), nothing locked in the radix cache, every request slot free, no graft request
    state (tracker, planner and the batch budget's gain curves), and no new SGLang leak warning.
    """
    p = []
    kv, base_kv = stats["kv"], baseline["kv"]
    if stats["queues"] != {"running": 0, "waiting": 0}:
        p.append(f"queues {stats['queues']}")
    if kv["used"] != base_kv["used"]:
        p.append(f"kv used {kv['used']} (idle {base_kv['used']})")
    if kv["available"] + kv["evictable"] != base_kv["available"] + base_kv["evictable"]:
        p.append(f"kv free+evictable {kv['available'] + kv['evictable']} "
                 f"(idle {base_kv['available'] + base_kv['evictable']})")
    if kv["protected"] != 0:
        p.append(f"kv protected {kv['protected']}")
    if stats["req_slots"]["available"] != baseline["req_slots"]["available"]:
        p.append(f"req slots available {stats['req_slots']} (idle {baseline['req_slots']})")
    if stats["leak_warnings"] != baseline["leak_warnings"]:
        p.append(f"SGLang leak warnings {stats['leak_warnings']} (idle {baseline['leak_warnings']})")
    w = stats.get("worker")
    if w is not None and (w["live_requests"] != 0 or w["planner_live_requests"] != 0):
        p.append(f"graft live requests {w['live_requests']} planner {w['planner_live_requests']}")
    held = {k: v for k, v in ((w or {}).get("planner_state") or {}).items() if v}
    if held:
        p.append(f"graft planner still holds per-request state {held}")
    tracked = ((w or {}).get("batch_budget") or {}).get("tracked_requests", 0)
    if tracked:
        p.append(f"batch budget still tracks {tracked} requests")
    return p


def wait_idle(url: str, baseline: Dict[str, Any], timeout_s: float = 60.0) -> Dict[str, Any]:
    """Poll `server_stats` until `idle_problems` is empty; returns the idle stats.

    Raises:
        AssertionError: still not idle after ``timeout_s`` (the message lists what is held).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server_stats(url)
        problems = idle_problems(stats, baseline)
        if not problems:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s:.0f} s: {problems}; stats={stats}")
        time.sleep(0.5)


def healthy(url: str) -> bool:
    """``GET /health_generate`` answers 200 (runs a one-token generation through the scheduler)."""
    try:
        return httpx.get(f"{url}/health_generate", timeout=120).status_code == 200
    except httpx.HTTPError:
        return False
