"""Fan-out over the host-side sources (suffix index, corpus) into the candidate buffer.

Sources are queried independently per request and their proposals written side by side into the
request's buffer row (`HostCandidateBuffer.put`); duplicates across sources (and with the draft
tree and the successor table) are merged on the device by the graft step, which keeps the best
estimate of a merged node.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

from ..config import GraftConfig
from .base import HostSource
from .buffer import HostCandidateBuffer
from .corpus import CorpusIndex
from .suffix import SuffixIndex

__all__ = ["Retriever"]


class Retriever:
    """The host sources of one engine, with the same lifecycle methods as a source.

    Args:
        sources: host sources (any `HostSource`).
    """

    def __init__(self, sources: Sequence[HostSource]):
        self.sources = list(sources)

    @classmethod
    def from_config(cls, config: GraftConfig, corpus: Optional[CorpusIndex] = None,
                    vocab_size: Optional[int] = None) -> "Retriever":
        """Sources enabled in ``config.retrieval``; a prebuilt ``corpus`` overrides the path.

        Args:
            vocab_size: the target's vocabulary: the corpus file's token ids must lie below it.
        Raises:
            FileNotFoundError / ValueError: corpus file missing or malformed (naming the entry).
        """
        r = config.retrieval
        srcs: list[HostSource] = []
        if r.suffix:
            srcs.append(SuffixIndex(max_depth=r.suffix_max_depth, max_match=r.match_len,
                                    min_prob=r.suffix_min_prob, max_nodes=r.suffix_max_nodes))
        if corpus is not None:
            srcs.append(corpus)
        elif r.corpus:
            srcs.append(CorpusIndex.from_file(r.corpus_path, vocab_size=vocab_size, max_depth=r.suffix_max_depth,
                                              max_match=r.match_len, min_prob=r.suffix_min_prob,
                                              max_mb=r.corpus_max_mb))
        return cls(srcs)

    def source(self, name: str) -> Optional[HostSource]:
        """The source called ``name`` ("suffix", "corpus", "outputs"), if enabled."""
        return next((s for s in self.sources if s.name == name), None)

    def start(self, req_id: Hashable, prompt_ids: Sequence[int], tenant: Optional[Hashable] = None) -> None:
        for s in self.sources:
            s.start(req_id, prompt_ids, tenant)

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        for s in self.sources:
            s.extend(req_id, new_tokens)

    def stop(self, req_id: Hashable) -> None:
        for s in self.sources:
            s.stop(req_id)

    def fill(self, buffer: HostCandidateBuffer, row: int, req_id: Hashable, anchor_len: int, group: int = 0,
             speculate: bool = True) -> None:
        """Write the request's proposals into ``row`` (each source gets an equal share of the width;
        a share one source leaves unused goes to the next); an opted-out request's row stays empty."""
        buffer.clear(row, anchor_len, group, speculate)
        if not speculate:
            return
        offset, left = 0, len(self.sources)
        for s in self.sources:
            share = (buffer.width - offset) // left
            offset += buffer.put(row, offset, s.member, s.propose(req_id, share))
            left -= 1

    def live_requests(self) -> int:
        return max((s.live_requests() for s in self.sources), default=0)

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self.sources)
