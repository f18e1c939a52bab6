"""The retrieval interface shared by every source, and the candidate batch it returns.

Modelled on ArcticInference's small suffix-decoding API (start_request / speculate /
stop_request): a source is told about a request's prompt and every token it commits,
and proposes a candidate subtree hanging under the request's current root token.

Contract for engine adapters: call ``extend(req_id, tokens)`` with every committed token
(accepted draft tokens + bonus) *before* the next ``propose``, so the last token a
source has seen is the root of the next tree. Sources fall back to appending the root
themselves when it is missing (suffix.py), but the contract is what keeps them O(1).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import numpy as np
import torch

__all__ = ["Candidates", "RetrievalSource"]


@dataclass
class Candidates:
    """Retrieved candidate subtrees, one per request, all hanging under the root.

    Attributes:
        tokens: ``int64[B, M]`` candidate tokens.
        parents: ``int64[B, M]``; -1 = child of the root, else the index (< own index)
            of the parent candidate in the same row.
        score: ``float32[B, M]`` estimated probability that the whole path root -> node
            is accepted (product of per-edge acceptance estimates), in [0, 1].
        valid: ``bool[B, M]``; ancestor-closed (a valid node's parent is valid).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    score: torch.Tensor
    valid: torch.Tensor

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch: int, device: torch.device | str = "cpu") -> "Candidates":
        """A batch with M = 0."""
        z = torch.zeros(batch, 0, dtype=torch.int64, device=device)
        return Candidates(z, z.clone(), torch.zeros(batch, 0, device=device),
                          torch.zeros(batch, 0, dtype=torch.bool, device=device))

    @staticmethod
    def from_lists(rows: Sequence[Optional[tuple[Sequence[int], Sequence[int], Sequence[float]]]],
                   device: torch.device | str = "cpu", width: Optional[int] = None) -> "Candidates":
        """Pack per-request ``(tokens, parents, scores)`` lists (None = no candidates).

        Rows are truncated to ``width`` (default: the longest row); truncation keeps a
        prefix, which stays ancestor-closed because parents precede children.
        """
        b = len(rows)
        m = width if width is not None else max((len(r[0]) for r in rows if r), default=0)
        tok = np.zeros((b, m), dtype=np.int64)
        par = np.full((b, m), -1, dtype=np.int64)
        sc = np.zeros((b, m), dtype=np.float32)
        val = np.zeros((b, m), dtype=bool)
        for i, r in enumerate(rows):
            if not r:
                continue
            k = min(len(r[0]), m)
            tok[i, :k] = r[0][:k]
            par[i, :k] = r[1][:k]
            sc[i, :k] = r[2][:k]
            val[i, :k] = True
        t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        return Candidates(t(tok), t(par), t(sc), t(val))

    @staticmethod
    def concat(parts: Sequence["Candidates"]) -> "Candidates":
        """Stack several sources along M (parents re-based); duplicates merge in graft."""
        parts = [p for p in parts if p.width > 0]
        if not parts:
            raise ValueError("Candidates.concat needs at least one non-empty part")
        if len(parts) == 1:
            return parts[0]
        toks, pars, scs, vals = [], [], [], []
        off = 0
        for p in parts:
            toks.append(p.tokens)
            pars.append(torch.where(p.parents >= 0, p.parents + off, -1))
            scs.append(p.score)
            vals.append(p.valid)
            off += p.width
        return Candidates(torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(scs, 1), torch.cat(vals, 1))


class RetrievalSource(abc.ABC):
    """Five-method interface every retrieval source implements."""

    name: str = "source"

    def start(self, req_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """A new request with its prompt token ids (idempotent per req_id)."""

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        """Tokens committed for ``req_id`` since the last call (accepted + bonus)."""

    @abc.abstractmethod
    def propose(self, req_ids: Sequence[Hashable], root_tokens: torch.Tensor, budget: int) -> Candidates:
        """Candidates under each request's root.

        Args:
            req_ids: B request ids (unknown ids get no candidates).
            root_tokens: ``int64[B]`` root token per request.
            budget: at most this many candidate nodes per request.
        Returns:
            `Candidates` ``[B, M]`` with M <= budget.
        """

    def stop(self, req_id: Hashable) -> None:
        """Forget a finished request (must free its memory)."""

    def live_requests(self) -> int:
        """Requests currently holding per-request state."""
        return 0

    def memory_bytes(self) -> int:
        """Approximate bytes held (host + device)."""
        return 0
