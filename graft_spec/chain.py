"""Tree <-> chain helpers for engines whose verifier takes one chain per request (vLLM 0.33).

* `spine_tree`: an EAGLE loop that expands only the top-1 token per depth (vLLM 0.33,
  llm_base_proposer.py:511-773, loop at :688; no tree attention, see docs/vllm.md) still sees at
  every depth the logits that give the top-k siblings of that token. The resulting "spine" tree is a valid
  EAGLE draft tree: depth d holds the k best children of the depth d-1 spine node.
* `cap_depth`: drops retrieved candidates deeper than the longest chain the engine verifies,
  so they do not take tree slots no chain could use (`GraftPlanner.build_chains`).
* `ChainPricer`: the chain choice with its own calibration (what the vLLM adapter uses). A tree
  prices a retrieved token beside the draft's; a chain must pick one of them, and there the tree's
  estimates mislead: a retrieval source's estimate is its average over all its nodes, but at a fork
  under the draft's path (the retrieved token differs from the draft's top-1) it is accepted far
  less often than that average, and the sibling caps (`kernels.select.sibling_caps`) leave the
  draft's top-1 the residual of those over-estimates (often 0). `ChainPricer` prices every node by
  its conditional acceptance given its parent (the draft's own probability for drafted tokens, the
  tree's estimate ratio for the others), corrected per (mode, fork, class, depth) cell by what the
  committed tokens showed (every node whose parent was committed is a trial, chosen or not), and
  keeps the pure draft chain (the spine) as a candidate even where the tree dropped part of it: the
  chain it returns is priced at least as high as the better of the draft's and the tree's.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .sources import NUM_MEMBERS, SOURCE_DRAFT, SOURCE_NAMES, SOURCE_PADDING
from .tree import DraftTree, ancestor_mask, node_depths, node_paths, path_min, pointer_jumps

__all__ = ["spine_tree", "cap_depth", "Chain", "ChainPricer"]


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


class Chain(NamedTuple):
    """`ChainPricer.choose`'s result, one chain per request.

    Attributes:
        tokens: ``int64[B, K]`` the chain, -1 after its end.
        length: ``int64[B]`` its length (0..K).
        expected: ``float32[B]`` its expected accepted tokens (bonus excluded) under the corrected prices.
        source: ``int64[B, K]`` the tree source of each chain token (`graft_spec.sources`; a token of
            the spine taken beyond the tree is ``SOURCE_DRAFT``), -1 after the end.
    """

    tokens: torch.Tensor
    length: torch.Tensor
    expected: torch.Tensor
    source: torch.Tensor


class ChainPricer:
    """Chooses each request's chain from the hybrid tree with chain-level calibrated estimates.

    Every node ``v`` of the tree (depth 1..K) gets a conditional acceptance ``c(v)`` = P(v accepted |
    its parent accepted):

    * a *spine* node (the draft's top-1 path): the draft's top-1 probability at that depth;
    * a drafted node under a spine node (a top-k sibling, or an agreement node): the draft's
      probability of its token there;
    * any other node: the tree's estimate ratio ``exp(logp[v] - logp[parent])`` (<= 1; a spine
      parent's ``logp`` taken at least at its draft path probability).

    Each node belongs to a cell (mode greedy / sampled, fork: its parent is on the spine, class: its
    tree source, or ``spine``, depth), and ``c`` is scaled by the cell's factor ``(H + a f) / (E + a)``,
    where ``E`` sums ``c`` and ``H`` counts hits over the cell's observed nodes and ``f`` is the class's
    factor pooled over depths, itself shrunk to its group's (drafted / retrieved / spine), that to 1
    (``a`` = `PRIOR_WEIGHT`). A node is observed
    when its parent lies on the committed path within the committed depth (`observe`): under greedy
    verification the committed token there is the target's argmax, under sampled verification with a
    one-hot draft it is distributed as the target's p (rejection sampling's residual), so chosen and
    unchosen siblings alike are unbiased trials. The chain is the root path with the largest expected
    accepted length ``sum_i prod_{j <= i} c(v_j)``; the full spine (K tokens, priced the same way) is a
    candidate too, so the choice never prices below the pure draft chain nor below any tree path.

    Args:
        max_depth: deepest depth bin (deeper nodes share it).
        device: where the counts live.

    All tensors of `choose` / `observe` are on ``device``; no host read except what the caller
    does with the returned chain.
    """

    #: pseudo-units of ``E`` each factor's prior (the class's, the group's, then 1) weighs
    PRIOR_WEIGHT = 2.0
    #: a cell's counts are halved once its ``E`` exceeds this (memory for drift)
    HALVE_AT = 2048.0
    #: classes: the tree sources (0 .. NUM_MEMBERS - 1, draft = a non-spine drafted node), then the spine
    SPINE = NUM_MEMBERS
    NUM_CLASSES = NUM_MEMBERS + 1
    #: class -> pooling group: drafted (draft, agree), retrieved (successor .. outputs), the spine
    GROUPS = (0, 1, 1, 1, 1, 1, 0, 2)

    def __init__(self, max_depth: int = 8, device: "torch.device | str" = "cpu"):
        self.max_depth = int(max_depth)
        self.device = torch.device(device)
        shape = (2, 2, self.NUM_CLASSES, self.max_depth)           # mode, fork, class, depth
        self.expected = torch.zeros(shape, device=self.device)
        self.hits = torch.zeros(shape, device=self.device)
        self.trials = torch.zeros(shape, device=self.device)
        self._groups = torch.tensor(self.GROUPS, device=self.device)
        self._last: Optional[dict] = None

    def factors(self) -> torch.Tensor:
        """``float32[2, 2, NUM_CLASSES, max_depth]`` current correction factor of every cell: shrunk
        to its class's factor (all depths), that to its group's (`GROUPS`, same mode and fork), that
        to 1, each with `PRIOR_WEIGHT` pseudo-units."""
        a = self.PRIOR_WEIGHT
        h_cls, e_cls = self.hits.sum(-1), self.expected.sum(-1)                     # [2, 2, C]
        onehot = torch.nn.functional.one_hot(self._groups, int(self._groups.max()) + 1).float()   # [C, G]
        grp = (h_cls @ onehot + a) / (e_cls @ onehot + a)                         # [2, 2, G]
        cls = (h_cls + a * grp[:, :, self._groups]) / (e_cls + a)
        return (self.hits + a * cls[..., None]) / (self.expected + a)

    def _cell(self, sampled: torch.Tensor, fork: torch.Tensor, cls: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        d = (depth - 1).clamp(0, self.max_depth - 1)
        return ((sampled.to(torch.int64) * 2 + fork.to(torch.int64)) * self.NUM_CLASSES + cls) * self.max_depth + d

    def choose(self, tree: DraftTree, level_logp: torch.Tensor, level_ids: torch.Tensor,
               sampled: torch.Tensor, max_len: int) -> Chain:
        """One chain per request from the hybrid tree and the draft's levels (module docstring).

        Args:
            tree: hybrid tree ``[B, N]`` (`GraftPlanner.build_chains`' ``out.tree``; ``logp`` = log
                estimated path acceptance).
            level_logp, level_ids: ``[B, >= K, k]`` the draft's top-k log-probabilities and tokens per
                depth along its top-1 path (what `spine_tree` was built from; rank 0 = the spine).
            sampled: ``bool[B]`` rows verified by sampling.
            max_len: K >= 0, the most draft tokens verified per request.
        Returns:
            `Chain` ``[B, K]``.
        """
        b, n = tree.tokens.shape
        dev = tree.device
        if max_len <= 0:
            self._last = None
            empty = torch.empty(b, 0, dtype=torch.int64, device=dev)
            return Chain(empty, torch.zeros(b, dtype=torch.int64, device=dev), torch.zeros(b, device=dev), empty)
        k_len = max_len
        lvl_lp = level_logp[:, :k_len].float().to(dev)
        lvl_id = level_ids[:, :k_len].to(dev, torch.int64)
        kk = lvl_id.shape[2]
        sampled = sampled.reshape(b).to(dev, torch.bool)
        jumps = pointer_jumps(tree.parents)
        depth = node_depths(tree.parents, jumps)
        par = tree.parents.clamp(min=0)
        dix = (depth - 1).clamp(0, k_len - 1)
        spine_ids = lvl_id[:, :, 0]
        match = (depth == 0) | ((depth <= k_len) & (tree.tokens == spine_ids.gather(1, dix)))
        on_spine = path_min(match.float(), tree.parents, jumps) > 0.5
        fork = on_spine.gather(1, par) & (depth >= 1)
        at = lvl_id.gather(1, dix[:, :, None].expand(b, n, kk))                          # [B, N, k]
        eq = at == tree.tokens[:, :, None]
        q = torch.where(eq, lvl_lp.gather(1, dix[:, :, None].expand(b, n, kk)), -math.inf).amax(-1)
        lp = torch.nan_to_num(tree.logp.float(), nan=-math.inf)
        # the parent's path estimate; a spine parent's at least its draft path probability (the tree's
        # may be a sibling cap's residual)
        cumq = torch.cat([torch.zeros(b, 1, device=dev), torch.cumsum(lvl_lp[:, :, 0], 1)], 1)   # [B, K+1]
        plp = lp.gather(1, par)
        plp = torch.where(on_spine.gather(1, par), torch.maximum(plp, cumq.gather(1, depth.gather(1, par).clamp(max=k_len))),
                          plp)
        ratio = torch.where(lp > -math.inf, lp - torch.where(plp > -math.inf, plp, 0.0), -math.inf).clamp(max=0.0)
        base = torch.where(fork & eq.any(-1), q, ratio)                                  # log c before correction
        cls = torch.where(on_spine, self.SPINE, tree.source.clamp(0, NUM_MEMBERS - 1))
        valid = (depth >= 1) & (depth <= k_len) & (tree.source != SOURCE_PADDING) & (base > -math.inf)
        cell = self._cell(sampled[:, None].expand(b, n), fork | on_spine, cls, depth)
        fac = self.factors().reshape(-1)
        logc = torch.where(valid, (base + fac.gather(0, cell.reshape(-1)).log().view(b, n)).clamp(max=0.0), -math.inf)
        logc[:, 0] = 0.0
        mask = ancestor_mask(tree.parents, jumps)
        path_lp = (mask.float() @ logc.clamp(min=-1e4)[:, :, None]).squeeze(-1)          # log P(path accepted)
        p = torch.where(valid, path_lp.exp(), 0.0)
        expected = (mask.float() @ p[:, :, None]).squeeze(-1)
        expected = torch.where(depth <= k_len, expected, -1.0)
        best = expected.argmax(dim=1)
        length = depth.gather(1, best[:, None]).squeeze(1)
        paths = node_paths(tree.parents, max_depth=k_len, mask=mask)
        nodes = paths.gather(1, best[:, None, None].expand(b, 1, k_len + 1)).squeeze(1)[:, 1:]
        tokens = torch.where(nodes >= 0, tree.tokens.gather(1, nodes.clamp(min=0)), -1)
        source = torch.where(nodes >= 0, tree.source.gather(1, nodes.clamp(min=0)), -1)
        value = expected.gather(1, best[:, None]).squeeze(1)
        # the pure draft chain, whole (the tree may have dropped its deep nodes for retrieved ones)
        ar = torch.arange(1, k_len + 1, device=dev).expand(b, k_len)
        sp_base = lvl_lp[:, :, 0]
        sp_cell = self._cell(sampled[:, None].expand(b, k_len), torch.ones_like(ar, dtype=torch.bool),
                             torch.full_like(ar, self.SPINE), ar)
        sp_logc = (sp_base + fac.gather(0, sp_cell.reshape(-1)).log().view(b, k_len)).clamp(max=0.0)
        sp_value = torch.cumsum(sp_logc.clamp(min=-1e4), 1).exp().sum(1)
        use_spine = sp_value > value + 1e-6
        tokens = torch.where(use_spine[:, None], spine_ids, tokens)
        source = torch.where(use_spine[:, None], SOURCE_DRAFT, source)
        length = torch.where(use_spine, k_len, length)
        value = torch.where(use_spine, sp_value, value)
        self._last = {"tokens": tree.tokens, "parents": tree.parents, "depth": depth, "jumps": jumps,
                      "valid": valid & ~on_spine, "cell": cell, "base": base.exp().clamp(max=1.0),
                      "spine": spine_ids, "sp_cell": sp_cell, "sp_base": sp_base.exp().clamp(max=1.0)}
        return Chain(tokens, length, value, source)

    def observe(self, committed: torch.Tensor, lens: torch.Tensor) -> None:
        """Count the last `choose`'s nodes against the tokens the target committed after the root.

        Args:
            committed: ``int64[B, L]`` committed tokens (accepted, then the bonus), rows as in `choose`.
            lens: ``int64[B]`` valid tokens per row; 0 = not verified (counts nothing).
        """
        last, self._last = self._last, None
        if last is None:
            return
        dev = self.device
        committed = committed.to(dev, torch.int64)
        lens = lens.to(dev, torch.int64)
        lw = max(committed.shape[1], 1)
        if committed.shape[1] == 0:
            committed = torch.zeros(committed.shape[0], 1, dtype=torch.int64, device=dev)
        depth, parents = last["depth"], last["parents"]
        want = committed.gather(1, (depth - 1).clamp(0, lw - 1))
        within = depth <= lens[:, None]
        match = torch.where(depth == 0, True, within & (last["tokens"] == want)).float()
        on_path = path_min(match, parents, last["jumps"]) > 0.5
        seen = last["valid"] & within & on_path.gather(1, parents.clamp(min=0))
        self._add(last["cell"][seen], last["base"][seen], on_path[seen])
        sp = last["spine"]
        k = sp.shape[1]
        ar = torch.arange(1, k + 1, device=dev)
        c = committed[:, :k] if committed.shape[1] >= k else torch.cat(
            [committed, torch.full((committed.shape[0], k - committed.shape[1]), -1, dtype=torch.int64, device=dev)], 1)
        hit = sp == c
        prefix = torch.cat([torch.ones_like(hit[:, :1]), torch.cummin(hit.to(torch.int64), 1).values[:, :-1].bool()], 1)
        sp_seen = prefix & (ar[None, :] <= lens[:, None])
        self._add(last["sp_cell"][sp_seen], last["sp_base"][sp_seen], hit[sp_seen])

    def _add(self, cell: torch.Tensor, base: torch.Tensor, hit: torch.Tensor) -> None:
        flat_e, flat_h, flat_t = self.expected.view(-1), self.hits.view(-1), self.trials.view(-1)
        flat_e.index_add_(0, cell, base.float())
        flat_h.index_add_(0, cell, hit.float())
        flat_t.index_add_(0, cell, torch.ones_like(base, dtype=torch.float32))
        big = self.expected > self.HALVE_AT
        for t in (self.expected, self.hits, self.trials):
            t.copy_(torch.where(big, t * 0.5, t))

    def summary(self) -> dict:
        """Per (mode, fork/continuation, class): trials, mean priced ``c`` before correction, observed
        rate and the pooled factor, over all depths (host read), for logs and tests."""
        out = {}
        names = [*SOURCE_NAMES[:NUM_MEMBERS], "spine"]
        for m, mode in enumerate(("greedy", "sampled")):
            for f, where in enumerate(("continuation", "fork")):
                for c, name in enumerate(names):
                    t = float(self.trials[m, f, c].sum())
                    if t:
                        e, h = float(self.expected[m, f, c].sum()), float(self.hits[m, f, c].sum())
                        out[f"{mode}/{where}/{name}"] = {"trials": t, "priced": e / t, "observed": h / t}
        return out
