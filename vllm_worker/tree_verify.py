"""Tree verification in vLLM's layout: a graft tree per request in, vLLM's chain-format output out.

vLLM 0.33 lays a speculative step out as chains: request i schedules its root and ``n_i`` draft
tokens, the target computes ``n_i + 1`` logits rows for them (``logits_indices``,
gpu_model_runner.py ``_calc_spec_decode_metadata``), and the rejection sampler returns
``int32[B, max_spec_len + 1]``, the emitted tokens of each row padded with ``PLACEHOLDER_TOKEN_ID``
(-1, rejection_sampler.py:38), which ``RejectionSampler.parse_output`` and the scheduler read as
"accepted tokens, then one more". A tree fits that layout when its nodes are the draft tokens in
index order (parents first) and the sampler emits the accepted path plus the bonus token:

* greedy rows: at each node the target's argmax of the raw logits (vLLM's greedy rule), the longest
  matching path from the root (`graft_spec.verify.greedy_verify`);
* sampled rows: temperature, then vLLM's own top-k / top-p (`apply_top_k_top_p`, the function its
  chain sampler uses), then target-only tree rejection sampling (`graft_spec.verify.sample_verify`):
  every emitted token is distributed as the target's processed distribution, for any tree chosen
  without the verification coins. Coins of a request with its own seed come from its generator.

The scheduler may cut a request's drafts to a prefix (scheduler.py:861-876); a prefix of a
parents-first tree is a tree, so ``sizes`` (1 + the draft tokens scheduled) is all this needs.
Batches that need penalties, bad words, allowed token ids, min-tokens or logprobs are not trees:
`TreeSampler` (tree_sampler.py) hands them to vLLM's chain sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from graft_spec.pipeline import greedy_verify, sample_verify

__all__ = ["StepTrees", "TreeVerdict", "verify_trees", "pack_rows"]

#: vLLM's padding of rejected positions in the sampler output (rejection_sampler.py:38)
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class StepTrees:
    """The trees one step verifies, row-aligned with vLLM's input batch.

    Attributes:
        parents: ``int64[B, W]`` parent index of every node (node 0 the root, -1 there); nodes are
            in parents-first order, so the first ``s`` nodes of a tree are a tree. Columns past a
            row's size are ignored.
        sizes: ``int64[B]`` nodes verified per row: 1 + the draft tokens vLLM scheduled (0 drafts:
            the root alone, a plain decode row).
    """

    parents: torch.Tensor
    sizes: torch.Tensor


@dataclass
class TreeVerdict:
    """A step's tree verification.

    Attributes:
        output_token_ids: ``int32[B, W]`` vLLM's sampler output: the accepted path's tokens after the
            root, then the bonus token, then `PLACEHOLDER_TOKEN_ID`.
        accept_index: ``int64[B, W]`` tree indices of the accepted path, root (0) first, -1 padded
            (the rows whose KV and hidden states the next step keeps).
        accept_length: ``int64[B]`` tokens emitted per row (accepted nodes + the bonus).
        target_topk: ``int64[B, W, k]`` the target's top-k tokens after every node, best first (raw
            logits, as SGLang's worker hands its successor table), -1 past a row's size; None when
            `verify_trees` was asked for none (``topk=0``).
    """

    output_token_ids: torch.Tensor
    accept_index: torch.Tensor
    accept_length: torch.Tensor
    target_topk: Optional[torch.Tensor] = None


def pack_rows(sizes: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat row index of every node: ``(rows int64[B, W], valid bool[B, W])`` where node j of
    request i sits at row ``sum(sizes[:i]) + j`` of a ``[sum(sizes), ...]`` tensor (clamped inside
    the request for the padding columns, ``valid`` False there). Device only."""
    sizes = sizes.to(torch.int64)
    start = torch.cumsum(sizes, 0) - sizes
    col = torch.arange(width, device=sizes.device)
    valid = col[None, :] < sizes[:, None]
    rows = start[:, None] + torch.minimum(col[None, :], (sizes[:, None] - 1).clamp(min=0))
    return rows, valid


def _per_row(x: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    return None if x is None else x[rows]


def verify_trees(logits: torch.Tensor, draft_token_ids: torch.Tensor, trees: StepTrees, *,
                 temperature: Optional[torch.Tensor], all_greedy: bool,
                 top_k: Optional[torch.Tensor] = None, top_p: Optional[torch.Tensor] = None,
                 generators: Optional[Mapping[int, torch.Generator]] = None,
                 top_k_top_p: Optional[Callable] = None, topk: int = 0) -> TreeVerdict:
    """Verify one tree per request from vLLM's flat logits (module docstring).

    Args:
        logits: ``float[T, V]``, T = ``sizes.sum()``: the target's logits at every node, request by
            request, node 0 (the root) first (vLLM's ``logits[logits_indices]``).
        draft_token_ids: ``int[T - B]`` the tree's tokens after each root, request by request
            (``SpecDecodeMetadata.draft_token_ids``).
        trees: the step's `StepTrees` (``W`` = the widest tree, vLLM's ``max_spec_len + 1``).
        temperature: ``float[B]``, 0 for a greedy request (vLLM's ``GREEDY_TEMPERATURE``); may be None
            when ``all_greedy``.
        all_greedy: every request is greedy (no probabilities are computed).
        top_k: ``int[B]`` or None; top_p: ``float[B]`` or None (vLLM's sampling metadata).
        generators: batch row -> the request's seeded ``torch.Generator`` (its coins come from it).
        top_k_top_p: ``(logits, k, p) -> logits`` masking function (vLLM's ``apply_top_k_top_p``);
            required when top_k or top_p is given.
        topk: the target's top-k to report at every node (`TreeVerdict.target_topk`), 0 for none.
    Returns:
        `TreeVerdict`.
    Raises:
        ValueError: the shapes disagree.
    """
    sizes = trees.sizes.to(logits.device, torch.int64)
    b = sizes.shape[0]
    width = trees.parents.shape[1]
    if logits.dim() != 2 or draft_token_ids.dim() != 1 or logits.shape[0] != draft_token_ids.shape[0] + b:
        raise ValueError(f"verify_trees: logits {tuple(logits.shape)} and draft tokens "
                         f"{tuple(draft_token_ids.shape)} do not make {b} trees")
    dev = logits.device
    rows, valid = pack_rows(sizes, width)
    # node j >= 1 of request i is draft token sum(sizes[:i] - 1) + j - 1; the root's token is not compared
    drafts = torch.cat([draft_token_ids.to(dev, torch.int64), draft_token_ids.new_full((1,), -1).to(dev, torch.int64)])
    draft_row = (rows - torch.arange(b, device=dev)[:, None] - 1).clamp(min=0)
    tokens = torch.where(valid & (torch.arange(width, device=dev) > 0), drafts[draft_row], -1)
    parents = torch.where(valid, trees.parents.to(dev, torch.int64), -1)   # padding: unreachable roots
    target = torch.where(valid, logits.argmax(dim=-1)[rows], -1)
    target_topk = None
    if topk > 0:
        target_topk = torch.where(valid[:, :, None], logits.topk(topk, dim=-1).indices[rows], -1)
    greedy = greedy_verify(tokens, parents, target)
    if all_greedy:
        return _verdict(tokens, greedy.accept_index, greedy.accept_length, greedy.bonus, target_topk)
    t = temperature.to(dev, torch.float32)
    x = logits.float() / torch.where(t == 0, 1.0, t).repeat_interleave(sizes, output_size=logits.shape[0])[:, None]
    if top_k is not None or top_p is not None:
        if top_k_top_p is None:
            raise ValueError("verify_trees: top_k / top_p given without a top_k_top_p function")
        flat = torch.arange(b, device=dev).repeat_interleave(sizes, output_size=logits.shape[0])
        x = top_k_top_p(x, _per_row(top_k, flat), _per_row(top_p, flat))
    probs = torch.softmax(x, dim=-1)[rows]                                  # [B, W, V]
    coins = torch.rand(b, width + 1, device=dev)
    for row, gen in (generators or {}).items():
        coins[row] = torch.rand(width + 1, generator=gen, device=dev)
    sampled = sample_verify(tokens, parents, probs, coins=coins)
    is_greedy = (t == 0)[:, None]
    accept_index = torch.where(is_greedy, greedy.accept_index, sampled.accept_index)
    accept_length = torch.where(is_greedy[:, 0], greedy.accept_length, sampled.accept_length)
    bonus = torch.where(is_greedy[:, 0], greedy.bonus, sampled.bonus)
    return _verdict(tokens, accept_index, accept_length, bonus, target_topk)


def _verdict(tokens: torch.Tensor, accept_index: torch.Tensor, accept_length: torch.Tensor, bonus: torch.Tensor,
             target_topk: Optional[torch.Tensor]) -> TreeVerdict:
    """Chain-format output: path tokens after the root, then the bonus, then the placeholder."""
    w = tokens.shape[1]
    col = torch.arange(w, device=tokens.device)
    path = tokens.gather(1, torch.cat([accept_index[:, 1:], accept_index[:, :1]], 1).clamp(min=0))
    out = torch.where(col[None, :] < (accept_length - 1)[:, None], path, PLACEHOLDER_TOKEN_ID)
    out = torch.where(col[None, :] == (accept_length - 1)[:, None], bonus[:, None], out)
    return TreeVerdict(out.to(torch.int32), accept_index, accept_length, target_topk)
