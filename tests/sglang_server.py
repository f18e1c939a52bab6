"""Test helper: real SGLang server processes on loopback, and a tiny client for them.

The process management is ``sglang_patch.launcher.SGLangServer`` (free port on 127.0.0.1, own
process group, waits for ``/health_generate``, SIGTERM then SIGKILL of the whole group); this module
adds what tests need around it:

* `serve` - context manager for session/module fixtures: start, yield, always stop.
* `serve_all` - the same for several servers, started at once (``launcher.start_all``).
* `generate` / `generate_many` - ``/generate`` with ``input_ids`` (token ids in, token ids out),
  concurrency via threads.
* `accept_length` - mean accept length from ``meta_info`` (completion tokens / verify rounds).
* `stream_text` - the text of an OpenAI-style SSE stream (``/v1/completions`` or chat).

Usage::

    @pytest.fixture(scope="session")
    def server():
        with serve(model, ["--speculative-algorithm", "EAGLE3", ...], name="eagle") as srv:
            yield srv
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import httpx

from sglang_patch.launcher import CPU_SERVER_ARGS, SGLangServer, ServerStartError, free_port, start_all

__all__ = ["CPU_SERVER_ARGS", "SGLangServer", "ServerStartError", "free_port", "serve", "serve_all", "generate",
           "generate_many", "accept_length", "stream_text"]

#: Generous per-request HTTP timeout (s) for 2-core CPU runs; tests bound their own total time.
REQUEST_TIMEOUT_S = 600.0


def _log_path(name: str) -> str:
    """The default server log: ``$TMPDIR/sglang_<name>_<time>.log``."""
    return str(Path(tempfile.gettempdir()) / f"sglang_{name}_{int(time.time())}.log")


@contextlib.contextmanager
def serve(model_path: str | os.PathLike, args: Sequence[str] = (), *, name: str = "server",
          env: Optional[Mapping[str, str]] = None, log_path: Optional[str] = None,
          startup_timeout_s: float = 600.0) -> Iterator[SGLangServer]:
    """Start ``python -m sglang.launch_server`` with the CPU defaults plus ``args``; stop on exit.

    Args:
        model_path: target model directory.
        args: extra server CLI arguments.
        name: tag used in the default log file name (``$TMPDIR/sglang_<name>_<time>.log``).
        env: extra environment variables for the server.
        log_path: explicit log file.
        startup_timeout_s: how long to wait for the first healthy generation.
    Yields:
        the running `SGLangServer` (``.url``, ``.log_tail()``).
    Raises:
        ServerStartError: the server died or never became healthy (log tail included).
    """
    if log_path is None:
        log_path = _log_path(name)
    srv = SGLangServer(model_path=str(model_path), args=list(args), env=dict(env or {}),
                       log_path=log_path, startup_timeout_s=startup_timeout_s)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def serve_all(specs: Sequence[tuple], startup_timeout_s: float = 600.0) -> Iterator[list[SGLangServer]]:
    """`serve` for several servers, started at once; all stopped on exit.

    Args:
        specs: ``(model_path, args, name, env)`` per server (``env`` may be None).
    Yields:
        the running servers, in the order of ``specs``.
    Raises:
        ServerStartError: a server did not start (every server is stopped first).
    """
    servers = [SGLangServer(model_path=str(model), args=list(args), env=dict(env or {}), log_path=_log_path(name),
                            startup_timeout_s=startup_timeout_s) for model, args, name, env in specs]
    try:
        start_all(servers)
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def generate(url: str, input_ids: Sequence[int], *, max_new_tokens: int = 32,
             temperature: float = 0.0, **sampling) -> dict:
    """POST ``/generate`` with token ids; returns the JSON (``output_ids``, ``meta_info``, ...)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, **sampling}
    r = httpx.post(f"{url}/generate", json={"input_ids": list(input_ids), "sampling_params": params},
                   timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()


def generate_many(url: str, prompts_ids: Sequence[Sequence[int]], *, concurrency: int = 1,
                  **kwargs) -> list[dict]:
    """`generate` for every prompt with ``concurrency`` requests in flight; results in order."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda ids: generate(url, ids, **kwargs), prompts_ids))


def accept_length(results: Sequence[dict]) -> float:
    """Mean accept length over ``results``: completion tokens / verify rounds (bonus included).

    Raises:
        AssertionError: no speculative verify round was reported.
    """
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    rounds = sum(r["meta_info"].get("spec_verify_ct", 0) for r in results)
    assert rounds > 0, "the server reported no speculative verify rounds"
    return tokens / rounds


def stream_text(url: str, body: dict, chat: bool) -> str:
    """POST ``body`` (with ``"stream": true``) to an OpenAI-style endpoint and join the streamed
    text pieces (``delta.content`` for chat, ``text`` otherwise). Asserts the stream ends with
    ``[DONE]``."""
    parts, done = [], False
    with httpx.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            choices = json.loads(data)["choices"]
            if choices:
                piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                parts.append(piece or "")
    assert done, "stream did not end with [DONE]"
    return "".join(parts)
