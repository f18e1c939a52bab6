"""`GraftStep`: the engine-side state of Graft in vLLM, without any vLLM import.

`GraftProposer` (proposer.py) owns one `GraftStep` and calls, every decode step:

1. `begin`; then `record` once per EAGLE draft pass (K passes, top-1 continues the loop);
2. `finish` with the batch's request ids and committed tokens: it prices last step's tree
   against the tokens committed since (calibration), syncs per-request retrieval state
   (`RequestTracker`), builds the spine tree (`chain.spine_tree`), runs the graft step
   (`graft_spec.pipeline.GraftPlanner.build`) and returns each request's best chain
   (`chain.best_chain`, by the calibrated estimates).

Kept separate from the proposer so it can be driven by a fake target on CPU (tests).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from graft_spec.config import GraftConfig
from graft_spec.pipeline import GraftPlanner, on_path_from_tokens
from graft_spec.step import StepOutput, tree_draft_candidates
from graft_spec.tree import DraftTree

from graft_spec.chain import best_chain, spine_tree
from .requests import RequestTracker

__all__ = ["GraftStep"]


class GraftStep:
    """Per-engine Graft state: planner, request tracker, and the current step's draft levels.

    Args:
        config: validated `GraftConfig` (``topk`` = siblings recorded per draft pass).
        vocab_size: target vocabulary size (successor-table rows).
    """

    def __init__(self, config: GraftConfig, vocab_size: int):
        self.config = config
        self.planner = GraftPlanner(config, vocab_size, device="cpu")
        self.tracker = RequestTracker(self.planner)
        self._levels: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.last_tree: Optional[DraftTree] = None       # hybrid tree of the last step
        self.last_expected: Optional[torch.Tensor] = None  # float32[B] expected accepted length
        self._last: Optional[tuple[list, np.ndarray, StepOutput]] = None

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

    def _calibrate(self, req_ids: Sequence[str], token_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Price last step's tree against what the target committed since (vLLM verifies one chain,
        so the tree's other nodes are judged by `on_path_from_tokens`, exact under greedy decoding;
        nodes deeper than the committed tokens are not counted)."""
        if self._last is None:
            return
        rids, old_n, out = self._last
        self._last = None
        row = {rid: i for i, rid in enumerate(req_ids)}
        n = self.config.num_draft_tokens
        committed = torch.zeros(len(rids), n, dtype=torch.int64)
        lens = torch.zeros(len(rids), dtype=torch.int64)
        for j, rid in enumerate(rids):
            i = row.get(rid)
            if i is None:
                continue
            new = token_ids[i, int(old_n[j]):int(num_tokens[i])][:n]
            committed[j, : len(new)] = torch.from_numpy(np.asarray(new, dtype=np.int64))
            lens[j] = len(new)
        on_path, known = on_path_from_tokens(out.tree, committed, lens)
        bins = torch.where(known[:, :, None], out.member_bins, -1)
        self.planner.calibrator.update(bins, on_path, out.depth, out.estimates)

    def finish(self, root_tokens: torch.Tensor, req_ids: Sequence[str], token_ids: np.ndarray,
               num_prompt_tokens: np.ndarray, num_tokens: np.ndarray, max_len: int) -> list[list[int]]:
        """Sync requests, build the hybrid tree, return one chain per request.

        Args:
            root_tokens: ``int[B]`` last committed token per row (tree roots).
            req_ids: B request ids, row-aligned.
            token_ids, num_prompt_tokens, num_tokens: the batch's committed tokens
                (see `RequestTracker.sync`).
            max_len: K, the longest chain vLLM verifies this step.
        Returns:
            B chains, ``list[int]`` of length <= K, deterministic given the context.
        Raises:
            RuntimeError: fewer than ``max_len`` draft passes were recorded.
        """
        self._calibrate(req_ids, token_ids, num_tokens)
        self.tracker.sync(req_ids, token_ids, num_prompt_tokens, num_tokens)
        b = len(req_ids)
        if max_len <= 0 or b == 0:
            return [[] for _ in range(b)]
        if len(self._levels) < max_len:
            raise RuntimeError(f"GraftStep: {len(self._levels)} draft passes recorded, need {max_len}")
        levels = self._levels[:max_len]
        logp = torch.stack([lv[0][:b] for lv in levels], dim=1).cpu()     # [B, K, k]
        ids = torch.stack([lv[1][:b] for lv in levels], dim=1).cpu()      # [B, K, k]
        draft = spine_tree(root_tokens[:b].to("cpu", torch.int64), logp, ids)
        host = self.planner.host_candidates(list(req_ids))
        # rows are batch positions here: the device history is rewritten from the input batch
        n_tok = np.asarray(num_tokens[:b], dtype=np.int64)
        hist = self.planner.history
        self.planner.ensure_slots(b)
        window = np.zeros((b, hist.length), dtype=np.int64)
        for i in range(b):
            tail = token_ids[i, max(0, n_tok[i] - hist.length):n_tok[i]]
            window[i, : len(tail)] = tail
        hist.reset(torch.arange(b), torch.from_numpy(window), torch.from_numpy(np.minimum(n_tok, hist.length)))
        # the tracker fed every committed token (root included) to the host sources: no lag
        seq = torch.from_numpy(n_tok) - 1
        out = self.planner.build(tree_draft_candidates(draft), draft.tokens[:, 0], host, torch.arange(b), seq,
                                 torch.zeros(b, dtype=torch.bool))
        tokens, length, expected = best_chain(out.tree, max_len)
        self.last_tree, self.last_expected = out.tree, expected
        self._last = (list(req_ids), np.asarray(num_tokens[:b]).copy(), out)
        return [row[:n].tolist() for row, n in zip(tokens, length.tolist())]

    def close(self) -> None:
        """Free all per-request state."""
        self.tracker.stop_all()
