"""The tensors graft hands to SGLang's verify step: a hybrid tree as an ``EagleVerifyInput``.

Translation only (STYLE.md): the tree itself (tokens, parents, sources) comes from
``graft_spec.pipeline.GraftPlanner.build``; this module lays it out the way SGLang's EAGLE verify
path reads it (``eagle_worker_common.py:377`` build_eagle_verify_input, ``eagle_utils.py:138``
build_tree_kernel_efficient):

* ``draft_token``  ``int64[B * N]``, node 0 of every request is the root (last round's bonus);
* ``custom_mask``  the ancestor mask in the backend's layout (FULL_MASK: per request ``N`` rows of
  ``seq_len + N`` columns with the prefix True; QLEN_ONLY: ``B * N * N``);
* ``positions``    ``int64[B * N]`` = seq_len + depth;
* ``retrieve_index`` ``[B, N]`` = b * N + i; ``retrieve_next_token`` / ``retrieve_next_sibling``
  ``[B, N]`` first child / next sibling by increasing index, -1 terminated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_utils import TreeMaskMode

from graft_spec.tree import DraftTree, ancestor_mask, node_depths, sibling_links
from sglang_patch.tree_mask import write_tree_mask

__all__ = ["GraftVerifyInput", "split_eagle_lists", "tree_mask_numel", "write_tree_mask",
           "build_graft_verify_input"]


@dataclass
class GraftVerifyInput(EagleVerifyInput):
    """``EagleVerifyInput`` of a hybrid tree.

    Extra attributes:
        node_source: ``int64[B, N]`` graft_spec ``SOURCE_*`` tag of every node (accounting).
        tree_depth: deepest node depth of the batch (host int).

    ``max_tree_depth`` (the width of ``accept_index``, ``eagle_utils.py:633``) is N, like NGRAM's
    irregular trees (``ngram_info.py``): grafted paths may be deeper than ``spec_steps + 1``.
    ``tree_topk`` is -1 (irregular tree) for the verify kernels; ``topk`` stays the server's
    draft top-k (> 1), which keeps the attention backends on their tree-mask path.
    """

    node_source: Optional[torch.Tensor] = None
    tree_depth: int = 0

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num

    @property
    def tree_topk(self) -> int:
        return -1


def split_eagle_lists(scores: torch.Tensor, tokens: torch.Tensor, parent_list: torch.Tensor,
                      topk: int, steps: int):
    """Per-step lists (SGLang ``select_top_k_tokens`` layout) from flat captured tensors.

    Args:
        scores: ``float[B, S]`` cumulative draft probabilities, S = topk + (steps-1) * topk**2.
        tokens: ``int64[B, S]``.
        parent_list: ``int64[B, 1 + topk * (steps - 1)]`` (``organize_draft_results`` output).
        topk, steps: draft shape.
    Returns:
        ``(scores_per_step, tokens_per_step, parents_per_step)`` as ``graft_spec.tree.eagle_rerank``
        takes them; the last parents entry is a placeholder (never read, ``tree.py`` parent rule).
    """
    b = scores.shape[0]
    bounds = [0, topk] + [topk + i * topk * topk for i in range(1, steps)]
    sc = [scores[:, bounds[i]:bounds[i + 1]] for i in range(steps)]
    tk = [tokens[:, bounds[i]:bounds[i + 1]] for i in range(steps)]
    pbounds = [0, topk + 1] + [topk + 1 + i * topk for i in range(1, steps - 1)]
    par = [parent_list[:, pbounds[i]:pbounds[i + 1]] for i in range(steps - 1)]
    par.append(torch.empty(b, 0, dtype=torch.int64, device=scores.device))
    return sc, tk, par


def tree_mask_numel(mode: TreeMaskMode, seq_lens_cpu: Sequence[int], n: int) -> int:
    """Cells of the verify mask for a batch (FULL_MASK: sum of ``n * (seq_len + n)``)."""
    if mode == TreeMaskMode.QLEN_ONLY:
        return len(seq_lens_cpu) * n * n
    if mode == TreeMaskMode.FULL_MASK:
        return sum(n * (int(s) + n) for s in seq_lens_cpu)
    raise NotImplementedError(f"graft: tree mask mode {mode!r} is not supported")



def build_graft_verify_input(tree: DraftTree, seq_lens: torch.Tensor, seq_lens_cpu: Sequence[int], *,
                             mode: TreeMaskMode, topk: int, steps: int,
                             mask_buffer: Optional[torch.Tensor] = None,
                             fill_prefix: bool = True) -> GraftVerifyInput:
    """Lay out a hybrid tree for SGLang's verify.

    Args:
        tree: hybrid ``DraftTree`` ``[B, N]`` (``tokens[:, 0]`` = root = last bonus token).
        seq_lens: ``int[B]`` committed lengths (device), the root's position.
        seq_lens_cpu: the same on the host (FULL_MASK sizing).
        mode: the target backend's mask layout (``verify_mask.mode``, else the worker default).
        topk, steps: server draft shape (kept on the input for SGLang's bookkeeping).
        mask_buffer: the backend's preallocated ``verify_mask.buffer`` when it fits the batch.
        fill_prefix: whether the FULL_MASK prefix columns must be (re)filled with True.
    Returns:
        `GraftVerifyInput`.
    """
    b, n = tree.tokens.shape
    device = tree.tokens.device
    parents = tree.parents
    depth = node_depths(parents)
    first_child, next_sibling = sibling_links(parents)
    mask = ancestor_mask(parents)
    if mask_buffer is not None:
        custom_mask = mask_buffer
        if mode == TreeMaskMode.FULL_MASK and fill_prefix:
            custom_mask.fill_(True)
    elif mode == TreeMaskMode.FULL_MASK:
        custom_mask = torch.ones(tree_mask_numel(mode, seq_lens_cpu, n), dtype=torch.bool, device=device)
    else:
        custom_mask = torch.empty(tree_mask_numel(mode, seq_lens_cpu, n), dtype=torch.bool, device=device)
    write_tree_mask(custom_mask, mask, seq_lens, mode)
    return GraftVerifyInput(
        draft_token=tree.tokens.reshape(-1).to(torch.int64),
        custom_mask=custom_mask,
        positions=(seq_lens.to(torch.int64)[:, None] + depth).reshape(-1),
        retrieve_index=torch.arange(b * n, device=device, dtype=torch.int64).view(b, n),
        retrieve_next_token=first_child,
        retrieve_next_sibling=next_sibling,
        retrieve_cum_len=None,
        spec_steps=steps,
        topk=topk,
        draft_token_num=n,
        capture_hidden_mode=None,
        seq_lens_sum=None,
        seq_lens_cpu=None,
        node_source=tree.source,
        tree_depth=int(depth.max().item()) if b > 0 else 0,
    )
