"""Per-request graft bookkeeping inside the SGLang scheduler process (host side only).

For every running request this keeps the planner's host sources (suffix index, corpus tail) in step
with the tokens the *host* knows, and records what graft contributed:

* `GraftRequestTracker.prepare` (each round, before the graft step): a request seen for the first
  time, or whose known tokens shrank (retraction), is (re)started from ``origin_input_ids +
  output_ids``; otherwise only the new ``output_ids`` are appended. Under the overlap scheduler
  ``output_ids`` lag the device by a round; the graft step re-anchors the host's proposals on the
  device (graft_spec/step.py), so nothing here reads the device.
* `GraftRequestTracker.record` (from the round's host output, after SGLang has committed the
  tokens and before it streams them, ``auxiliary_output.py``): with ``return_sources`` on
  (`GraftConfig.return_sources`, off by default), per request the source of each newly visible token
  is appended to ``req.customized_info["graft_src"]``, which SGLang streams into the
  response ``meta_info`` (``output_streamer.py:688``): one letter per accepted node's source
  (`graft_spec.sources.SOURCE_LETTERS`: ``d`` draft, ``s`` successor, ``x`` suffix, ``c`` corpus,
  ``l`` lookup, ``o`` outputs, ``a`` agreement of draft and retrieval, ``p`` padding), and ``t`` for
  the token chosen by the target (each round's bonus token, and the prefill token). Per-request counters feed the log line written when
  the request finishes (server-wide figures: ``graft_spec.stats.GraftStats``).
* freed when SGLang reports the request finished or aborted (``note_request_finished``,
  ``batch_result_processor.py:1442``), or when a round's result shows it finished without that
  notification. SGLang sends it only from decode-result processing; a request that finishes in its
  prefill (its first token is a stop token) is, under the overlap scheduler, already in the
  next decode batch (built before the prefill's result is processed) and is skipped by that batch's
  result processing (``batch_result_processor.py:1022``): `record` frees it instead, and `prepare`
  starts no state for a request that is already finished. An entry outside a round's batch is
  freed at that round when its request is finished (aborted while retracted: no notification, no
  round), and after ``stale_rounds`` rounds without a touch in any case.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, List, Optional, Sequence

from graft_spec.pipeline import NUM_SOURCES, SOURCE_LETTERS, SOURCE_NAMES

logger = logging.getLogger(__name__)

#: ``customized_info`` key carrying one source letter per output token.
META_KEY = "graft_src"
TARGET_LETTER = "t"


def is_finished(req) -> bool:
    """SGLang's ``Req.finished()`` (False for request objects without it)."""
    finished = getattr(req, "finished", None)
    return bool(finished()) if callable(finished) else False


def tenant_of(req) -> Optional[tuple]:
    """A request's isolation key for ``retrieval.isolation: tenant``: SGLang's own pair
    ``(extra_key, cache_salt)``, the key of its radix cache (``mem_cache/radix_cache.py:62``; a LoRA
    adapter's id is part of ``extra_key``, ``schedule_batch.py:1166``), or None when the request has
    neither (such requests share one group, as they share cached prefixes)."""
    key = (getattr(req, "extra_key", None) or None, getattr(req, "cache_salt", None) or None)
    return None if key == (None, None) else key


def is_sampled(req) -> bool:
    """True when ``req`` is verified by sampling: SGLang normalises temperature 0 to ``top_k = 1``
    (``sampling_params.py:245``), the same test as `GraftWorker.sampled_rows` on the batch."""
    return getattr(getattr(req, "sampling_params", None), "top_k", 1) > 1


@dataclass
class RequestStats:
    """Counters of one request (host ints)."""

    rounds: int = 0                  # verify rounds
    emitted: int = 0                 # tokens emitted by those rounds (sum of accept lengths)
    accepted: List[int] = field(default_factory=lambda: [0] * NUM_SOURCES)
    last_round: int = 0              # tracker round of the last touch (stale sweep)
    req: object = field(default=None, repr=False)   # SGLang's Req (its final output_ids at finish)

    def summary(self) -> str:
        mean = self.emitted / self.rounds if self.rounds else 0.0
        accepted = " ".join(f"accepted_{name}={n}" for name, n in zip(SOURCE_NAMES, self.accepted) if n)
        return f"rounds={self.rounds} emitted={self.emitted} accept_len={mean:.3f} {accepted}".rstrip()


class GraftRequestTracker:
    """Request id -> `RequestStats`, driving ``GraftPlanner`` start / extend / stop.

    Args:
        planner: ``graft_spec.pipeline.GraftPlanner``.
        stale_rounds: rounds after which an untouched entry is swept.
        on_free: called with the request id whenever a request is freed (`finish`, known or not,
            and the sweep): per-request state held elsewhere follows the tracker's lifecycle
            (the worker's batch budget: its gain curves).
    """

    def __init__(self, planner, stale_rounds: int = 4096, on_free: Optional[Callable[[Hashable], None]] = None,
                 return_sources: bool = False):
        self.planner = planner
        self.return_sources = return_sources
        self.stale_rounds = stale_rounds
        self.on_free = on_free
        self.round = 0
        self.states: "OrderedDict[Hashable, RequestStats]" = OrderedDict()
        self.finished_total = 0

    # ------------------------------------------------------------------ lifecycle
    def live(self) -> int:
        """Requests holding graft state (tracker entries; planner state is freed with them)."""
        return len(self.states)

    def prepare(self, reqs: Sequence) -> List[Hashable]:
        """Bring the host sources up to the tokens each request has committed (host view).

        Args:
            reqs: SGLang ``Req`` objects of the batch (``rid``, ``origin_input_ids``, ``output_ids``).
        Returns:
            Request ids, row-aligned (the planner's ``req_ids``).
        """
        self.round += 1
        rids = []
        for req in reqs:
            rid = req.rid
            if is_finished(req):   # a row the overlap scheduler runs past its end: no state (unknown row)
                rids.append(rid)
                continue
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = RequestStats()
            self.planner.catch_up(rid, req.origin_input_ids, req.output_ids, tenant=tenant_of(req),
                                  sampled=is_sampled(req))
            st.last_round, st.req = self.round, req
            self.states.move_to_end(rid)
            rids.append(rid)
        self._sweep()
        return rids

    def record(self, reqs: Sequence, commits: Sequence, sources: Sequence[Sequence[int]]) -> None:
        """One verified round, as the scheduler commits it (host data only).

        Requests that are finished afterwards are freed (`finish`; a no-op where SGLang's finish
        notification already did it).

        Args:
            reqs: the batch's ``Req`` objects.
            commits: per request SGLang's ``CommittedTokens`` (``output_index``, ``token_ids``: the
                newly visible tokens) or None.
            sources: per request the source (graft_spec/sources.py) of each accepted non-root node in path order, -1
                after the path (the bonus token follows them).
        """
        for req, commit, srcs in zip(reqs, commits, sources):
            st = self.states.get(req.rid)
            accepted = [int(s) for s in srcs if s >= 0]
            if st is not None:
                st.rounds += 1
                st.emitted += len(accepted) + 1
                for s in accepted:
                    st.accepted[s] += 1
            if commit is None or not self.return_sources:
                continue
            letters = [SOURCE_LETTERS[s] if s < NUM_SOURCES else "?" for s in accepted] + [TARGET_LETTER]
            meta = self._meta(req)
            if meta is not None:
                start = commit.output_index
                del meta[start:]
                meta.extend([TARGET_LETTER] * (start - len(meta)))   # the prefill token(s)
                meta.extend(letters[: len(commit.token_ids)])
        for req in reqs:
            if is_finished(req):
                self.finish(req.rid)

    def finish(self, rid: Hashable) -> None:
        """Free a finished / aborted request (no-op for unknown ids); logs its summary.

        The host sources first get the output tokens committed since the last `prepare` (the last
        round's, two rounds' under the overlap scheduler): SGLang calls this after the request's
        ``output_ids`` are final (``batch_result_processor.py:1442``), and the output index inserts
        the request's output when it stops, so a later request sees the whole output.
        """
        if self.on_free is not None:
            self.on_free(rid)
        st = self.states.pop(rid, None)
        if st is None:   # never prepared (it finished in prefill or decoded in plain rounds only)
            if self.planner.stop_request(rid):
                self.finished_total += 1
                logger.info("graft request %s finished: rounds=0 emitted=0 (no speculative round) "
                            "live_requests=%d planner_live=%d", rid, self.live(), self.planner.live_requests())
            return
        outputs = getattr(st.req, "output_ids", None)
        if outputs is not None:   # the final output tokens reach the output index before it stops
            self.planner.catch_up(rid, st.req.origin_input_ids, outputs, tenant=tenant_of(st.req),
                                  sampled=is_sampled(st.req))
        self.planner.stop_request(rid)
        self.finished_total += 1
        logger.info("graft request %s finished: %s live_requests=%d planner_live=%d",
                    rid, st.summary(), self.live(), self.planner.live_requests())

    def _sweep(self) -> None:
        """Free the entries outside this round's batch (the front of `states`, least recently
        prepared first) whose request is finished - e.g. aborted while retracted, which SGLang
        finishes without a notification - and those untouched for more than ``stale_rounds``."""
        outside = []
        for rid, st in self.states.items():
            if st.last_round == self.round:          # this round's batch: every later entry is in it
                break
            outside.append((rid, st))
        for rid, st in outside:
            if is_finished(st.req):
                self.finish(rid)
            elif self.round - st.last_round > self.stale_rounds:
                self.states.pop(rid)
                self.planner.stop_request(rid)
                if self.on_free is not None:
                    self.on_free(rid)
                logger.info("graft request %s swept after %d idle rounds", rid, self.stale_rounds)

    @staticmethod
    def _meta(req) -> Optional[list]:
        info = getattr(req, "customized_info", None)
        if info is None:
            try:
                req.customized_info = info = {}
            except AttributeError:
                return None
        return info.setdefault(META_KEY, [])
