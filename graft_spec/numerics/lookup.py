"""Lookup: prompt-lookup continuations from each slot's device history (no host, no lag).

The context's tail (the last m tokens, the root last) is matched against every earlier position of
the slot's window (history.py); the longest match (m <= ``max_match``), latest position first, gives
the continuation: the tokens that followed it. When the continuation runs into the present (the
match is one period back in a loop), it wraps around with that period, so a loop yields a chain as
deep as the budget (SGLang's NGRAM gets deep loop chains from its trie in the same situation;
prompt lookup decoding, Saxena 2023, is the chain-only form). The chain's nodes are priced by the
calibrator by depth and match length (member ``lookup``), so how deep it is taken is learnt.

Static shapes and a fixed number of ops (one comparison block per ``2**24 / (B x max_match)``
candidate positions, one block at the defaults): the window is read newest first, so every
candidate position's matched length comes from one ``[B, positions, max_match]`` comparison of a
strided view (no copy of it) and a cumulative product instead of one pass per match length. It runs
inside the graft step, on the device, on the history that the previous round's bookkeeping
appended to.
"""

from __future__ import annotations

import torch

__all__ = ["LOOKUP_MAX_MATCH", "lookup_propose"]

#: Elements of one ``[B, positions, max_match]`` comparison block: bounds the step's bool / uint8
#: temporaries at long histories (``history_len`` up to 65,536) to a few times 16 MiB.
_BLOCK_ELEMENTS = 1 << 24


def _chunk(b: int, end: int, max_match: int) -> int:
    """Candidate positions per comparison block (a function of shapes only, so CUDA graphs capture it)."""
    return max(1, min(end, _BLOCK_ELEMENTS // max(1, b * max_match)))


#: Longest context tail the lookup matches (tokens).
LOOKUP_MAX_MATCH = 8


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
    valid = torch.arange(length, device=dev) >= (length - count.to(torch.int64))[:, None]
    # newest first: back[:, k + c] = hist[end - k - c], invalid positions -1 (the -1 pad covers k + c > end)
    back = torch.cat([torch.where(valid, hist, -1).flip(1), hist.new_full((b, max_match - 1), -1)], 1)
    win = back.unfold(1, max_match, 1)                     # [B, L, M]: row k = hist[end - k - c], c = 0..M-1
    tail = torch.where(win[:, :1] < 0, -2, win[:, :1])     # the root's tail (k = 0); invalid matches nothing
    runs, step = [], _chunk(b, end, max_match)
    for lo in range(1, length, step):                                              # static: shapes only
        eq = win[:, lo:lo + step] == tail                  # the run of equal columns from c = 0 is the
        runs.append(torch.cumprod(eq.to(torch.uint8), dim=2, dtype=torch.uint8).sum(dim=2))  # length matched
    run = torch.cat(runs, 1) if len(runs) > 1 else runs[0]                        # [B, L-1]: ending at end - k
    best_m = torch.minimum(run.amax(dim=1), count.to(torch.int64).clamp(min=0))  # longest usable tail
    j = end - torch.arange(1, length, device=dev)[None, :]                          # the end of row k
    best_j = torch.where((run >= best_m[:, None]) & (best_m[:, None] > 0), j, -1).amax(dim=1)  # its latest end
    period = (end - best_j).clamp(min=1)[:, None]
    t = torch.arange(depth, device=dev)[None, :]
    idx = (best_j[:, None] + 1 + t % period).clamp(0, end)
    tokens = hist.gather(1, idx)
    return tokens, (best_m > 0)[:, None].expand(b, depth), best_m
