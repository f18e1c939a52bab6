"""Lookup: prompt-lookup continuations from each slot's device history (no host, no lag).

The context's tail (the last m tokens, the root last) is matched against every earlier position of
the slot's window (history.py); the longest match (m <= ``max_match``), latest position first, gives
the continuation: the tokens that followed it. When the continuation runs into the present (the
match is one period back in a loop), it wraps around with that period, so a loop yields a chain as
deep as the budget (SGLang's NGRAM gets deep loop chains from its trie in the same situation;
prompt lookup decoding, Saxena 2023, is the chain-only form). The chain's nodes are priced by the
calibrator by depth and match length (member ``lookup``), so how deep it is taken is learnt.

Static shapes and a fixed number of ops (about 5 per match length): it runs inside the graft step,
on the device, on the history that the previous round's bookkeeping appended to.
"""

from __future__ import annotations

import torch

__all__ = ["lookup_propose"]


def lookup_propose(hist: torch.Tensor, count: torch.Tensor, max_match: int, depth: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chain continuation of every row's context tail.

    Args:
        hist: ``int64[B, L]`` right-aligned windows (``hist[:, L-1]`` = the root); count: ``int64[B]``
            valid tokens at the right end.
        max_match: longest tail matched (>= 1); depth: D, chain length proposed.
    Returns:
        ``(tokens int64[B, D], valid bool[B, D], match int64[B])``: node t of the chain is at depth
        t + 1 (its parent is node t - 1, the root for t = 0); ``match`` = the matched tail length
        (0 = no match, then nothing is valid).
    """
    b, length = hist.shape
    dev = hist.device
    end = length - 1
    start = (length - count.to(torch.int64))[:, None]                              # first valid index
    j = torch.arange(end, device=dev)[None, :]                                       # candidate match ends
    ok = (hist[:, :end] == hist[:, end:]) & (j >= start)
    best_j = torch.full((b,), -1, dtype=torch.int64, device=dev)
    best_m = torch.zeros(b, dtype=torch.int64, device=dev)
    for m in range(1, max_match + 1):
        if m > 1:
            back = torch.cat([torch.zeros(b, m - 1, dtype=hist.dtype, device=dev), hist[:, : end - (m - 1)]], 1)
            ok = ok & (back == hist[:, end - (m - 1): end - (m - 1) + 1]) & (j - (m - 1) >= start)
        last = torch.where(ok, j, -1).amax(dim=1)
        found = (last >= 0) & (count >= m)
        best_j = torch.where(found, last, best_j)
        best_m = torch.where(found, m, best_m)
    period = (end - best_j).clamp(min=1)[:, None]
    t = torch.arange(depth, device=dev)[None, :]
    idx = (best_j[:, None] + 1 + t % period).clamp(0, end)
    tokens = hist.gather(1, idx)
    return tokens, (best_m > 0)[:, None].expand(b, depth), best_m
