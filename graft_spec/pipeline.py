"""`GraftPlanner`: the one object engine adapters call, and the order they call it in.

Per decode round (paper Algorithm 1/2), host work first, device work after:

    # host, while the accelerator drafts (no device read):
    host = planner.host_candidates(req_ids)            # suffix / corpus proposals, one upload
    # device, static shapes, no host read:
    out  = planner.build(draft, roots, host, slots, seq_lens, sampled)   # calibrated graft step
    ... target verify over out.tree.tokens with out.mask / out.positions ...
    acc  = planner.observe(out, on_path, target_topk, committed, accept_len, slots)
    # host, whenever the engine has the committed tokens on the host anyway:
    planner.extend(req_id, tokens)

plus ``start_request`` with the prompt and ``stop_request`` when a request finishes or is aborted.

This module is the one door of the core: engine adapters import it and `graft_spec.config` only.
Besides the planner it exports the data types that cross the door (`DraftCandidates`,
`HostCandidates`, `StepOutput`, `DraftTree`, `RoundStats`), the host-side controllers an adapter
drives (`BatchBudget`, `DraftStopGate`, `StepGraphs`), the names of the tree sources and calibration
members, and the reference tree / verify functions an engine's CPU execution layer runs in place of
its device kernels.
The host may lag the device by a round (overlap scheduler): proposals are anchored at the context
the host knows, and the step re-anchors them on the device (step.py). ``observe`` only touches
device state (calibration counts, successor table, token history).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

from .budget import BatchBudget
from .calibration import BinLayout, Calibrator
from .chain import Chain, ChainPricer, spine_tree
from .config import GraftConfig
from .gate import ExpectedGainGate, draft_bounds
from .graphs import StepGraphs
from .prune import DraftStopGate
from .retrieval.buffer import HostCandidateBuffer, HostCandidates
from .retrieval.corpus import CorpusIndex
from .retrieval.output_ring import OutputRing
from .retrieval.retriever import Retriever
from .retrieval.successor import SuccessorTable
from .history import TokenHistory
from .kernels import fused_kernels_for, fused_ops_everywhere, kernel_path, use_reference_kernels
from .kernels.registry import fused_op
from .kernels.tree_sample import tree_sample
from .kernels.observe import gain_columns, observe_rows
from .kernels.views import Commit, ObserveOptions, Prices, RoundOutcome
from .kernels.successor import PRIVATE_GROUP
from .request_correction import RequestCorrection
from .step import DenseDraft, DraftCandidates, GraftStep, StepOutput, dense_draft_candidates, tree_draft_candidates
from .stats import GraftStats, prometheus_enabled
from .sources import (GRAFTED_SOURCES, NUM_MEMBERS, NUM_SOURCES, SOURCE_DRAFT, SOURCE_LETTERS, SOURCE_NAMES,
                      SOURCE_PADDING)
from .tree import (DraftTree, ancestor_mask, chain_links, eagle_step, node_depths, node_paths,
                   on_path_from_accept_index, parents_from_mask, path_min, pointer_jumps, sibling_links)
from .verify import greedy_verify, sample_verify

#: Successor-table rows (hashed) of each request's own group under ``retrieval.isolation: request``.
REQUEST_TABLE_ROWS = 4096

__all__ = [
    # the planner and what a round returns
    "GraftPlanner", "RoundRetrieval", "RoundStats", "on_path_from_accept_index", "on_path_from_tokens",
    "PRIVATE_GROUP",
    # data crossing the door
    "DraftCandidates", "DenseDraft", "HostCandidates", "StepOutput", "DraftTree", "dense_draft_candidates",
    "tree_draft_candidates",
    # host-side controllers an adapter drives
    "BatchBudget", "DraftStopGate", "StepGraphs",
    # which implementation the fused ops run, and the start-up fallback to the references
    "kernel_path", "use_reference_kernels",
    # names: the sources of tree nodes (graft_spec/sources.py)
    "SOURCE_DRAFT", "SOURCE_PADDING", "NUM_SOURCES", "NUM_MEMBERS", "SOURCE_NAMES", "SOURCE_LETTERS",
    "GRAFTED_SOURCES",
    # reference tree / verify functions (an engine's CPU execution layer) and chain verification
    "ancestor_mask", "node_depths", "node_paths", "sibling_links", "chain_links", "parents_from_mask", "eagle_step",
    "greedy_verify", "sample_verify", "tree_sample", "spine_tree", "Chain", "ChainPricer",
    # serving statistics (host accumulators, graft:* Prometheus series)
    "GraftStats", "prometheus_enabled",
    # the fused kernels' switches (graft_spec/kernels): op counting, and an adapter's own fused ops
    "fused_ops_everywhere", "fused_kernels_for", "fused_op",
]


def on_path_from_tokens(tree: DraftTree, committed: torch.Tensor, lens: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes lie on the path the target took, from the tokens it committed after the root.

    For an engine that verifies a chain only (vLLM 0.33): under greedy decoding the committed
    tokens are the target's own continuation, so a tree node at depth d <= ``lens`` lies on the
    accepted path of the full tree exactly when its path equals the first d committed tokens. A
    deeper node is a known miss when one of its ancestors within the committed depth already
    differs from the committed token there (nothing below a rejected node is accepted); it is
    unknown only when its whole path within the committed depth matches (the target's continuation
    past ``lens`` was not observed).

    Args:
        tree: the round's tree ``[B, N]``.
        committed: ``int64[B, L]`` tokens committed after the root (accepted, then the bonus).
        lens: ``int64[B]`` how many are valid (0..L).
    Returns:
        ``(on_path bool[B, N], known bool[B, N])``: known = depth <= lens, or an ancestor (or the
        node) within depth <= lens is off the committed path; the root is always known and on path.
    """
    jumps = pointer_jumps(tree.parents)
    depth = node_depths(tree.parents, jumps)
    lw = committed.shape[1]
    within = depth <= lens[:, None]
    want = committed.gather(1, (depth - 1).clamp(0, lw - 1))
    # past the committed depth a node neither matches nor misses: only its ancestors decide
    match = torch.where((depth == 0) | ~within, True, tree.tokens == want).float()
    prefix_ok = path_min(match, tree.parents, jumps) > 0.5
    return prefix_ok & within, within | ~prefix_ok


@dataclass
class RoundStats:
    """What a verified round leaves for the host, as device tensors.

    Attributes:
        sources: ``int64[B, N - 1]`` the source (graft_spec/sources.py) of each accepted non-root node in path
            order, -1 after the path.
        members: ``float64[B, NUM_MEMBERS, 3]`` (trials, sum of estimates, hits) per row and member
            source (`graft_spec.stats.GraftStats.record_round` sums the rows of the host copy: no device
            op).
        depths: ``float64[B, D + 1, 2]`` (verified, accepted) nodes per row and depth (row 0 unused).
        expected: ``float32[B, W]`` expected accept length (bonus included) of a tree of each of the
            config's verify widths (``GraftConfig.verify_widths``) from this round's candidates, and
            of the tree actually verified in the last column (the batch budget, budget.py); None
            when not computed.
    """

    sources: torch.Tensor
    members: torch.Tensor
    depths: torch.Tensor
    expected: Optional[torch.Tensor] = None


class GroupMap:
    """Isolation keys (tenant keys or request ids) -> groups of the cross-request retrieval state
    (successor table, output index), with the requests of each key counted.

    A key keeps its group while any request of it runs, and after that until the group is needed:
    a new key takes a free group, else the least recently used group no request holds (the caller
    resets it: ``fresh`` is True). When every group is held, a new key gets `PRIVATE_GROUP`: its
    requests learn nothing across requests and are proposed nothing learnt from others.

    Args:
        capacity: number of groups.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._map: "OrderedDict[Hashable, int]" = OrderedDict()   # key -> group, least recent first
        self._held: dict[Hashable, int] = {}                       # key -> running requests
        self._free = list(range(capacity - 1, -1, -1))

    def acquire(self, key: Hashable) -> tuple[int, bool]:
        """``(group, fresh)`` for one more running request of ``key``: fresh when the group was just
        (re)assigned to ``key``; `PRIVATE_GROUP` (fresh False, nothing held) when every group is held."""
        if key in self._map:
            self._map.move_to_end(key)
            self._held[key] = self._held.get(key, 0) + 1
            return self._map[key], False
        if self._free:
            g = self._free.pop()
        else:
            idle = next((k for k in self._map if not self._held.get(k)), None)
            if idle is None:
                return PRIVATE_GROUP, False
            g = self._map.pop(idle)
        self._map[key] = g
        self._held[key] = 1
        return g, True

    def release(self, key: Hashable, forget: bool = False) -> None:
        """One request of ``key`` stopped. With ``forget`` (keys that never recur: request ids) the
        key's group is free again once no request holds it."""
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
            return
        self._held.pop(key, None)
        if forget and key in self._map:
            self._free.append(self._map.pop(key))

    def held(self) -> int:
        """Keys with a running request."""
        return len(self._held)


@dataclass
class RoundRetrieval:
    """What one eager round's stop gate computed before drafting and its build reuses.

    Attributes:
        est: ``float32[bins]`` the calibrator's estimate table of the round (`Calibrator.table`).
        hist, count: ``int64[B, L]`` / ``int64[B]`` the slots' token windows (`TokenHistory.gather`).
        factors: the rows' per-request correction (`RequestCorrection.factors`), or None.
        parts: `GraftStep.retrieve`'s priced candidates, one `Candidates` block ``[B, C_i]`` per source.

    Valid for the round it was made in only: nothing between the gate and the build (drafting)
    changes the calibrator, the history or the host candidates.
    """

    est: torch.Tensor
    hist: torch.Tensor
    count: torch.Tensor
    factors: Optional[tuple]
    parts: list


class GraftPlanner:
    """Config, calibrator, retrieval state and the step of one engine instance.

    Args:
        config: validated `GraftConfig`.
        vocab_size: target vocabulary size V (successor table rows).
        device: the engine's device (step, successor table, calibrator, commit log).
        max_batch: largest batch (host candidate buffer rows; grows on demand).
        max_slots: engine slots of the token history (SGLang: request-pool size; grows on demand).
        corpus: prebuilt `CorpusIndex` (overrides ``retrieval.corpus_path``).
    """

    def __init__(self, config: GraftConfig, vocab_size: int, device: torch.device | str = "cpu",
                 max_batch: int = 1, max_slots: int = 1, corpus: Optional[CorpusIndex] = None):
        self.config, self.vocab_size = config, vocab_size
        self.device = torch.device(device)
        self._cols: dict = {}
        r = config.retrieval
        n = config.num_draft_tokens
        groups = {"shared": 1, "tenant": r.max_tenants, "request": 2 * max(max_batch, 1) + 8}[r.isolation]
        self.groups = GroupMap(groups)
        self.successor = (SuccessorTable(vocab_size, k=r.successor_k, max_depth=r.successor_max_depth,
                                         size=min(r.max_candidates, n - 1), prior=r.successor_prior,
                                         groups=groups,
                                         rows=REQUEST_TABLE_ROWS if r.isolation == "request" else None,
                                         device=self.device)
                          if r.successor else None)
        slots = self.successor.size if self.successor else 0
        prior = self.successor.slot_prior if self.successor else torch.zeros(0)
        self.calibrator = Calibrator(BinLayout(config.depth, slots), prior, max_depth=max(n, 64), device=self.device,
                                     source_window=config.calibration.source_window)
        #: per-request windows of the retrieval sources' acceptance (request_correction.py)
        self.request_correction = RequestCorrection(max_slots, config.calibration.request_window,
                                                    device=self.device)
        self.retriever = Retriever.from_config(config, corpus, vocab_size=vocab_size)
        #: earlier requests' outputs, on the device (retrieval/output_ring.py), or None
        self.outputs = (OutputRing(r.outputs_max_tokens, r.match_len, n - 1, r.outputs_max_request_tokens, self.device)
                        if any(r.outputs_modes) and r.isolation != "request" else None)
        width = r.max_candidates if self.retriever.sources else 0
        self.buffer = HostCandidateBuffer(max_batch, width, self.device)
        self.history = TokenHistory(max_slots, r.history_len, self.device)
        self.slots_fixed = False   # `fix_slots`: set when graphs capture the per-slot buffers
        self.dump_slot: Optional[int] = None   # `fix_slots`: the padding rows' slot
        #: the captured step (`capture_graphs`) `build` replays, or None (eager)
        self.graphs: Optional[StepGraphs] = None
        self.step = self._new_step(n)
        #: the step of every verify width >= 2 of the batch budget (the full width is `step`)
        self.steps = {w: (self.step if w == n else self._new_step(w)) for w in config.verify_widths if w >= 2}
        self._seen: dict[Hashable, int] = {}
        self._prompt_len: dict[Hashable, int] = {}
        self._group: dict[Hashable, int] = {}
        self._key: dict[Hashable, Hashable] = {}

    @staticmethod
    def state_bytes(config: GraftConfig, vocab_size: int, max_batch: int, max_slots: int) -> dict:
        """Device bytes the planner of ``config`` holds, by part, from the sizes `__init__` uses (the
        KV reserve takes them off before an engine sizes its KV cache): the successor table of every
        isolation group (``int32[G * (R + 2), k]``), the output index's ring and m-gram tables
        (`OutputRing.index_bytes`) and the token history (``int64[slots, L + 1]``).

        Args:
            vocab_size: V; max_batch: the engine's largest batch; max_slots: its request slots.
        Returns:
            ``{"successor_table": int, "output_index": int, "token_history": int}``.
        """
        r = config.retrieval
        groups = {"shared": 1, "tenant": r.max_tenants, "request": 2 * max(max_batch, 1) + 8}[r.isolation]
        rows = min(REQUEST_TABLE_ROWS if r.isolation == "request" else vocab_size, vocab_size)
        table = groups * (rows + 2) * r.successor_k * 4 if r.successor else 0
        ring = 0
        if any(r.outputs_modes) and r.isolation != "request":
            c = r.outputs_max_tokens
            lengths = sum(1 for m in OutputRing.MATCH_LENGTHS if m <= r.match_len) or 1
            ring = 8 * (2 * c + lengths * (1 << max(1, (2 * c - 1).bit_length())))
        return {"successor_table": int(table), "output_index": int(ring),
                "token_history": int(max(max_slots, 1) * (r.history_len + 1) * 8)}

    def _new_step(self, width: int) -> GraftStep:
        return GraftStep(self.config, self.calibrator, self.successor, self.device, width, self.outputs)

    # ------------------------------------------------------------------ host lifecycle
    def assign_group(self, req_id: Hashable, tenant: Optional[Hashable] = None) -> int:
        """The request's isolation group (``retrieval.isolation``), assigned on first call and held
        until `stop_request`: 0 when shared, its tenant key's group (``tenant``: the key; None = the
        requests without one, which share a group) or its own; `PRIVATE_GROUP` when every group is
        held by running requests of other keys. A group handed over from another key is reset on the
        device first (no host read)."""
        if req_id in self._group:
            return self._group[req_id]
        mode = self.config.retrieval.isolation
        if mode == "shared":
            g, fresh, key = 0, False, None
        else:
            key = req_id if mode == "request" else ("tenant", tenant)
            g, fresh = self.groups.acquire(key)
        if fresh and self.successor is not None:
            self.successor.reset_group(g)
        if fresh and self.outputs is not None:
            self.outputs.forget_group(g)
        self._group[req_id] = g
        self._key[req_id] = key
        return g

    def start_request(self, req_id: Hashable, prompt_ids: Sequence[int], tenant: Optional[Hashable] = None,
                      sampled: bool = False) -> None:
        """Register a request and index its prompt (idempotent: restarts the request).

        Args:
            tenant: the request's tenant label (``retrieval.isolation: tenant``; None = the default tenant).
            sampled: the request is verified by sampling (SGLang: ``top_k > 1`` after its sampling
                parameters are normalised). Its output goes into the output index only when the index
                proposes to rows of its mode (``retrieval.outputs``; `OutputRing.start`).
        """
        ids = [int(t) for t in prompt_ids]
        group = self.assign_group(req_id, tenant)
        self._seen[req_id] = len(ids)
        self._prompt_len[req_id] = len(ids)
        self.retriever.start(req_id, ids, tenant)
        if self.outputs is not None:
            keep = self.config.retrieval.outputs_modes[int(bool(sampled))] and group != PRIVATE_GROUP
            self.outputs.start(req_id, ids, group, keep=keep)

    def catch_up(self, req_id: Hashable, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 tenant: Optional[Hashable] = None, sampled: bool = False) -> bool:
        """Bring the host sources up to a request's committed tokens as the engine holds them: the
        one way both engines' request trackers start and feed a request. An unknown request, one whose
        prompt changed, or one with fewer tokens than the host has seen (preempted and recomputed) is
        (re)started (`start_request` with the prompt, `extend` with the output); otherwise the
        output tokens the host has not seen are passed to `extend`.

        Args:
            prompt_ids, output_ids: host token ids (sequences or 1-D arrays; only the unseen tail is
                read for a known request).
            tenant, sampled: as for `start_request`.
        Returns:
            True when the request was (re)started.
        """
        p, total = len(prompt_ids), len(prompt_ids) + len(output_ids)
        seen = self._seen.get(req_id)
        if seen is None or seen > total or self._prompt_len.get(req_id) != p:
            self.start_request(req_id, prompt_ids, tenant=tenant, sampled=sampled)
            if len(output_ids):
                self.extend(req_id, output_ids)
            return True
        if seen < total:
            self.extend(req_id, output_ids[seen - p:])
        return False

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        """Tokens ``req_id`` committed since the last call (host view), in order."""
        if req_id in self._seen:
            self._seen[req_id] += len(new_tokens)
            toks = [int(t) for t in new_tokens]
            self.retriever.extend(req_id, toks)
            if self.outputs is not None:
                self.outputs.extend(req_id, toks)

    def stop_request(self, req_id: Hashable) -> bool:
        """Free all per-request state (finished or aborted request); a request with output goes into
        the output index (`OutputRing.stop`) first. Returns True when the planner held state for it
        (False: unknown or already freed, nothing done)."""
        held = req_id in self._seen or req_id in self._group
        if self.outputs is not None:
            self.outputs.stop(req_id)
        self._seen.pop(req_id, None)
        self._prompt_len.pop(req_id, None)
        self._group.pop(req_id, None)
        key = self._key.pop(req_id, None)
        if key is not None:
            self.groups.release(key, forget=self.config.retrieval.isolation == "request")
        self.retriever.stop(req_id)
        return held

    def clear_cache(self) -> None:
        """Forget the text earlier requests left behind - the successor table and the output index -
        as SGLang's ``/flush_cache`` forgets cached prefixes (``scheduler.py:5518``; NGRAM resets its
        trie there, ``ngram_worker.py:150``). The calibration and the configured corpus stay: they
        hold acceptance statistics and operator-supplied text, not earlier requests' tokens.
        Device tables are emptied in place; call it with no request running (SGLang flushes only
        when the scheduler is idle)."""
        if self.successor is not None:
            self.successor.clear()
        if self.outputs is not None:
            self.outputs.clear()

    def group_of(self, req_id: Hashable) -> int:
        """The request's isolation group (0 when it has none yet)."""
        return self._group.get(req_id, 0)

    def seen(self, req_id: Hashable) -> int:
        """Context tokens (prompt + outputs) the host sources have seen for ``req_id`` (0: unknown)."""
        return self._seen.get(req_id, 0)

    def live_requests(self) -> int:
        """Requests with state in the planner or any source."""
        return max(len(self._seen), len(self._group), self.retriever.live_requests(),
                   self.outputs.live_requests() if self.outputs is not None else 0)

    def state_counts(self) -> dict:
        """Per-request entries held (``/server_info``; all 0 when no request runs): requests with a
        group, with host-source state, live in the output index, and isolation keys held."""
        return {"grouped": len(self._group), "host_sources": max(len(self._seen), self.retriever.live_requests()),
                "output_index": self.outputs.live_requests() if self.outputs is not None else 0,
                "keys_held": self.groups.held()}

    def retrieval_sources(self) -> list:
        """Every retrieval source object of this planner: the host sources (`Retriever.sources`),
        then the successor table and the output index when enabled (stats endpoints read their
        ``memory_bytes`` / ``live_requests``)."""
        extra = [x for x in (self.successor, self.outputs) if x is not None]
        return list(self.retriever.sources) + extra

    def memory_bytes(self) -> int:
        """Approximate bytes held by the retrieval sources (host) and the successor table (device)."""
        return (self.retriever.memory_bytes() + (self.successor.memory_bytes() if self.successor else 0)
                + (self.outputs.memory_bytes() if self.outputs is not None else 0))

    # ------------------------------------------------------------------ per round
    def host_candidates(self, req_ids: Sequence[Hashable], speculate: Optional[Sequence[bool]] = None
                        ) -> HostCandidates:
        """Fill one buffer row per request (host only) and upload the batch with one copy.

        Each row is anchored at the context the sources have seen (`seen`) and carries the request's
        isolation group; unknown requests get an empty row. ``speculate``: per request False = it
        opted out of speculation (default: all True).
        """
        b = len(req_ids)
        self.buffer.ensure(b)
        for row, rid in enumerate(req_ids):
            self.retriever.fill(self.buffer, row, rid, self.seen(rid), self.group_of(rid),
                                True if speculate is None else bool(speculate[row]))
        return self.buffer.upload(b, self._host_destination(b))

    def no_host_candidates(self, req_ids: Sequence[Hashable], speculate: Optional[Sequence[bool]] = None
                           ) -> HostCandidates:
        """`host_candidates` with every row empty and in no isolation group (`PRIVATE_GROUP`): what a
        round uses when its host proposals could not be made (the draft and the device sources still
        propose, nothing is learnt across requests)."""
        b = len(req_ids)
        self.buffer.ensure(b)
        for row, rid in enumerate(req_ids):
            self.buffer.clear(row, self.seen(rid), PRIVATE_GROUP, True if speculate is None else bool(speculate[row]))
        return self.buffer.upload(b, self._host_destination(b))

    def _host_destination(self, b: int) -> Optional[torch.Tensor]:
        """Where a batch of ``b`` rows' host proposals are uploaded: the captured step's input block
        (`StepGraphs.host_destination`: a replay reads them there, no copy), else None (a new tensor)."""
        return self.graphs.host_destination(b) if self.graphs is not None else None

    def build(self, draft: "DraftCandidates | DenseDraft", roots: torch.Tensor, host: HostCandidates,
              slot_ids: torch.Tensor, seq_lens: torch.Tensor, sampled: torch.Tensor, num_nodes: Optional[int] = None,
              retrieved: Optional[RoundRetrieval] = None) -> StepOutput:
        """The graft step: replayed from the planner's CUDA graphs when `capture_graphs` captured
        one for the batch's bucket and width (``retrieved`` is then recomputed inside the graph),
        else `build_eager`. Arguments, result and errors as `build_eager`."""
        if self.graphs is not None:
            return self.graphs.build(draft, roots, host, slot_ids, seq_lens, sampled, num_nodes=num_nodes)
        return self.build_eager(draft, roots, host, slot_ids, seq_lens, sampled, num_nodes, retrieved)

    def capture_graphs(self, topk: int, steps: int, buckets: Sequence[int], widths: Sequence[int],
                       replay: bool, draft_buffer: Optional[DenseDraft] = None) -> StepGraphs:
        """Capture the step per (batch bucket, verify width) (`StepGraphs.capture`; ``replay``
        False: run each once eagerly instead, `StepGraphs.warm_up`, so the fused kernels compile at
        start-up). With ``replay``, `build` replays them from now on.

        Args:
            topk, steps: the dense draft's shape (`DenseDraft`); buckets: batch sizes; widths:
                verify widths (2..N); draft_buffer: the engine's draft buffers the graphs read in
                place (`StepGraphs`), or None.
        Returns:
            The `StepGraphs`.
        Raises:
            RuntimeError: ``replay`` on a planner not on a CUDA device; whatever a compile or a
                capture raises (the planner's graphs stay as they were).
        """
        graphs = StepGraphs(self, topk, steps, buckets, widths, draft_buffer)
        graphs.capture() if replay else graphs.warm_up()
        if replay:
            self.graphs = graphs
        return graphs

    def build_eager(self, draft: "DraftCandidates | DenseDraft", roots: torch.Tensor, host: HostCandidates,
                    slot_ids: torch.Tensor, seq_lens: torch.Tensor, sampled: torch.Tensor,
                    num_nodes: Optional[int] = None, retrieved: Optional[RoundRetrieval] = None) -> StepOutput:
        """The graft step run eagerly (device, static shapes, no host read).

        Args:
            draft: `DraftCandidates` ``[B, S]``, or the dense EAGLE tree as a `DenseDraft` (read
                as it is by the step's dense draft rerank).
            roots: ``int64[B]``; slot_ids: ``int64[B]`` engine slots (token history rows);
            seq_lens: ``int64[B]`` committed tokens before the root; sampled: ``bool[B]``.
            host: `host_candidates` of the same rows.
            num_nodes: the round's verify width, 2..N (default N; the batch budget's widths are
                prepared at construction, others on first use).
            retrieved: the `RoundRetrieval` of this round's `stop_gate` (the same inputs), whose
                estimates, token windows and retrieved candidates are reused instead of computed
                again; None computes them.
        Returns:
            `StepOutput` ``[B, num_nodes]``.
        Raises:
            ValueError: a width outside 2..N.
        """
        step = self._step(num_nodes)
        if retrieved is not None:   # the stop gate's inputs and candidates of this same round
            r = retrieved
            return step(draft, roots, host, r.hist, r.count, seq_lens, sampled, r.est, r.factors, r.parts)
        hist, count = self.history.gather(slot_ids)
        return step(draft, roots, host, hist, count, seq_lens, sampled, self.calibrator.table,
                    self.factors(slot_ids))

    def _step(self, num_nodes: Optional[int]) -> GraftStep:
        step = self.step if num_nodes is None else self.steps.get(num_nodes)
        if step is None:
            step = self.steps[num_nodes] = self._new_step(num_nodes)
        return step

    def factors(self, slot_ids: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The rows' per-request correction ``(scale float32[B, NUM_MEMBERS], under bool[B, NUM_MEMBERS])``
        of slots ``slot_ids`` ``int64[B]``, or None when it is off (config: a static choice)."""
        return self.request_correction.factors(slot_ids) if self.request_correction.enabled else None

    def ensure_slots(self, slots: int) -> None:
        """Size the per-slot state (token history, per-request correction) to ``slots`` engine slots
        (a host-side size check; grows at start-up, before any graph capture).

        Raises:
            RuntimeError: growth after `fix_slots` (a captured graph reads these buffers by address,
                so a reallocated one would be read stale by every replay).
        """
        have = self.slot_capacity
        if slots > have and self.slots_fixed:
            raise RuntimeError(f"GraftPlanner: per-slot state is fixed at {have} slots once graphs are "
                               f"captured; {slots} asked (size it with ensure_slots before capture)")
        self.history.ensure(slots)
        self.request_correction.ensure(slots)

    @property
    def slot_capacity(self) -> int:
        """Engine slots the per-slot state holds (``dump_slot`` excluded)."""
        return self.history.tokens.shape[0] - (1 if self.slots_fixed else 0)

    def fix_slots(self) -> None:
        """Freeze the per-slot capacity: from now on `ensure_slots` refuses to grow (graph capture
        calls it; the buffers it reads keep their addresses for the server's life). One more row is
        added first, ``dump_slot`` (= the capacity): a captured round's padding rows write their
        bookkeeping there instead of into a live request's slot. Idempotent."""
        if self.slots_fixed:
            return
        self.dump_slot = self.history.tokens.shape[0]
        self.history.ensure(self.dump_slot + 1)
        self.request_correction.ensure(self.dump_slot + 1)
        self.slots_fixed = True

    def reset_slots(self, slot_ids: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """New requests took slots ``slot_ids`` ``int64[B]``: their token windows become the first
        ``lens[b]`` of ``tokens[b]`` (`TokenHistory.reset`) and their per-request windows empty."""
        self.history.reset(slot_ids, tokens, lens)
        self.request_correction.reset(slot_ids)

    @property
    def successor_k(self) -> int:
        """How many of the target's top tokens `observe` takes per verified node (the successor
        table's k); 0 without a successor table (pass ``target_topk=None``)."""
        return self.successor.k if self.successor is not None else 0

    def prefill(self, req_ids: Sequence[Hashable], slot_ids: torch.Tensor, contexts: Sequence[Sequence[int]],
                first: Optional[torch.Tensor] = None, extend_ids: Optional[torch.Tensor] = None,
                extend_lens: Optional[Sequence[int]] = None,
                tenants: Optional[Sequence[Optional[Hashable]]] = None) -> None:
        """The device state of requests whose prefill just ran: the one way both engines start a
        request on the device (SGLang once per prefill batch; vLLM when a request first reaches the
        proposer, with its host context). Not on the decode path.

        Each slot's token window becomes the tail of its context followed by the first generated
        token (if given), its per-request correction window is emptied (`reset_slots`), and the bigrams
        of the tokens the prefill extended warm-start the empty rows of each request's successor-table group
        (`SuccessorTable.warm_start`, groups from `assign_group`).

        Args:
            req_ids: the batch's request ids; tenants: their tenant labels (None: the default).
            slot_ids: ``int64[B]`` engine slots.
            contexts: per request, the host token ids before the first generated token (prompt and
                any output already committed).
            first: ``int64[B]`` the first generated token of each request, or None when each context
                already ends with the next tree's root (vLLM hands the proposer committed tokens).
            extend_ids: ``int64[T]`` the tokens the prefill ran, requests back to back, with
                ``extend_lens`` per request; None skips the warm start.
        """
        self._set_windows(slot_ids, contexts)
        if first is not None:
            first = first.reshape(-1).to(torch.int64)
            self.history.append(slot_ids, first[:, None], torch.ones_like(first))
        tenants = tenants if tenants is not None else [None] * len(req_ids)
        group_ids = [self.assign_group(r, t) for r, t in zip(req_ids, tenants)]   # held until stop_request
        if self.successor is None or extend_ids is None or not extend_lens or extend_ids.numel() < 2:
            return
        ids = extend_ids.reshape(-1).to(torch.int64)
        lens_t = torch.tensor(list(extend_lens), device=ids.device)
        starts = lens_t.cumsum(0)
        same = torch.ones(ids.numel() - 1, dtype=torch.bool, device=ids.device)   # a bigram within one request
        same[(starts[:-1] - 1).clamp(0, ids.numel() - 2)] = False
        groups = torch.tensor(group_ids, device=ids.device).repeat_interleave(lens_t)
        self.successor.warm_start(ids[:-1], ids[1:], same, groups[:-1])

    def _set_windows(self, slot_ids: torch.Tensor, contexts: Sequence[Sequence[int]]) -> None:
        """`reset_slots` with each slot's token window = the tail of its host context (one upload)."""
        width = self.history.length
        rows = torch.zeros(len(contexts), width, dtype=torch.int64)
        lens = torch.zeros(len(contexts), dtype=torch.int64)
        for i, ctx in enumerate(contexts):
            tail = list(ctx)[-width:]
            rows[i, : len(tail)] = torch.tensor(tail, dtype=torch.int64)
            lens[i] = len(tail)
        dev = self.device
        self.reset_slots(slot_ids, rows.to(dev, non_blocking=True), lens.to(dev, non_blocking=True))

    def append_committed(self, slot_ids: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """Tokens committed outside a verified round (an engine's plain decode steps, caught up in one
        call): the first ``lens[b]`` of ``tokens[b]`` (``int64[B, W]``) are appended to slot
        ``slot_ids[b]``'s token history (device, no host read). Nothing is priced or learnt from them."""
        self.history.append(slot_ids, tokens, lens)

    def stop_gate(self, roots: torch.Tensor, host: HostCandidates, slot_ids: torch.Tensor,
                  seq_lens: torch.Tensor, sampled: torch.Tensor,
                  num_nodes: Optional[int] = None) -> ExpectedGainGate:
        """An `ExpectedGainGate` for this round's eager drafting (gate.py), built before drafting from
        the same inputs as `build`; its floor is taken at the round's verify width ``num_nodes``
        (default N). The gate's ``retrieved`` (`RoundRetrieval`) holds what the floor was computed
        from; passed to `build` with the same inputs, the round computes its retrieved candidates
        once instead of twice."""
        est = self.calibrator.table
        hist, count = self.history.gather(slot_ids)
        factors = self.factors(slot_ids)
        step = self._step(num_nodes)
        parts = step.retrieve(roots, host, hist, count, seq_lens, sampled, est, factors)
        gate = ExpectedGainGate(self.calibrator, draft_bounds(self.calibrator, est),
                                step.retrieval_floor(roots, parts), sampled)
        gate.retrieved = RoundRetrieval(est, hist, count, factors, parts)
        return gate

    def observe(self, out: StepOutput, on_path: Optional[torch.Tensor], target_topk: Optional[torch.Tensor],
                committed: torch.Tensor, accept_len: torch.Tensor, slot_ids: torch.Tensor) -> RoundStats:
        """The round's bookkeeping from the accepted-node mask, run eagerly (`observe_eager`, whose
        arguments and result these are). An engine that reports SGLang's accept index calls
        `observe_verified`, which replays the observe graph."""
        if self.graphs is not None:
            self.graphs.observed_eagerly()
        return self.observe_eager(out, on_path, target_topk, committed, accept_len, slot_ids)

    def observe_verified(self, out: StepOutput, accept_index: torch.Tensor, target_logits: Optional[torch.Tensor],
                         committed: torch.Tensor, accept_len: torch.Tensor, slot_ids: torch.Tensor) -> RoundStats:
        """The round's bookkeeping from a verify outcome in SGLang's layout: replayed from the
        planner's observe graph when ``out`` is the output of the round's replayed build
        (`StepGraphs.observe`: two ops load the inputs), else `observe_eager` of the accepted nodes
        (`on_path_from_accept_index`) and the successor table's top-k of ``target_logits``.

        Args:
            out: the round's `StepOutput` ``[B, N]``, N >= 2.
            accept_index: ``int[B, W]`` SGLang's flat accepted node ids (``b * N + i`` in path
                order, -1 padded; ``EagleVerifyOutput.accept_index``).
            target_logits: ``float[>= B * N, V]`` the target's logits at every node, row ``b * N + i``
                (SGLang's ``next_token_logits``), or None (no successor update).
            committed: ``int[B, >= accept_len]`` committed tokens; accept_len: ``int[B]``;
            slot_ids: ``int[B]`` engine slots.
        Returns:
            `RoundStats`, as `observe_eager`.
        """
        if self.graphs is not None:
            stats = self.graphs.observe(out, accept_index, target_logits, committed, accept_len, slot_ids)
            if stats is not None:
                return stats
        b, n = out.tree.tokens.shape
        k = self.successor_k
        topk = None if not k or target_logits is None else torch.topk(target_logits[: b * n], k, dim=-1).indices
        return self.observe_eager(out, on_path_from_accept_index(accept_index, n), topk, committed, accept_len,
                                  slot_ids)

    def observe_eager(self, out: StepOutput, on_path: Optional[torch.Tensor], target_topk: Optional[torch.Tensor],
                      committed: torch.Tensor, accept_len: torch.Tensor, slot_ids: torch.Tensor) -> RoundStats:
        """Device bookkeeping of a verified round (no host read): calibration counts, the slots'
        per-request correction windows, successor table, the committed tokens appended to the
        slots' history, and the calibrator's estimate table refreshed in place for the next build
        (`Calibrator.refresh`; nothing the build reads is assigned from Python, so a captured build
        replays correctly).

        Args:
            out: the round's `StepOutput`.
            on_path: ``bool[B, N]`` accepted nodes (`on_path_from_accept_index`), N >= 2.
            target_topk: ``int64[B, N, k]`` the target's top-k after every node (successor update),
                or None.
            committed: ``int64[B, >= accept_len]`` committed tokens (accepted nodes' tokens, then the
                bonus); accept_len: ``int64[B]``.
            slot_ids: ``int64[B]`` engine slots.
        Returns:
            `RoundStats` (device tensors, for an engine to copy to the host off the critical path).
        """
        tree = out.tree
        cal, rc = self.calibrator, self.request_correction
        scale, under = out.factors if out.factors is not None else cal.identity(tree.tokens.shape[0])
        gain = out.gain if out.gain is not None else tree.logp[:, :0]
        cols = self._gain_columns(gain.shape[1], tree.tokens.shape[1])
        sources, row_members, row_depths, expected = observe_rows(
            RoundOutcome(out.member_bins, on_path, out.depth, tree.source), Prices(out.estimates, scale, under),
            cal.state_view, gain, cols, Commit(slot_ids, committed, accept_len), rc.recent, self.history.windows,
            ObserveOptions(cal.source_window > 0, rc.window, cal.max_depth))
        if self.successor is not None and target_topk is not None:
            groups = out.groups if out.groups is not None else torch.zeros_like(tree.tokens[:, 0])
            self.successor.update(tree.tokens, target_topk.reshape(tree.tokens.numel(), -1), tree.source, groups,
                                  invalid=SOURCE_PADDING)
        cal.refresh()
        return RoundStats(sources, row_members, row_depths, expected if out.gain is not None else None)

    def _gain_columns(self, gain_len: int, width: int) -> torch.Tensor:
        """The gain curve's column for each of the config's verify widths and the verified width
        (`gain_columns`), cached per (curve length, width): built once, read by every round."""
        key = (gain_len, width)
        if key not in self._cols:
            self._cols[key] = gain_columns((*self.config.verify_widths, width), gain_len, self.device)
        return self._cols[key]
