"""`ChainStep`: the engine-side state of Graft in vLLM, without any vLLM import.

`GraftProposer` (proposer.py) owns one `ChainStep` and calls, every decode step:

1. `begin`; then `record` once per EAGLE draft pass (K passes, top-1 continues the loop);
2. `finish` with the batch's request ids and committed tokens: it hands last step's tree and the
   tokens committed since to `chains.observe_committed` (calibration, per-request
   correction, successor table, token windows), syncs per-request state (`RequestTracker`:
   `GraftPlanner.catch_up` / ``prefill`` / ``stop_request``), builds the spine tree
   (`chain.spine_tree`), runs the graft step (`chains.build_chains`: no node deeper than
   K) and returns each request's chain (`chain.ChainPricer.choose`: the tree's paths and the whole
   draft spine priced by their chain-calibrated conditional acceptance); the next step's `finish`
   counts the accepted chain tokens by source (`GraftStats`: its own, and the process's ``graft:*``
   Prometheus series).

Every `log_every` steps the calibration's per-source acceptance is logged (`log_sources`), beside
vLLM's own ``SpecDecoding metrics`` line (which counts graft's chains like any drafts).

Kept separate from the proposer so it can be driven by a fake target on CPU (tests).
"""

from __future__ import annotations

import logging
from typing import Collection, Optional, Sequence

import numpy as np
import torch

from graft_spec.config import GraftConfig
from graft_spec.pipeline import (ChainPricer, DraftTree, GraftPlanner, GraftStats, StepOutput, node_depths, node_paths,
                                 on_path_from_tokens, spine_tree, tree_draft_candidates)

from .chains import build_chains, observe_committed
from .requests import RequestTracker
from .tree_verify import TreeVerdict

__all__ = ["ChainStep", "prometheus_stats"]

logger = logging.getLogger("vllm.graft")   # child of vLLM's logger: same handler and format

_PROMETHEUS: Optional[GraftStats] = None


def prometheus_stats() -> Optional[GraftStats]:
    """The process's `GraftStats` mirrored to Prometheus (the ``graft:*`` series of
    graft_spec/stats.py, registered once per process in prometheus_client's default registry), or
    None without prometheus_client. Every `ChainStep` of the process records into it."""
    global _PROMETHEUS
    if _PROMETHEUS is None:
        try:
            _PROMETHEUS = GraftStats(prometheus=True)
        except ImportError:
            return None
    return _PROMETHEUS


def spine_first(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order int64[B, N], spine int64[B])``: a parents-first node order that starts with the root
    and the ``spine`` nodes of the path of best expected accepted length (the sum of its nodes'
    estimated path acceptance, ``exp(logp)``), by depth, then every other node in index order. The
    spine is what a chain verifier takes from the tree (vLLM verifies the spine alone when a batch
    needs its chain sampler, tree_sampler.py)."""
    b, n = tree.tokens.shape
    paths = node_paths(tree.parents, n - 1)                                           # [B, N, N]
    gain = torch.where(paths >= 0, tree.logp.exp().gather(1, paths.clamp(min=0).reshape(b, -1)).reshape(b, n, n), 0)
    best = gain.sum(2).argmax(1)                                                       # [B]
    spine = paths[torch.arange(b), best]                                               # [B, N] root .. best
    on = torch.zeros(b, n + 1, dtype=torch.bool).scatter_(1, torch.where(spine >= 0, spine, n), True)[:, :n]
    key = torch.where(on, node_depths(tree.parents) - n, torch.arange(n).expand(b, n))  # spine by depth first
    return key.argsort(dim=1, stable=True), on.sum(1) - 1


def _accepted_path(tree: DraftTree, committed: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens int64[B, N - 1], sources int64[B, N - 1])`` of the tree's nodes on the committed
    path, by depth (-1 / 0 padded), for `ChainStep._record`'s chain-shaped counting."""
    on_path, _ = on_path_from_tokens(tree, committed, lens)
    b, n = tree.tokens.shape
    depth = node_depths(tree.parents)
    dest = torch.where(on_path & (depth > 0), depth - 1, n - 1)
    toks = torch.full((b, n), -1, dtype=torch.int64).scatter_(1, dest, tree.tokens)[:, : n - 1]
    srcs = torch.zeros(b, n, dtype=torch.int64).scatter_(1, dest, tree.source)[:, : n - 1]
    return toks, srcs


class ChainStep:
    """Per-engine Graft state: planner, request tracker, and the current step's draft levels.

    Args:
        config: validated `GraftConfig` (``topk`` = siblings recorded per draft pass).
        vocab_size: target vocabulary size (successor-table rows).
    """

    #: steps between two `log_sources` lines (0: never)
    log_every = 500

    def __init__(self, config: GraftConfig, vocab_size: int, trees: bool = False):
        self.trees = trees
        self.config = config
        self.planner = GraftPlanner(config, vocab_size, device="cpu")
        self.tracker = RequestTracker(self.planner)
        self.pricer = ChainPricer(max_depth=config.depth)
        self._levels: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.last_tree: Optional[DraftTree] = None       # hybrid tree of the last step
        self.last_expected: Optional[torch.Tensor] = None  # float32[B] expected accepted length
        self._last: Optional[tuple[list, np.ndarray, StepOutput, torch.Tensor, torch.Tensor]] = None
        self._observed = 0
        self._proposed: dict = {}   # request id -> (tokens, parents) of its last tree (tree mode)
        self._rank: Optional[torch.Tensor] = None   # int64[B, N] proposal column of each node (tree mode)
        self._verified: dict = {}   # request id -> (size, target top-k [W, k]) of its verified tree
        self.stats = GraftStats()   # this engine's rounds (host); `prometheus_stats` has the process's

    def begin(self) -> None:
        """Start a decode step (drops the previous step's draft levels)."""
        self._levels = []

    def record(self, logits: torch.Tensor) -> torch.Tensor:
        """Record one draft pass and return the token the draft loop continues with.

        Args:
            logits: ``float[B, V]`` draft logits in target vocabulary space (vLLM's
                ``Eagle3*ForCausalLM.compute_logits``; ``-inf`` outside the draft vocab).
        Returns:
            ``int64[B]`` top-1 token (== argmax, what vLLM's greedy EAGLE loop expands).
        """
        top = torch.log_softmax(logits.float(), dim=-1).topk(self.config.topk, dim=-1)
        self._levels.append((top.values, top.indices))
        return top.indices[:, 0]

    @property
    def num_levels(self) -> int:
        """Draft passes recorded since `begin`."""
        return len(self._levels)

    def _observe(self, req_ids: Sequence[str], token_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Last step's tree against the tokens the target committed since (`observe_committed`:
        calibration, per-request correction, successor table, token windows). A row whose request is
        not in this batch counts nothing (its tokens are not known yet)."""
        if self._last is None:
            return
        rids, old_n, out, chains, sources = self._last
        self._last = None
        row = {rid: i for i, rid in enumerate(req_ids)}
        # accepted + bonus <= the deepest tree node or chain token + 1 (a chain may run past the tree)
        width = max(int(out.depth.max()) if out.depth.numel() else 0, chains.shape[1] if chains is not None else 0) + 1
        committed = torch.zeros(len(rids), width, dtype=torch.int64)
        lens = torch.zeros(len(rids), dtype=torch.int64)
        slots = torch.zeros(len(rids), dtype=torch.int64)
        for j, rid in enumerate(rids):
            i = row.get(rid)
            if rid not in self.tracker:
                continue
            slots[j] = self.tracker.slot(rid)
            if i is None:
                continue
            new = token_ids[i, int(old_n[j]):int(num_tokens[i])][:width]
            committed[j, : len(new)] = torch.from_numpy(np.asarray(new, dtype=np.int64))
            lens[j] = len(new)
        verified, topk = self._tree_outcome(rids, out, lens)
        stats = observe_committed(self.planner, out, committed, lens, slots, verified, topk)
        if self.trees:   # the accepted nodes' tokens and sources, root-first, from the committed tokens
            chains, sources = _accepted_path(out.tree, committed, lens)
        else:
            self.pricer.observe(committed, lens)
        self._record(chains, sources, committed, lens, stats)
        for j, rid in enumerate(rids):
            self.tracker.advance(rid, int(lens[j]))
        self._observed += 1
        if self.log_every and self._observed % self.log_every == 0:
            self.log_sources()

    def verified(self, req_ids: Sequence[str], prefixes: dict, verdict: TreeVerdict) -> None:
        """How vLLM verified the trees last proposed (tree_runner.py, in ``_sample``, before the next
        `finish` observes them): for each batch row in ``prefixes`` (row -> parents of the scheduled
        prefix of its proposal, `tree_runner.proposal_prefixes`) the verified size and the target's
        top-k at every node (``verdict.target_topk``, row-aligned with ``req_ids``)."""
        topk = verdict.target_topk.cpu() if verdict.target_topk is not None else None   # one copy per step
        self._verified = {req_ids[i]: (len(p), None if topk is None else topk[i]) for i, p in prefixes.items()}

    def _tree_outcome(self, rids: Sequence[str], out: StepOutput, lens: torch.Tensor
                      ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(verified bool[B, N], target_topk int64[B, N, k])`` of last step's tree from `verified`
        (a node is verified when its proposal column is inside the scheduled prefix), or (None, None)
        when no row of it was verified as a tree."""
        outcome, self._verified = self._verified, {}
        if not self.trees or self._rank is None or not outcome:
            return None, None
        rank = self._rank
        b, n = rank.shape
        k = max(self.planner.successor_k, 1)
        verified = torch.zeros(b, n, dtype=torch.bool)
        topk = torch.full((b, n, k), -1, dtype=torch.int64)
        for j, rid in enumerate(rids):
            if rid not in outcome or int(lens[j]) == 0:
                continue
            size, tk = outcome[rid]
            verified[j] = rank[j] < size
            if tk is not None:
                topk[j] = tk[rank[j].clamp(max=size - 1), :k]
        return verified, topk

    def _record(self, chains: torch.Tensor, sources: torch.Tensor, committed: torch.Tensor, lens: torch.Tensor,
                stats) -> None:
        """Per-source accepted tokens of the verified chains (a chain token is accepted while it equals
        the committed token; the first difference is the target's bonus) and the round's calibration
        counts, into `stats` and the process's Prometheus series."""
        k = chains.shape[1]
        width = min(k, committed.shape[1])
        same = (chains[:, :width] == committed[:, :width]) & (chains[:, :width] >= 0)
        same &= torch.arange(width)[None, :] < lens[:, None]
        accepted = torch.cummin(same.to(torch.int64), dim=1).values.sum(1) if width else torch.zeros_like(lens)
        rows = [sources[j, : int(accepted[j])].tolist() for j in range(len(lens)) if int(lens[j]) > 0]
        members, depths = stats.members.cpu(), stats.depths.cpu()   # per row, summed by record_round
        for sink in (self.stats, prometheus_stats()):
            if sink is not None:
                sink.record_round(rows, members, depths)

    def log_sources(self) -> dict:
        """Log (logger ``vllm.graft``, INFO, beside vLLM's own SpecDecoding metrics line) and return the
        calibration's per-source figures: trials, estimated and observed acceptance of every source's
        nodes since start (`GraftStats.summary`'s ``calibration``: host counts, no device read)."""
        summary = self.stats.summary()
        parts = [f"{name} {m['observed']:.3f} (est {m['estimated']:.3f}, {m['trials']} nodes)"
                 for name, m in summary["calibration"].items() if m["trials"]]
        logger.info("graft: acceptance by source after %d steps: %s", self._observed, ", ".join(parts) or "none yet")
        return summary

    def finish(self, root_tokens: torch.Tensor, req_ids: Sequence[str], token_ids: np.ndarray,
               num_prompt_tokens: np.ndarray, num_tokens: np.ndarray, max_len: int,
               alive: Optional[Collection[str]] = None, sampled: Optional[Sequence[bool]] = None,
               chain_rows: Optional[Collection[int]] = None) -> list[list[int]]:
        """Observe last step, sync requests, build the hybrid tree, return one chain per request.

        Args:
            root_tokens: ``int[B]`` last committed token per row (tree roots).
            req_ids: B request ids, row-aligned.
            token_ids, num_prompt_tokens, num_tokens: the batch's committed tokens
                (see `RequestTracker.sync`).
            max_len: K, the longest chain vLLM verifies this step.
            alive: request ids the engine still holds (``runner.requests``; None = the batch).
            sampled: per row, True for a request verified by sampling (None = all greedy).
            chain_rows: tree mode: rows that get their tree's spine, a chain (a request whose
                sampling vLLM processes per chain position, `tree_sampler.request_chain_reason`).
        Returns:
            B chains, ``list[int]`` of length <= K, deterministic given the context; in tree mode
            the tree's N - 1 nodes after the root in a parents-first order, spine first
            (`proposed_tree` has their parents).
        Raises:
            RuntimeError: fewer than ``max_len`` draft passes were recorded.
        """
        self._observe(req_ids, token_ids, num_tokens)
        slots = self.tracker.sync(req_ids, token_ids, num_prompt_tokens, num_tokens, alive, sampled)
        b = len(req_ids)
        if max_len <= 0 or b == 0:
            return [[] for _ in range(b)]
        if len(self._levels) < max_len:
            raise RuntimeError(f"ChainStep: {len(self._levels)} draft passes recorded, need {max_len}")
        n_tok = np.asarray(num_tokens[:b], dtype=np.int64)
        self._refill_stale(req_ids, token_ids, n_tok, slots)
        levels = self._levels[:max_len]
        logp = torch.stack([lv[0][:b] for lv in levels], dim=1).cpu()     # [B, K, k]
        ids = torch.stack([lv[1][:b] for lv in levels], dim=1).cpu()      # [B, K, k]
        draft = spine_tree(root_tokens[:b].to("cpu", torch.int64), logp, ids)
        host = self.planner.host_candidates(list(req_ids))
        flags = torch.tensor([bool(x) for x in sampled[:b]] if sampled is not None else [False] * b,
                             dtype=torch.bool)
        # the tracker fed every committed token (root included) to the host sources: no lag
        cap = self.config.num_draft_tokens - 1 if self.trees else max_len
        out = build_chains(self.planner, tree_draft_candidates(draft), draft.tokens[:, 0], host,
                           torch.from_numpy(slots), torch.from_numpy(n_tok) - 1, flags, cap)
        if self.trees:
            self.last_tree, self.last_expected = out.tree, None
            self._last = (list(req_ids), n_tok.copy(), out, None, None)
            return self._tree_drafts(out.tree, req_ids, chain_rows or ())
        tokens, length, expected, sources = self.pricer.choose(out.tree, logp, ids, flags, max_len)
        self.last_tree, self.last_expected = out.tree, expected
        self._last = (list(req_ids), n_tok.copy(), out, tokens, sources)
        return [row[:n].tolist() for row, n in zip(tokens, length.tolist())]

    def _tree_drafts(self, tree: DraftTree, req_ids: Sequence[str], chain_rows: Collection[int]) -> list[list[int]]:
        """Tree mode: each row's N - 1 nodes after the root, spine first (`spine_first`), their parents
        renumbered to that order and kept for `proposed_tree`; a row in ``chain_rows`` gets its spine."""
        order, spine = spine_first(tree)
        toks = tree.tokens.gather(1, order)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
        self._rank = rank
        old_parent = tree.parents.gather(1, order)
        pars = torch.where(old_parent >= 0, rank.gather(1, old_parent.clamp(min=0)), -1)
        drafts, self._proposed = [], {}
        for i, rid in enumerate(req_ids):
            if i in chain_rows:
                m = int(spine[i])
                drafts.append(toks[i, 1:m + 1].tolist())
                self._proposed[rid] = (drafts[-1], list(range(-1, m)))
            else:
                drafts.append(toks[i, 1:].tolist())
                self._proposed[rid] = (drafts[-1], pars[i].tolist())
        return drafts

    def proposed_tree(self, req_id: str) -> Optional[tuple[list, list]]:
        """``(tokens, parents)`` of the tree last proposed for ``req_id``: its draft tokens after the
        root and every node's parent (node 0 the root, -1 there); None when the last step proposed it
        none (tree mode off, or the request was not in that step's batch)."""
        return self._proposed.get(req_id)

    def _refill_stale(self, req_ids: Sequence[str], token_ids: np.ndarray, n_tok: np.ndarray,
                      slots: np.ndarray) -> None:
        """Rewrite the device window of rows that missed committed tokens (a request left out of a
        step, or more tokens than last step's tree could explain) from the host tokens."""
        stale = [i for i, rid in enumerate(req_ids) if self.tracker.held(rid) != int(n_tok[i])]
        if not stale:
            return
        width = self.planner.config.retrieval.history_len
        window = np.zeros((len(stale), width), dtype=np.int64)
        lens = np.zeros(len(stale), dtype=np.int64)
        for j, i in enumerate(stale):
            tail = token_ids[i, max(0, int(n_tok[i]) - width):int(n_tok[i])]
            window[j, : len(tail)], lens[j] = tail, len(tail)
            self.tracker.refilled(req_ids[i], int(n_tok[i]))
        self.planner.reset_slots(torch.from_numpy(slots[stale]), torch.from_numpy(window), torch.from_numpy(lens))

    def close(self) -> None:
        """Free all per-request state."""
        self.tracker.stop_all()
