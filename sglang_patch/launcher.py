"""Start and stop a real SGLang server process on loopback (used by the benchmark and tests).

The server runs as ``python -m sglang.launch_server`` in its own process group so that teardown
kills the scheduler/detokenizer children too. Nothing here imports SGLang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import httpx

#: Arguments every CPU server needs (../shared/reference/sglang-cpu-facts.md). SGLang sizes the KV
#: pool from *free host RAM* measured around weight loading, so a small fraction fails at random when
#: other processes allocate meanwhile ("Loaded weights leave no GPU memory"); 0.5 with an explicit
#: ``--max-total-tokens`` cap is stable (later arguments override both). ``--sleep-on-idle``: an
#: idle scheduler otherwise spins at about one core, which starves 2-core machines.
CPU_SERVER_ARGS: List[str] = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--mem-fraction-static", "0.5",
    "--max-total-tokens", "65536",
    "--sleep-on-idle",
]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (racy by nature: `SGLangServer.start` retries a taken port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: uvicorn's message when the HTTP port is taken (the server then hangs in shutdown).
_PORT_TAKEN = "error while attempting to bind on address"
_PORT_TRIES = 3


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time; ``log_tail`` holds its output."""

    def __init__(self, msg: str, log_tail: str):
        super().__init__(f"{msg}\n--- server log tail ---\n{log_tail}")
        self.log_tail = log_tail


@dataclass
class SGLangServer:
    """A running (or startable) SGLang server.

    Attributes:
        model_path: target model directory.
        args: extra CLI arguments (after the CPU defaults).
        env: extra environment variables for the server process.
        log_path: where stdout/stderr go.
        port: loopback port (a free one when 0).
        startup_timeout_s: seconds to wait for ``/health_generate``.
        startup_s: seconds the last `start` took (until the first healthy generation).
    """

    model_path: str
    args: Sequence[str] = ()
    env: Dict[str, str] = field(default_factory=dict)
    log_path: Optional[str] = None
    port: int = 0
    startup_timeout_s: float = 600.0
    cpu_defaults: bool = True
    proc: Optional[subprocess.Popen] = None
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:30000``."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> List[str]:
        """The full command line."""
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if self.cpu_defaults:
            cmd += CPU_SERVER_ARGS
        return cmd + list(self.args)

    def log_tail(self, n_chars: int = 6000) -> str:
        """Last characters of the server log."""
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")[-n_chars:]

    def start(self) -> "SGLangServer":
        """Start the process and wait until it answers a generation health check.

        With ``port = 0`` a free port is picked, and picked again (3 tries) when the server reports
        it taken: `free_port` is racy, and a TP server's own rendezvous ports can land on it (seen:
        uvicorn "address already in use" after the model loaded, the process then hanging).

        Raises:
            ServerStartError: the process exited, or did not get healthy within the timeout.
        """
        auto = not self.port
        tries = _PORT_TRIES if auto else 1
        t0 = time.perf_counter()
        for _ in range(tries):
            if auto:
                self.port = free_port()
            if not self.log_path:
                self.log_path = f"/tmp/sglang_server_{self.port}.log"
            if self._start_once():
                self.startup_s = time.perf_counter() - t0
                return self
            self.stop()
        raise ServerStartError(f"port {self.port} already in use ({tries} tries)", self.log_tail())

    def _start_once(self) -> bool:
        """One launch; True when healthy, False when the server reported its port taken."""
        env = dict(os.environ)
        env.update(self.env)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if _PORT_TAKEN in self.log_tail(20000):
                    return False
                raise ServerStartError(f"server exited with {self.proc.returncode}", self.log_tail())
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=30).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if _PORT_TAKEN in self.log_tail(20000):
                return False
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"server not healthy after {self.startup_timeout_s:.0f} s", self.log_tail())

    def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the whole process group (SIGTERM, then SIGKILL after ``grace_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()   # a stopped process group does not act on SIGTERM
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=grace_s)

    def pause(self) -> None:
        """Stop the whole process group (SIGSTOP): an idle server's threads still take time slices
        from the one being measured on a small machine. A no-op when the process is not running."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue a paused process group (SIGCONT); a no-op when the process is not running."""
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def alone(active: "SGLangServer", servers: Iterable["SGLangServer"]) -> Iterator["SGLangServer"]:
    """Run ``active`` with every other server of ``servers`` paused (`SGLangServer.pause`); all are
    running again on exit. On a 2-core machine an idle server's threads take time slices from the
    measured one, and a round of many small ops suffers more from that than a decode step."""
    others = [s for s in servers if s is not active]
    for s in others:
        s.pause()
    active.resume()
    try:
        yield active
    finally:
        for s in others:
            s.resume()


def start_all(servers: Sequence["SGLangServer"]) -> List["SGLangServer"]:
    """Start ``servers`` at once (a thread each) and wait for all: a start is mostly single-threaded
    imports, so two starts on two cores take about as long as one.

    Returns:
        ``servers``, every one healthy.
    Raises:
        ServerStartError: the first start that failed, after every server was stopped.
    """
    errors: List[BaseException] = []

    def start(srv: "SGLangServer") -> None:
        try:
            srv.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(srv,), daemon=True) for srv in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for srv in servers:
            srv.stop()
        raise errors[0]
    return list(servers)
