"""`GraftPlanner`: the one object engine adapters call each decode step.

Per step and batch (paper Algorithm 1/2):

    tree  = eagle_rerank(...)                      # engine side: draft tree [B, Nd]
    hyb   = planner.build(tree, req_ids)           # prune -> retrieve -> graft, [B, N]
    ...  target forward over hyb.tokens with hyb.mask() / hyb.positions(seq_lens) ...
    res   = greedy_verify(...) / sample_verify(...)
    planner.observe(hyb, target_topk_ids)          # successor-matrix update, all nodes
    planner.extend(req_id, res.emitted(hyb.tokens)[i])  # per request, committed tokens

plus ``start_request`` after prefill (prompt ids, and the first sampled token through
``extend``) and ``stop_request`` when a request finishes or is aborted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

from .config import GraftConfig
from .graft import graft
from .prune import PruneResult, prune
from .retrieval.base import Candidates
from .retrieval.corpus import CorpusIndex
from .retrieval.retriever import Retriever
from .tree import DraftTree

__all__ = ["BuildInfo", "GraftPlanner"]


@dataclass
class BuildInfo:
    """Side information of the last `GraftPlanner.build` (for metrics/debugging)."""

    prune: PruneResult
    num_candidates: int


class GraftPlanner:
    """Holds the config and the retrieval sources; builds hybrid trees.

    Args:
        config: validated `GraftConfig`.
        vocab_size: target vocabulary size V (successor matrix rows).
        device: device of the successor matrix and of the trees handed in.
        corpus: prebuilt `CorpusIndex` (overrides ``retrieval.corpus_path``).
        retriever: custom `Retriever` (overrides the config's sources).
    """

    def __init__(self, config: GraftConfig, vocab_size: int, device: torch.device | str = "cpu",
                 corpus: Optional[CorpusIndex] = None, retriever: Optional[Retriever] = None):
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.retriever = retriever or Retriever.from_config(config, vocab_size, self.device, corpus)
        self.last_info: Optional[BuildInfo] = None
        self._live: set[Hashable] = set()

    # ------------------------------------------------------------------ lifecycle
    def start_request(self, req_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """Register a request and index its prompt (idempotent: restarts the request)."""
        self._live.add(req_id)
        self.retriever.start(req_id, [int(t) for t in prompt_ids])

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        """Committed tokens of ``req_id`` (accepted + bonus), before its next `build`."""
        self.retriever.extend(req_id, [int(t) for t in new_tokens])

    def stop_request(self, req_id: Hashable) -> None:
        """Free all per-request state (finished or aborted request)."""
        self._live.discard(req_id)
        self.retriever.stop(req_id)

    def live_requests(self) -> int:
        """Requests with state in the planner or any source."""
        return max(len(self._live), self.retriever.live_requests())

    def memory_bytes(self) -> int:
        """Approximate bytes held by all retrieval sources."""
        return self.retriever.memory_bytes()

    # ------------------------------------------------------------------ per step
    def build(self, draft: DraftTree, req_ids: Sequence[Hashable]) -> DraftTree:
        """Prune -> retrieve -> graft.

        Args:
            draft: EAGLE draft tree ``[B, Nd]`` (node 0 = root token of each request).
            req_ids: B request ids, row-aligned with ``draft``.
        Returns:
            Hybrid `DraftTree` ``[B, N]`` with N = ``config.num_draft_tokens``.
        Raises:
            ValueError: ``len(req_ids) != B``.
        """
        n = self.config.num_draft_tokens
        if len(req_ids) != draft.batch_size:
            raise ValueError(f"build: {len(req_ids)} req_ids for a batch of {draft.batch_size}")
        pr = prune(draft, self.config.checkpoints, n)
        cands = self.retriever.propose(req_ids, draft.tokens[:, 0], n - 1)
        self.last_info = BuildInfo(prune=pr, num_candidates=cands.width)
        return graft(draft, pr.keep, cands if cands.width else None, n, self.config.graft)

    def observe(self, tree: DraftTree, target_topk_ids: torch.Tensor) -> None:
        """Successor-matrix update from the target's top-k at every verified node.

        Args:
            tree: the verified tree ``[B, N]``.
            target_topk_ids: ``int64[B, N, k]`` target top-k ids after each node.
        """
        succ = self.retriever.successor
        if succ is not None:
            succ.update(tree.tokens.reshape(-1), target_topk_ids.reshape(-1, target_topk_ids.shape[-1]))

    def observe_tokens(self, node_tokens: torch.Tensor, target_topk_ids: torch.Tensor) -> None:
        """Same as `observe` for arbitrary positions (e.g. prefill logits): ``[M]``, ``[M, k]``."""
        succ = self.retriever.successor
        if succ is not None:
            succ.update(node_tokens.reshape(-1), target_topk_ids.reshape(node_tokens.numel(), -1))
