"""Calibration bins of candidate nodes: the axes every estimate is looked up by (calibration.py).

A draft node's bin is (depth, draft probability, mode); a retrieved node's is (member source, depth,
probability, match length, mode), offset by its member's first bin (`BinLayout`).
"""

from __future__ import annotations

import math

import torch

from ..sources import SOURCE_OUTPUTS, SOURCE_SUFFIX

__all__ = ["LOGP_EDGES", "DEPTH_EDGES", "MATCH_EDGES", "q_bins", "draft_bin_ids", "retrieval_bin_ids"]

#: Upper edges of the log-probability bins, highest probability first: bin 0 holds log p > -0.1.
LOGP_EDGES = (-0.1, -0.3, -0.6, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -9.0, -14.0)
#: Depth bins (retrieved nodes): 1, 2, 3, 4, 5-6, 7-8, 9-12, 13-16, 17-24, 25-32, 33-48, 49+.
DEPTH_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
#: Match-length bins (suffix / corpus): 1, 2, 3-4, 5-8, 9-16, 17-32, 33+.
MATCH_EDGES = (1, 2, 4, 8, 16, 32)


def q_bins(logp: torch.Tensor, logp_edges: torch.Tensor) -> torch.Tensor:
    """``int64``: the probability bin of each log-probability (0 = highest; NaN and -inf last) for
    the ascending edges ``logp_edges`` ``float32[Q - 1]`` (`LOGP_EDGES` reversed)."""
    x = torch.nan_to_num(logp.float(), nan=-math.inf).contiguous()
    n = logp_edges.numel()
    return (n - torch.bucketize(x, logp_edges, right=True)).clamp(0, n)


def draft_bin_ids(depth: torch.Tensor, logq: torch.Tensor, sampled: torch.Tensor, logp_edges: torch.Tensor,
                  draft_depth: int, num_q: int, per_mode: int) -> torch.Tensor:
    """``int64[B, S]``: draft nodes' bins (depth bin x probability bin, + ``per_mode`` on sampled
    rows) from ``depth`` (1-based) and ``logq`` broadcastable to ``[B, S]`` and ``sampled`` ``bool[B]``."""
    d = (depth.to(torch.int64) - 1).clamp(0, draft_depth - 1)
    return d * num_q + q_bins(logq, logp_edges) + (sampled.to(torch.int64) * per_mode)[:, None]


def retrieval_bin_ids(member: torch.Tensor, depth: torch.Tensor, logp: torch.Tensor, match: torch.Tensor,
                      sampled: torch.Tensor, retrieval_base: torch.Tensor, logp_edges: torch.Tensor,
                      depth_edges: torch.Tensor, match_edges: torch.Tensor, per_mode: int) -> torch.Tensor:
    """``int64[B, M]``: retrieval nodes' bins, ``retrieval_base[member]`` + (depth bin x probability
    bin x match bin) + ``per_mode`` on sampled rows. ``member`` one of `RETRIEVAL_SOURCES`; all
    broadcastable to ``[B, M]`` but ``sampled`` ``bool[B]``; the edges ascending."""
    nq, nd, nm = logp_edges.numel() + 1, depth_edges.numel() + 1, match_edges.numel() + 1
    d = torch.bucketize(depth.contiguous(), depth_edges, right=False).clamp(max=nd - 1)
    m = torch.bucketize(match.clamp(min=1).contiguous(), match_edges, right=False).clamp(max=nm - 1)
    within = (d * nq + q_bins(logp, logp_edges)) * nm + m
    return retrieval_base[member.clamp(SOURCE_SUFFIX, SOURCE_OUTPUTS)] + within + (sampled.to(torch.int64)
                                                                                  * per_mode)[:, None]
