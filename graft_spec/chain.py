"""Tree <-> chain helpers for engines whose verifier takes one chain per request (vLLM 0.33).

* `spine_tree`: an EAGLE loop that expands only the top-1 token per depth (vLLM 0.33,
  llm_base_proposer.py:511-773, loop at :688; no tree attention, see docs/vllm.md) still sees at
  every depth the logits that give the top-k siblings of that token. The resulting "spine" tree is a valid
  EAGLE draft tree: depth d holds the k best children of the depth d-1 spine node.
* `best_chain`: the root-to-node path with the highest expected accepted length.
  With one-hot draft probabilities a chain's token at depth d is accepted iff every
  token before it is, so E[accepted] = sum over path nodes of P(path prefix accepted),
  and ``DraftTree.logp`` is exactly log P(path accepted) (draft: cumulative draft
  log-prob; retrieved: log of the estimated path acceptance; graft.py docstring).
* `cap_depth`: drops retrieved candidates deeper than the longest chain the engine verifies,
  so they do not take tree slots `best_chain` could never pick (`GraftPlanner.build_chains`).
"""

from __future__ import annotations

import math

import torch

from .sources import SOURCE_DRAFT
from .tree import DraftTree, ancestor_mask, node_depths, node_paths, path_min, pointer_jumps

__all__ = ["spine_tree", "best_chain", "cap_depth"]


def spine_tree(root_tokens: torch.Tensor, level_logp: torch.Tensor, level_ids: torch.Tensor) -> DraftTree:
    """Draft tree of the top-k siblings along the greedy EAGLE chain.

    Node layout: 0 = root; depth d (1..K), sibling rank j (0..k-1) is node
    ``1 + (d-1)*k + j``; rank 0 is the spine (the token the drafter expanded). The
    parent of every depth-d node is the depth d-1 spine node (the root for d = 1).

    Args:
        root_tokens: ``int64[B]`` last verified token (vLLM's ``next_token_ids``).
        level_logp: ``float[B, K, k]`` draft log-softmax of the top-k tokens at each
            depth, best first (``-inf`` allowed: tokens outside the draft vocabulary).
        level_ids: ``int64[B, K, k]`` the matching token ids (distinct per depth).
    Returns:
        `DraftTree` ``[B, 1 + K*k]``: ``logp`` = cumulative draft log-prob of the path,
        root 0; all nodes tagged `SOURCE_DRAFT`.
    Raises:
        ValueError: shape mismatch.
    """
    if level_logp.shape != level_ids.shape or level_logp.dim() != 3:
        raise ValueError(f"spine_tree: level_logp {tuple(level_logp.shape)} and level_ids "
                         f"{tuple(level_ids.shape)} must both be [B, K, k]")
    b, depth, k = level_ids.shape
    dev = level_ids.device
    lp = level_logp.float()
    spine_cum = torch.cumsum(lp[:, :, 0], dim=1)                                 # [B, K]
    prev = torch.cat([torch.zeros(b, 1, device=dev), spine_cum[:, :-1]], dim=1)  # [B, K]
    logp = (prev[:, :, None] + lp).reshape(b, depth * k)
    # parent of depth d (0-based l = d-1): root for l = 0, else spine node 1 + (l-1)*k
    par_level = torch.where(torch.arange(depth, device=dev) == 0, 0,
                            1 + (torch.arange(depth, device=dev) - 1) * k)
    parents = par_level.repeat_interleave(k).expand(b, depth * k)
    n = 1 + depth * k
    return DraftTree(
        tokens=torch.cat([root_tokens.reshape(b, 1).to(torch.int64), level_ids.reshape(b, -1).to(torch.int64)], 1),
        parents=torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), parents.to(torch.int64)], 1),
        logp=torch.cat([torch.zeros(b, 1, device=dev), logp], 1),
        source=torch.full((b, n), SOURCE_DRAFT, dtype=torch.int64, device=dev),
    )


def best_chain(tree: DraftTree, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Root-to-node path with the largest expected accepted length, at most ``max_len`` tokens.

    Node acceptance probabilities are ``exp(path_min(logp))`` (made monotone along the
    path, as graft does; padding and ``-inf`` nodes count 0). The expected accepted
    length of the path ending at node v is the sum of those over v and its non-root
    ancestors; ties go to the lowest node index (so the shorter of two equal paths).

    Args:
        tree: hybrid tree ``[B, N]`` (e.g. `GraftPlanner.build` output).
        max_len: K >= 0, the most draft tokens vLLM verifies for a request.
    Returns:
        ``(tokens int64[B, K] (-1 after the chain), length int64[B], expected float32[B])``.
    """
    b, n = tree.tokens.shape
    dev = tree.device
    if max_len <= 0:
        return (torch.empty(b, 0, dtype=torch.int64, device=dev), torch.zeros(b, dtype=torch.int64, device=dev),
                torch.zeros(b, device=dev))
    jumps = pointer_jumps(tree.parents)
    depth = node_depths(tree.parents, jumps)
    logp = path_min(torch.nan_to_num(tree.logp.float(), nan=-math.inf), tree.parents, jumps)
    p = torch.where((depth >= 1) & (depth <= max_len), logp.exp(), torch.zeros((), device=dev))
    mask = ancestor_mask(tree.parents, jumps)
    expected = (mask.float() @ p[:, :, None]).squeeze(-1)                             # [B, N]
    expected = torch.where(depth <= max_len, expected, torch.full((), -1.0, device=dev))
    best = expected.argmax(dim=1)                                                     # first max
    length = depth.gather(1, best[:, None]).squeeze(1)
    paths = node_paths(tree.parents, max_depth=max_len, mask=mask)                   # [B, N, K+1]
    nodes = paths.gather(1, best[:, None, None].expand(b, 1, max_len + 1)).squeeze(1)[:, 1:]
    tokens = torch.where(nodes >= 0, tree.tokens.gather(1, nodes.clamp(min=0)), -1)
    return tokens, length, expected.gather(1, best[:, None]).squeeze(1)


def cap_depth(parts: list, max_depth: int) -> list:
    """Retrieved candidates with their depth capped: those deeper than ``max_depth`` become invalid.

    Args:
        parts: `graft_spec.step.GraftStep.retrieve`'s `Candidates` blocks ``[B, C_i]``, ``parents``
            indexing the block's own candidates (-1 = a child of the root, so a candidate's depth is
            its parent chain's length + 1).
        max_depth: the longest chain verified (vLLM's K), >= 1.
    Returns:
        The same blocks with the candidates below ``max_depth`` made invalid (`Candidates.where`:
        ``valid`` False, ``est`` 0, ``bins`` -1; their descendants are deeper still, so no kept node
        loses its parent).
    Raises:
        ValueError: ``max_depth`` < 1.
    """
    if max_depth < 1:
        raise ValueError(f"cap_depth: max_depth={max_depth} must be >= 1")
    out = []
    for part in parts:
        b = part.parents.shape[0]
        full = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=part.parents.device),
                          torch.where(part.parents < 0, 0, part.parents + 1).to(torch.int64)], 1)
        out.append(part.where(node_depths(full)[:, 1:] <= max_depth))
    return out
