"""Per-request state of the vLLM proposer, keyed by vLLM request id.

vLLM's proposer is told nothing about request arrival or completion; like vLLM's own suffix
proposer (v1/spec_decode/suffix_decoding.py:9-102) we diff the input batch each step:

* a request id seen for the first time gets an engine slot (a stable row of the planner's token
  history), ``planner.catch_up`` with its prompt and any output it already has (a resumed,
  preempted request: the host sources) and ``planner.prefill`` (token window, successor warm
  start from the prompt): the same two calls as SGLang's adapter;
* a known id -> ``planner.catch_up``: the tokens committed since the last step
  (``token_ids_cpu[i, cursor:num_tokens_no_spec[i]]``, written during bookkeeping, which Graft
  runs before the proposer, gpu_model_runner.py:4345-4455);
* an id that is neither in the batch nor alive in the runner (``runner.requests``: finished or
  aborted; gpu_model_runner.py:1183-1186 pops them) -> ``planner.stop_request`` and its slot is
  freed. A request the scheduler merely left out of this step (unscheduled, or preempted and
  waiting: gpu_model_runner.py:1213-1233 removes it from the batch but keeps its cached state)
  keeps its state and slot.

The tracker also knows how many of each request's tokens its slot's device window holds
(`held`), so the step can refill a window that missed tokens (a request that was left out of a
step) instead of proposing from a stale one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import numpy as np
import torch

from graft_spec.pipeline import GraftPlanner

__all__ = ["RequestTracker"]


@dataclass
class _Req:
    slot: int
    cursor: int   # tokens (prompt included) given to the planner's host sources
    held: int     # tokens (prompt included) the slot's device window ends at


class RequestTracker:
    """Keeps `GraftPlanner` per-request state in step with vLLM's input batch.

    Args:
        planner: the proposer's `GraftPlanner`.
    """

    def __init__(self, planner: GraftPlanner):
        self.planner = planner
        self._reqs: dict[str, _Req] = {}
        self._free: list[int] = []
        self._slots = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def slot(self, req_id: str) -> int:
        """The request's engine slot. Raises KeyError for an unknown id."""
        return self._reqs[req_id].slot

    def held(self, req_id: str) -> int:
        """Tokens (prompt included) the request's device window ends at (0: unknown id)."""
        r = self._reqs.get(req_id)
        return r.held if r is not None else 0

    def advance(self, req_id: str, n: int) -> None:
        """``n`` committed tokens were appended to the request's device window (`observe_committed`)."""
        if req_id in self._reqs:
            self._reqs[req_id].held += int(n)

    def refilled(self, req_id: str, n: int) -> None:
        """The request's device window was rewritten to end at token ``n``."""
        self._reqs[req_id].held = int(n)

    def sync(self, req_ids: Sequence[str], token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
             num_tokens: np.ndarray, alive: Optional[Collection[str]] = None,
             sampled: Optional[Sequence[bool]] = None) -> np.ndarray:
        """Start new requests, feed committed tokens, stop requests that are gone.

        Args:
            req_ids: request id of each batch row (``input_batch.req_ids``).
            token_ids: ``int[R, L]`` rows aligned with ``req_ids`` (``token_ids_cpu``).
            num_prompt_tokens: ``int[R]`` prompt length per row.
            num_tokens: ``int[R]`` committed tokens per row, prompt included
                (``num_tokens_no_spec``).
            alive: ids the engine still holds (``runner.requests``); a tracked id outside the batch
                but alive keeps its state. None = only the batch is alive.
            sampled: per row, True when the request is verified by sampling (temperature > 0).
        Returns:
            ``int64[R]`` the rows' engine slots.
        """
        live = set(req_ids) | (set(alive) if alive is not None else set())
        for rid in [r for r in self._reqs if r not in live]:
            self.planner.stop_request(rid)
            self._free.append(self._reqs.pop(rid).slot)
        slots = np.zeros(len(req_ids), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            n = int(num_tokens[i])
            p = min(int(num_prompt_tokens[i]), n)
            r = self._reqs.get(rid)
            if r is None:
                slot = self._free.pop() if self._free else self._new_slot()
                self._start(rid, slot, token_ids[i, :p].tolist(), token_ids[i, p:n].tolist(),
                            bool(sampled[i]) if sampled is not None else False)
                r = self._reqs[rid] = _Req(slot, n, n)
            elif n > r.cursor:
                self.planner.catch_up(rid, token_ids[i, :p], token_ids[i, p:n])
                r.cursor = n
            slots[i] = r.slot
        return slots

    def _start(self, rid: str, slot: int, prompt: list, output: list, sampled: bool) -> None:
        """A new request on ``slot``: the host sources (`GraftPlanner.catch_up`), then its token
        window and the successor warm start from its prompt (`GraftPlanner.prefill`)."""
        planner = self.planner
        planner.catch_up(rid, prompt, output, sampled=sampled)
        planner.ensure_slots(slot + 1)
        dev = planner.device
        planner.prefill([rid], torch.tensor([slot], device=dev), [prompt + output],
                        extend_ids=torch.tensor(prompt, dtype=torch.int64, device=dev), extend_lens=[len(prompt)])

    def _new_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def stop_all(self) -> None:
        """Free every request (engine shutdown / tests)."""
        for rid in list(self._reqs):
            self.planner.stop_request(rid)
        self._free.extend(r.slot for r in self._reqs.values())
        self._reqs.clear()
