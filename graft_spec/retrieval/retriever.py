"""Combines retrieval sources into one candidate batch per step (paper Sec. 3.2).

Sources are queried independently and their candidate subtrees are stacked along the
candidate axis; duplicates across sources (same path from the root) are merged later by
`graft_spec.graft.graft`, which keeps the best score of a merged group. Scores of all
sources are estimates of path acceptance probability, so they compete on one scale.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ..config import GraftConfig
from .base import Candidates, RetrievalSource
from .corpus import CorpusIndex
from .successor import SuccessorMatrix
from .suffix import SuffixIndex

__all__ = ["Retriever"]


class Retriever(RetrievalSource):
    """Fan-out over sources with the same five-method interface.

    Args:
        sources: retrieval sources (any `RetrievalSource`).
    """

    name = "retriever"

    def __init__(self, sources: Sequence[RetrievalSource]):
        self.sources = list(sources)

    @classmethod
    def from_config(cls, config: GraftConfig, vocab_size: int, device: torch.device | str = "cpu",
                    corpus: Optional[CorpusIndex] = None) -> "Retriever":
        """Sources enabled in ``config.retrieval``; a prebuilt ``corpus`` overrides the path.

        Raises:
            FileNotFoundError / ValueError: corpus file missing or malformed.
        """
        r = config.retrieval
        cap = min(r.max_candidates, config.num_draft_tokens - 1)
        srcs: list[RetrievalSource] = []
        if r.successor:
            srcs.append(SuccessorMatrix(vocab_size, k=r.successor_k, max_depth=r.successor_max_depth,
                                        prior=r.successor_prior, decay=r.successor_rank_decay,
                                        template_size=cap, device=device))
        if r.suffix:
            srcs.append(SuffixIndex(max_depth=r.suffix_max_depth, max_match=r.suffix_max_match,
                                    min_prob=r.suffix_min_prob, max_nodes=r.suffix_max_nodes,
                                    max_candidates=cap, device=device))
        if corpus is not None:
            srcs.append(corpus)
        elif r.corpus:
            srcs.append(CorpusIndex.from_file(r.corpus_path, max_depth=r.suffix_max_depth,
                                              max_match=r.suffix_max_match, min_prob=r.suffix_min_prob,
                                              max_mb=r.corpus_max_mb, max_candidates=cap, device=device))
        return cls(srcs)

    @property
    def successor(self) -> Optional[SuccessorMatrix]:
        """The successor-matrix source, if enabled."""
        return next((s for s in self.sources if isinstance(s, SuccessorMatrix)), None)

    def start(self, req_id: Hashable, prompt_ids: Sequence[int]) -> None:
        for s in self.sources:
            s.start(req_id, prompt_ids)

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        for s in self.sources:
            s.extend(req_id, new_tokens)

    def stop(self, req_id: Hashable) -> None:
        for s in self.sources:
            s.stop(req_id)

    def propose(self, req_ids: Sequence[Hashable], root_tokens: torch.Tensor, budget: int) -> Candidates:
        parts = [s.propose(req_ids, root_tokens, budget) for s in self.sources]
        parts = [p for p in parts if p.width > 0]
        if not parts:
            return Candidates.empty(len(req_ids), root_tokens.device)
        dev = parts[0].tokens.device
        return Candidates.concat([Candidates(p.tokens.to(dev), p.parents.to(dev), p.score.to(dev),
                                             p.valid.to(dev)) for p in parts])

    def live_requests(self) -> int:
        return max((s.live_requests() for s in self.sources), default=0)

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self.sources)
