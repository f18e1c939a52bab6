"""The interface shared by the host-side retrieval sources (suffix index, corpus).

Modelled on ArcticInference's small suffix-decoding API (start_request / add_active_response /
speculate / stop_request): a source is told a request's prompt and every token it commits, and
proposes a candidate subtree continuing the request's context *as the host knows it*. The host may
lag the device by a round (overlap scheduler); the graft step re-anchors the proposal on the device
against the tokens committed since (graft_spec.step, ``reanchor``), so a source never needs device
state and its work can run while the accelerator drafts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from .trie import CountTrie

__all__ = ["Proposal", "HostSource", "longest_match_proposal"]


@dataclass
class Proposal:
    """A candidate subtree continuing one request's known context (host lists, best first).

    Attributes:
        tokens: candidate tokens.
        parents: index of the parent candidate (< own index), -1 = child of the context's last
            token (the anchor).
        probs: estimated probability of the path anchor -> node (count-ratio product), in (0, 1],
            non-increasing along paths.
        match_len: context tokens the continuation was matched on (>= 1).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


def longest_match_proposal(tries: Iterable["CountTrie"], tail: Sequence[int], max_match: int, budget: int,
                           min_prob: float) -> Proposal:
    """The longest suffix of ``tail`` (<= ``max_match`` tokens) found with a continuation in any of
    ``tries`` (the first trie wins a tie), then that trie's best-first continuation of at most
    ``budget`` nodes (`CountTrie.longest_match`, `CountTrie.expand`); empty when nothing matches.
    Used by the source over other text than the request's own (the corpus)."""
    best, best_len, best_trie = None, 0, None
    for trie in tries:
        loc, length = trie.longest_match(tail, max_match)
        if loc is not None and length > best_len:
            best, best_len, best_trie = loc, length, trie
    if best is None:
        return Proposal()
    toks, pars, probs = best_trie.expand(best, budget, min_prob)
    return Proposal(toks, pars, probs, best_len)


class HostSource(abc.ABC):
    """Five-method interface of a host-side retrieval source.

    Attributes:
        name: short name (stats, logs).
        member: the calibration member id (one of ``calibration.RETRIEVAL_SOURCES``).
    """

    name: str = "source"
    member: int = -1

    def start(self, req_id: Hashable, prompt_ids: Sequence[int], tenant: Optional[Hashable] = None) -> None:
        """A new request with its prompt token ids (idempotent per req_id: restarts it); ``tenant``:
        its isolation label (None = the default tenant; only cross-request sources use it)."""

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        """Tokens committed for ``req_id`` since the last call, in order."""

    @abc.abstractmethod
    def propose(self, req_id: Hashable, budget: int) -> Proposal:
        """At most ``budget`` candidates continuing the request's context (empty if unknown)."""

    def stop(self, req_id: Hashable) -> None:
        """Forget a finished request (must free its memory)."""

    def live_requests(self) -> int:
        """Requests currently holding per-request state."""
        return 0

    def memory_bytes(self) -> int:
        """Approximate bytes held."""
        return 0
