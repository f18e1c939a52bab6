"""Containment: an exception in graft's own round code never reaches SGLang's scheduler.

An exception that escapes a worker call kills SGLang's scheduler process, and with it the server and
every running request. Graft's own code in a round (the stop gate, the host proposals, the graft
step, the round's bookkeeping, the width choice, the prefill's state) runs under `RoundGuard.call`:
a failure is logged with its traceback, counted (``/server_info`` ``worker.round_failures``, the
``graft:round_failures_total`` series), and replaced by a fallback that keeps the round lossless and
every tensor-parallel rank on the same path:

| failing part | fallback |
|---|---|
| the width choice (batch budget, catch-up plan) | a plain round |
| the eager stop gate | no stop (with TP: a gate that follows the first rank's decisions) |
| the host proposals | none for the round (the draft and the device sources still propose) |
| the graft step | `StepOutput.padding`: the root and padding nodes, verified as usual |
| the round's bookkeeping, the prefill's state, the host output | skipped for the round |

None of the fallbacks changes the shapes of the round or the collectives it runs, so ranks whose own
host state failed still run what the first rank runs (every rank verifies the first rank's tree).
After `MAX_FAILURES` contained failures the guard turns speculation off for the server: the first
rank picks plain rounds from then on (broadcast to the others as every width choice is), with one
error line in the log. SGLang's own code (the forwards, sampling, the scheduler) is not wrapped.

Fault injection for tests: ``GRAFT_FAULT_FAILING_ROUNDS=3,5`` makes the graft step raise in those
decode rounds (counted per worker from 1).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict, Optional, TypeVar

import torch

__all__ = ["RoundGuard", "FollowingGate", "MAX_FAILURES", "FAILING_ROUNDS_ENV", "InjectedFault"]

logger = logging.getLogger(__name__)

#: Contained failures after which speculation stays off for the server.
MAX_FAILURES = 3
#: Fault injection: the decode rounds (1-based, comma-separated) whose graft step raises.
FAILING_ROUNDS_ENV = "GRAFT_FAULT_FAILING_ROUNDS"

T = TypeVar("T")


class InjectedFault(RuntimeError):
    """The failure ``GRAFT_FAULT_FAILING_ROUNDS`` asks for."""


class RoundGuard:
    """Failure counts and the speculation switch of one graft worker.

    Args:
        on_failure: called with the stage name after each contained failure (metrics), or None.
        max_failures: contained failures after which `off` is True.
    """

    def __init__(self, on_failure: Optional[Callable[[str], None]] = None, max_failures: int = MAX_FAILURES):
        self.on_failure = on_failure
        self.max_failures = max_failures
        self.failures: Dict[str, int] = {}
        self.off = False
        self.rounds = 0
        spec = os.environ.get(FAILING_ROUNDS_ENV, "")
        self._inject = {int(x) for x in spec.split(",") if x.strip()}

    @property
    def total(self) -> int:
        """Contained failures so far."""
        return sum(self.failures.values())

    def call(self, stage: str, fn: Callable[..., T], *args, fallback: Callable[[], T] = lambda: None,
             **kwargs) -> T:
        """``fn(*args, **kwargs)``, or ``fallback()`` when it raises (the failure is contained)."""
        try:
            return fn(*args, **kwargs)
        except Exception:   # noqa: BLE001  (containment: whatever graft's code raised)
            self.failed(stage)
            return fallback()

    def failed(self, stage: str) -> None:
        """Count, log (with the traceback of the exception being handled) and maybe turn off."""
        self.failures[stage] = self.failures.get(stage, 0) + 1
        logger.exception("graft: %s failed in decode round %d; the round continues without it (failure %d of %d "
                         "before speculation is turned off)", stage, self.rounds, self.total, self.max_failures)
        if self.on_failure is not None:
            try:
                self.on_failure(stage)
            except Exception:   # noqa: BLE001  (metrics must not fail the round either)
                logger.debug("graft: failure metric not recorded", exc_info=True)
        if not self.off and self.total >= self.max_failures:
            self.off = True
            logger.error("graft: %d failures of graft's own round code (%s); speculation is off for this server "
                         "from now on: every decode round is a plain decode step", self.total, self.failures)

    def next_round(self) -> None:
        """A decode round starts (fault injection counts rounds)."""
        self.rounds += 1

    def inject(self) -> None:
        """Raise `InjectedFault` in the rounds ``GRAFT_FAULT_FAILING_ROUNDS`` names (tests)."""
        if self.rounds in self._inject:
            raise InjectedFault(f"{FAILING_ROUNDS_ENV}: injected failure in decode round {self.rounds}")

    def summary(self) -> dict:
        """``/server_info`` view."""
        return {"total": self.total, "by_stage": dict(self.failures), "speculation_off": self.off}


class FollowingGate:
    """The eager stop gate of a rank whose own gate failed (tensor parallelism only): it decides
    nothing itself and takes the first rank's decision after every depth, so this rank runs as many
    draft forwards (and their collectives) as its peers. The interface of
    `graft_spec.gate.ExpectedGainGate`.

    Args:
        agree: the worker's broadcast of the first rank's decision (a 0-dim bool tensor).
    """

    retrieved = None

    def __init__(self, agree: Callable[[torch.Tensor], torch.Tensor]):
        self.agree = agree
        self.stop_depth: Optional[int] = None

    def observe(self, depth: int, best: torch.Tensor) -> bool:
        """The first rank's stop decision after ``depth`` (one broadcast and host read)."""
        if self.stop_depth is not None:
            return True
        if bool(self.agree(torch.zeros((), dtype=torch.bool, device=best.device))):
            self.stop_depth = depth
            return True
        return False
