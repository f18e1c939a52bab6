"""Tree verification: greedy and target-only tree rejection sampling (lossless).

Greedy (SGLang ``verify_tree_greedy``, kernels/ops/speculative/spec_tree.py:480): from the
root, at each level accept the first child (lowest index) whose token equals the target's
argmax at the current node; the bonus is the target's token at the last accepted node.

Sampling (SGLang ``tree_speculative_sampling_target_only`` with both thresholds = 1,
sgl_kernel speculative_sampling.cuh; EAGLE ``evaluate_posterior`` with q = 1; reference
landscape §4): at the current node with target distribution p, walk its children in index
order and accept child x with probability p(x) / (mass not yet rejected); on rejection
p(x) is zeroed and the rest renormalised. Drawn with one uniform u per node this is
inverse-CDF sampling: child i is accepted iff ``sum_{j<i} p(x_j) <= u < sum_{j<=i} p(x_j)``,
so P(accept x_i) = p(x_i). If no child is accepted (or the node is a leaf) the bonus is
sampled from p with all children zeroed, renormalised. Every emitted token is therefore
exactly ~p for *any* candidate set that does not depend on the verification coins,
provided sibling tokens are distinct (a repeated token would be tried twice). `sample_verify`
runs it through ``graft::tree_sample`` (kernels/tree_sample.py), the op SGLang's graft verify uses.

Sources: both functions count accepted nodes (root excluded, bonus excluded) per
`SOURCE_*` when ``source`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .kernels.tree_sample import tree_sample
from .sources import NUM_SOURCES
from .tree import ancestor_mask, sibling_links

__all__ = ["VerifyResult", "greedy_verify", "sample_verify", "logits_to_probs"]


@dataclass
class VerifyResult:
    """Outcome of verifying a batch of trees.

    Attributes:
        accept_index: ``int64[B, N]`` tree indices of the accepted path, root (0) first,
            -1 padded (SGLang's accept_index layout, width N instead of depth + 1).
        accept_length: ``int64[B]`` accepted draft tokens + 1 (the bonus), i.e. the
            number of tokens emitted this step.
        bonus: ``int64[B]`` the token emitted after the last accepted node.
        accepted_by_source: ``int64[B, 3]`` accepted nodes (root excluded) by source
            (draft / retrieved / padding); zeros when no source was given.
    """

    accept_index: torch.Tensor
    accept_length: torch.Tensor
    bonus: torch.Tensor
    accepted_by_source: torch.Tensor

    def emitted(self, tokens: torch.Tensor) -> list[list[int]]:
        """Tokens emitted per request: accepted path tokens after the root, then the bonus.

        Args:
            tokens: ``int64[B, N]`` tree tokens that were verified.
        """
        out = []
        idx = self.accept_index.tolist()
        toks = tokens.tolist()
        for row_idx, row_tok, n, bonus in zip(idx, toks, self.accept_length.tolist(), self.bonus.tolist()):
            out.append([row_tok[i] for i in row_idx[1:n]] + [bonus])
        return out


def _finish(on_path: torch.Tensor, bonus: torch.Tensor, source: Optional[torch.Tensor]) -> VerifyResult:
    b, n = on_path.shape
    ar = torch.arange(n, device=on_path.device)
    dest = torch.where(on_path, torch.cumsum(on_path, dim=1) - 1, n)   # path nodes, in index order
    accept_index = torch.full((b, n + 1), -1, dtype=torch.int64, device=on_path.device)
    accept_index = accept_index.scatter_(1, dest, ar.expand(b, n))[:, :n]
    accept_length = on_path.sum(dim=1)
    by_src = torch.zeros(b, NUM_SOURCES, dtype=torch.int64, device=on_path.device)
    if source is not None:
        acc = on_path.clone()
        acc[:, 0] = False
        by_src.scatter_add_(1, source.clamp(0, NUM_SOURCES - 1), acc.to(torch.int64))
    return VerifyResult(accept_index, accept_length, bonus, by_src)


def greedy_verify(tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor,
                  source: Optional[torch.Tensor] = None) -> VerifyResult:
    """Greedy tree verification (longest path of target-argmax matches).

    Args:
        tokens: ``int64[B, N]`` tree tokens (root at 0).
        parents: ``int64[B, N]`` (-1 root, parent < child).
        target_ids: ``int64[B, N]`` target argmax *after* each node (logits of node i
            predict the token following i).
        source: optional ``int64[B, N]`` node sources for ``accepted_by_source``.
    Returns:
        `VerifyResult`.
    """
    b, n = tokens.shape
    ar = torch.arange(n, device=tokens.device)
    expect = target_ids.gather(1, parents.clamp(min=0))
    correct = tokens == expect
    correct[:, 0] = True
    same_parent = parents[:, :, None] == parents[:, None, :]
    earlier = ar[None, None, :] < ar[None, :, None]
    shadowed = (same_parent & earlier & correct[:, None, :]).any(dim=2)
    first = correct & ~shadowed
    mask = ancestor_mask(parents)
    on_path = ~(mask & ~first[:, None, :]).any(dim=2)
    last = torch.where(on_path, ar, 0).amax(dim=1)
    bonus = target_ids.gather(1, last[:, None]).squeeze(1)
    return _finish(on_path, bonus, source)


def sample_verify(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor, *,
                  generator: Optional[torch.Generator] = None,
                  source: Optional[torch.Tensor] = None, coins: Optional[torch.Tensor] = None) -> VerifyResult:
    """Target-only tree rejection sampling (see module docstring) of parents-array trees, by
    ``graft::tree_sample`` (kernels/tree_sample.py: the fused kernel on a CUDA device, its torch
    reference elsewhere) with coins drawn from ``generator``.

    Args:
        tokens: ``int64[B, N]``; parents: ``int64[B, N]`` (-1 root, parent < child); siblings must
            be distinct and are tried in index order.
        target_probs: ``float[B, N, V]`` target distribution after each node (already
            temperature / top-k / top-p processed, e.g. by `logits_to_probs`); rows are
            renormalised here.
        generator: RNG for the coins (one uniform per node and one for the bonus).
        source: optional node sources.
        coins: optional ``float[B, N + 1]`` uniforms in [0, 1) to use instead of drawing them
            (an engine's per-request seeded generators); column N decides the bonus.
    Returns:
        `VerifyResult`. No host read.
    """
    b, n = tokens.shape
    dev = tokens.device
    probs = target_probs.float()
    probs = (probs / probs.sum(dim=-1, keepdim=True)).contiguous()
    if coins is None:
        coins = torch.rand(b, n + 1, generator=generator, device=dev)
    coins = coins.to(torch.float32).clamp(max=1.0 - 2.0 ** -24)
    first_child, next_sibling = sibling_links(parents)
    predicts = torch.zeros(b * n, dtype=torch.int32, device=dev)
    accept = torch.full((b, n), -1, dtype=torch.int32, device=dev)
    num = torch.zeros(b, dtype=torch.int32, device=dev)
    glob = torch.arange(b * n, device=dev).view(b, n)
    tree_sample(predicts, accept, num, tokens, glob, first_child, next_sibling, coins[:, :n].contiguous(),
                coins[:, n].contiguous(), probs)
    path = torch.where(accept >= 0, accept.to(torch.int64) - glob[:, :1], -1)
    on_path = torch.zeros(b, n + 1, dtype=torch.bool, device=dev).scatter_(1, torch.where(path >= 0, path, n), True)
    last = path.gather(1, num.to(torch.int64)[:, None])
    bonus = predicts.view(b, n).to(torch.int64).gather(1, last).squeeze(1)
    return _finish(on_path[:, :n], bonus, source)


Param = Union[float, int, torch.Tensor, None]


def _per_row(x: Param, b: int, dev: torch.device, dtype: torch.dtype, default: float) -> torch.Tensor:
    if x is None:
        return torch.full((b,), default, dtype=dtype, device=dev)
    if isinstance(x, torch.Tensor):
        return x.to(dev, dtype).reshape(-1).expand(b) if x.numel() == 1 else x.to(dev, dtype).reshape(b)
    return torch.full((b,), x, dtype=dtype, device=dev)


def logits_to_probs(logits: torch.Tensor, temperature: Param = 1.0, top_p: Param = None,
                    top_k: Param = None) -> torch.Tensor:
    """Target logits -> sampling distribution (temperature, then top-k, then top-p).

    Same order as SGLang's sampler (softmax(logits / T), top_k_renorm, top_p_renorm).

    Args:
        logits: ``float[B, ..., V]``.
        temperature: scalar or ``[B]``; values <= 0 mean greedy (one-hot argmax).
        top_p: scalar or ``[B]`` in (0, 1]; None or 1 disables.
        top_k: scalar or ``[B]`` int; None, <= 0 or >= V disables.
    Returns:
        ``float32[B, ..., V]`` rows summing to 1.
    """
    b, v = logits.shape[0], logits.shape[-1]
    dev = logits.device
    extra = (1,) * (logits.dim() - 1)
    t = _per_row(temperature, b, dev, torch.float32, 1.0)
    greedy = (t <= 0).reshape(b, *extra)
    x = logits.float() / t.clamp(min=1e-6).reshape(b, *extra)
    srt, order = x.sort(dim=-1, descending=True)
    probs = torch.softmax(srt, dim=-1)
    k = _per_row(top_k, b, dev, torch.int64, 0)
    k = torch.where((k <= 0) | (k > v), v, k).reshape(b, *extra)
    rank = torch.arange(v, device=dev)
    probs = torch.where(rank < k, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    tp = _per_row(top_p, b, dev, torch.float32, 1.0).reshape(b, *extra)
    before = probs.cumsum(dim=-1) - probs
    probs = torch.where((before < tp) | (rank == 0), probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(probs).scatter_(-1, order, probs)
    onehot = torch.zeros_like(out).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, onehot, out)
