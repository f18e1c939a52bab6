"""Per-request graft bookkeeping inside the SGLang scheduler process.

For every running request this keeps the planner's retrieval state in step with the tokens SGLang
has committed, and counts what graft contributed:

* created on the request's first decode round (``GraftPlanner.start_request`` with the prompt, then
  ``extend`` with the output so far, ending in the tree root), advanced after every verify with the
  committed tokens, freed when SGLang reports the request finished or aborted
  (``BaseSpecWorker.note_request_finished``, ``batch_result_processor.py:1442``);
* resynchronised whenever the invariant "the planner has seen ``seq_len + 1`` tokens, the last one
  being the root" breaks (retraction, grammar truncation), rebuilt from the request's tokens;
* entries of requests that stop showing up are swept after ``stale_rounds`` decode rounds, so a
  request that leaves without a finish notification (e.g. aborted while retracted) cannot leak.

Per emitted token the source is appended to ``req.customized_info["graft_src"]``, which SGLang
streams into the response ``meta_info`` (``output_streamer.py:688``, ``tokenizer_manager.py:2577``):
``"d"`` accepted draft node, ``"r"`` accepted retrieved (grafted) node, ``"p"`` accepted padding
node, ``"t"`` token chosen by the target (the bonus token of a round, or the prefill token).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Sequence

from graft_spec.tree import NUM_SOURCES, SOURCE_DRAFT, SOURCE_PADDING, SOURCE_RETRIEVED

logger = logging.getLogger(__name__)

#: ``customized_info`` key carrying one source letter per output token.
META_KEY = "graft_src"
SOURCE_LETTER = {SOURCE_DRAFT: "d", SOURCE_RETRIEVED: "r", SOURCE_PADDING: "p"}
TARGET_LETTER = "t"


@dataclass
class RequestStats:
    """Counters of one request (host ints)."""

    seen: int = 0                    # tokens the planner has seen (prompt + outputs incl. root)
    rounds: int = 0                  # verify rounds
    emitted: int = 0                 # tokens emitted by those rounds (sum of accept lengths)
    accepted: List[int] = field(default_factory=lambda: [0] * NUM_SOURCES)
    last_round: int = 0              # tracker round of the last touch (stale sweep)

    def summary(self) -> str:
        mean = self.emitted / self.rounds if self.rounds else 0.0
        d, r, p = self.accepted
        return (f"rounds={self.rounds} emitted={self.emitted} accept_len={mean:.3f} "
                f"accepted_draft={d} accepted_retrieved={r} accepted_padding={p}")


def resync_history(prompt: Sequence[int], outputs: Sequence[int], seq_len: int, root: int) -> List[int]:
    """The committed sequence the next tree hangs under: ``seq_len`` tokens, then the root.

    SGLang's host ``output_ids`` may lag or lead the device by a round; ``seq_len`` (KV-committed
    tokens) and the device root are authoritative, so the host tokens are cut to ``seq_len`` and
    the root appended. Returns fewer than ``seq_len + 1`` tokens only when the host knows fewer.
    """
    full = list(prompt) + list(outputs)
    return full[:seq_len] + [int(root)]


class GraftRequestTracker:
    """Request id -> `RequestStats`, driving ``GraftPlanner`` start / extend / stop.

    Args:
        planner: ``graft_spec.pipeline.GraftPlanner``.
        stale_rounds: decode rounds after which an untouched entry is swept.
    """

    def __init__(self, planner, stale_rounds: int = 4096):
        self.planner = planner
        self.stale_rounds = stale_rounds
        self.round = 0
        self.states: "OrderedDict[Hashable, RequestStats]" = OrderedDict()
        self.finished_total = 0

    # ------------------------------------------------------------------ lifecycle
    def live(self) -> int:
        """Requests holding graft state (tracker entries; planner state is freed with them)."""
        return len(self.states)

    def prepare(self, reqs: Sequence, seq_lens: Sequence[int], roots: Sequence[int]) -> List[Hashable]:
        """Make the planner's view of every request end at this round's root.

        Args:
            reqs: SGLang ``Req`` objects of the batch (``rid``, ``origin_input_ids``, ``output_ids``,
                ``customized_info``).
            seq_lens: committed lengths (host ints), row-aligned.
            roots: root tokens (host ints), row-aligned.
        Returns:
            Request ids, row-aligned (the planner's ``req_ids``).
        """
        self.round += 1
        rids = []
        for req, seq_len, root in zip(reqs, seq_lens, roots):
            rid = req.rid
            st = self.states.get(rid)
            if st is None or st.seen != seq_len + 1:
                history = resync_history(req.origin_input_ids, req.output_ids, seq_len, root)
                prompt_len = min(len(req.origin_input_ids), len(history))
                if st is None:
                    st = RequestStats()
                    self.states[rid] = st
                self.planner.start_request(rid, history[:prompt_len])
                self.planner.extend(rid, history[prompt_len:])
                st.seen = len(history)
                self._align_meta(req, len(history) - len(req.origin_input_ids))
            st.last_round = self.round
            self.states.move_to_end(rid)
            rids.append(rid)
        self._sweep()
        return rids

    def commit(self, reqs: Sequence, emitted: Sequence[Sequence[int]],
               node_sources: Sequence[Sequence[int]]) -> None:
        """Record one verify round.

        Args:
            reqs: the batch's ``Req`` objects.
            emitted: per request the committed tokens (accepted nodes' tokens, then the bonus).
            node_sources: per request the ``SOURCE_*`` of every accepted non-root node, in path order
                (``len == len(emitted) - 1``).
        """
        for req, toks, srcs in zip(reqs, emitted, node_sources):
            st = self.states.get(req.rid)
            if st is None:
                continue
            self.planner.extend(req.rid, toks)
            st.seen += len(toks)
            st.rounds += 1
            st.emitted += len(toks)
            for s in srcs:
                st.accepted[int(s)] += 1
            letters = [SOURCE_LETTER.get(int(s), "?") for s in srcs] + [TARGET_LETTER]
            meta = self._meta(req)
            if meta is not None:
                meta.extend(letters)

    def finish(self, rid: Hashable) -> None:
        """Free a finished / aborted request (no-op for unknown ids); logs its summary."""
        st = self.states.pop(rid, None)
        if st is None:
            return
        self.planner.stop_request(rid)
        self.finished_total += 1
        logger.info("graft request %s finished: %s live_requests=%d planner_live=%d",
                    rid, st.summary(), self.live(), self.planner.live_requests())

    def _sweep(self) -> None:
        while self.states:
            rid, st = next(iter(self.states.items()))
            if self.round - st.last_round <= self.stale_rounds:
                break
            self.states.pop(rid)
            self.planner.stop_request(rid)
            logger.info("graft request %s swept after %d idle rounds", rid, self.stale_rounds)

    # ------------------------------------------------------------------ meta info
    @staticmethod
    def _meta(req):
        info = getattr(req, "customized_info", None)
        if info is None:
            try:
                req.customized_info = info = {}
            except AttributeError:
                return None
        return info.setdefault(META_KEY, [])

    def _align_meta(self, req, outputs_so_far: int) -> None:
        """Make the source list cover exactly the outputs committed before this round."""
        meta = self._meta(req)
        if meta is None:
            return
        del meta[max(outputs_so_far, 0):]
        meta.extend([TARGET_LETTER] * (max(outputs_so_far, 0) - len(meta)))
