"""Per-request retrieval state for the vLLM proposer, keyed by vLLM request id.

vLLM's proposer is told nothing about request arrival or completion; like vLLM's own
suffix proposer (v1/spec_decode/suffix_decoding.py:9-102) we diff the input batch each
step:

* a request id seen for the first time -> ``planner.start_request(prompt)`` and then
  ``extend`` with any output it already has (a resumed, preempted request);
* a known id -> ``extend`` with the tokens committed since the last step
  (``token_ids_cpu[i, cursor:num_tokens_no_spec[i]]``, gpu_model_runner.py:3538-3548
  writes them during bookkeeping, which Graft runs before the proposer);
* an id that is no longer in the batch (finished, aborted or preempted) ->
  ``planner.stop_request`` frees its state.

A new request's prompt bigrams warm-start the empty rows of the successor table
(`SuccessorTable.warm_start`); every committed transition (token t followed by token u) updates the successor
table with u as the target's top-1 after t (`SuccessorTable.update`). vLLM does not hand
the proposer the target logits, so ranks >= 1 are not observed here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from graft_spec.pipeline import GraftPlanner

__all__ = ["RequestTracker"]


class RequestTracker:
    """Keeps `GraftPlanner` retrieval state in step with vLLM's input batch.

    Args:
        planner: the proposer's `GraftPlanner`.
    """

    def __init__(self, planner: GraftPlanner):
        self.planner = planner
        self._cursor: dict[str, int] = {}  # req id -> tokens already given to the planner

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._cursor

    def __len__(self) -> int:
        return len(self._cursor)

    def sync(self, req_ids: Sequence[str], token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
             num_tokens: np.ndarray) -> None:
        """Start new requests, feed committed tokens, stop requests that left.

        Args:
            req_ids: request id of each batch row (``input_batch.req_ids``).
            token_ids: ``int[R, L]`` rows aligned with ``req_ids`` (``token_ids_cpu``).
            num_prompt_tokens: ``int[R]`` prompt length per row.
            num_tokens: ``int[R]`` committed tokens per row, prompt included
                (``num_tokens_no_spec``).
        """
        live = set(req_ids)
        for rid in [r for r in self._cursor if r not in live]:
            self.planner.stop_request(rid)
            del self._cursor[rid]
        prev: list[np.ndarray] = []
        nxt: list[np.ndarray] = []
        groups: list[np.ndarray] = []
        warm: list[tuple[np.ndarray, int]] = []
        for i, rid in enumerate(req_ids):
            n = int(num_tokens[i])
            cur = self._cursor.get(rid)
            if cur is None:
                cur = min(int(num_prompt_tokens[i]), n)
                self.planner.start_request(rid, token_ids[i, :cur].tolist())
                if cur > 1:   # prompt bigrams warm-start empty successor rows
                    warm.append((token_ids[i, :cur], self.planner.group_of(rid)))
            if n > cur:
                self.planner.extend(rid, token_ids[i, cur:n].tolist())
                lo = max(cur, 1)
                if n > lo:
                    prev.append(token_ids[i, lo - 1:n - 1])
                    nxt.append(token_ids[i, lo:n])
                    groups.append(np.full(n - lo, self.planner.group_of(rid), dtype=np.int64))
            self._cursor[rid] = max(n, cur)
        succ = self.planner.successor
        for p, g in warm if succ is not None else []:
            ids = torch.from_numpy(p.astype(np.int64))
            succ.warm_start(ids[:-1], ids[1:], torch.ones(ids.numel() - 1, dtype=torch.bool), g)
        if prev and succ is not None:
            t = torch.from_numpy(np.concatenate(prev).astype(np.int64))
            u = torch.from_numpy(np.concatenate(nxt).astype(np.int64))
            succ.update(t, u[:, None], torch.ones_like(t, dtype=torch.bool), torch.from_numpy(np.concatenate(groups)))

    def stop_all(self) -> None:
        """Free every request (engine shutdown / tests)."""
        for rid in list(self._cursor):
            self.planner.stop_request(rid)
        self._cursor.clear()
