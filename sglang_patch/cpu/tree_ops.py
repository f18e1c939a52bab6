"""Torch replacements of SGLang's EAGLE tree kernels (tree build, greedy tree verify).

These translate SGLang's tensor formats to and from ``graft_spec.tree`` / ``graft_spec.verify``
(parents arrays) and nothing else; the tree algorithms live in ``graft_spec``.

Replaced dispatchers (SGLang 0.5.23):

* ``kernels/ops/speculative/spec_tree.py:367`` ``build_tree_kernel_efficient_func``
  (CUDA: JIT ``tree.cuh``; Triton twin ``spec_tree.py:52``).
* ``kernels/ops/speculative/spec_tree.py:480`` ``verify_tree_greedy_func``
  (Triton twin ``spec_tree.py:218``).
"""

from __future__ import annotations

import torch

from graft_spec.pipeline import ancestor_mask, chain_links, greedy_verify, node_depths, parents_from_mask, sibling_links
from sglang_patch.tree_mask import FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING, write_tree_mask  # noqa: F401


def eagle_parents(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int) -> torch.Tensor:
    """Parents array of the verify tree that SGLang's EAGLE draft selected.

    Node 0 is the root (the bonus token); node ``j >= 1`` is the draft candidate with global index
    ``g = top_scores_index[b, j - 1]``. Its parent is the root when ``g // topk == 0``, else the
    selected node whose global index is ``parent_list[b, g // topk]`` (SGLang's parent rule,
    ``eagle.cuh`` build_tree_efficient / ``spec_tree.py:101-125``).

    A node whose parent was not selected (possible only with exactly tied draft scores) is hung
    under the root here; SGLang's kernel gives it the same mask row and position (root + itself)
    but no link. Verification stays exact either way, because the target scores the node as a
    child of the root.

    Args:
        parent_list: ``int64[B, 1 + topk * (steps - 1)]`` global index of every step's frontier
            (``organize_draft_results``, eagle_utils.py:100); may have width 0 when steps == 1.
        top_scores_index: ``int64[B, N - 1]`` selected global indices, sorted increasing.
        topk: draft top-k.
    Returns:
        ``int64[B, N]`` parents (-1 for the root, parent < child).
    """
    bs, m = top_scores_index.shape
    device = top_scores_index.device
    sel = top_scores_index.to(torch.int64)
    tb = torch.div(sel, topk, rounding_mode="floor")
    if parent_list.numel() == 0:
        parent_global = torch.full_like(sel, -1)
    else:
        plist = parent_list.reshape(bs, -1).to(torch.int64)
        parent_global = plist.gather(1, tb.clamp(max=plist.shape[1] - 1))
    parent_global = torch.where(tb == 0, -1, parent_global)
    # Node index of the parent: 1 + position of parent_global in sel (0 = root, not found = root).
    hit = sel[:, None, :] == parent_global[:, :, None]  # [B, child, candidate]
    found = hit.any(dim=2)
    node = hit.to(torch.int64).argmax(dim=2) + 1
    parents = torch.where(found, node, torch.zeros_like(node))
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
    return torch.cat([root, parents], dim=1) if m > 0 else root


def build_tree_kernel_efficient_func(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: int,
) -> None:
    """Torch ``build_tree_kernel_efficient_func`` (spec_tree.py:367): fills the verify tree.

    Writes, in place: ``tree_mask`` (layout per ``tree_mask_mode``, see `write_tree_mask`),
    ``positions`` ``int64[B * N]`` = seq_len + depth, ``retrieve_index`` ``[B, N]`` = b * N + i,
    ``retrieve_next_token`` / ``retrieve_next_sibling`` ``[B, N]`` (first child / next sibling by
    increasing index, -1 terminated). ``spec_steps`` is implied by the parents and unused.
    """
    del spec_steps
    bs = seq_lens.shape[0]
    n = num_verify_tokens
    device = seq_lens.device
    parents = eagle_parents(parent_list, top_scores_index, topk)
    positions.view(bs, n).copy_(seq_lens.to(torch.int64)[:, None] + node_depths(parents))
    retrieve_index.copy_(torch.arange(bs * n, device=device, dtype=torch.int64).view(bs, n))
    first_child, next_sibling = sibling_links(parents)
    retrieve_next_token.copy_(first_child)
    retrieve_next_sibling.copy_(next_sibling)
    write_tree_mask(tree_mask, ancestor_mask(parents), seq_lens, int(tree_mask_mode))


def parents_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Parents array from SGLang's first-child / next-sibling links (inverse of ``sibling_links``).

    Args:
        next_token: ``int64[B, N]`` first child of every node, -1 if none.
        next_sibling: ``int64[B, N]`` next sibling of every node, -1 if none.
    Returns:
        ``int64[B, N]``, -1 for the root.
    Raises:
        ValueError: a non-root node is not reachable from the root through the links (SGLang's tree
            builders, and ours, never produce one; verifying such a node would be unsound).
    """
    parents = chain_links(next_token, next_sibling)[0]
    if bool((parents[:, 1:] < 0).any()):
        raise ValueError("verify tree has nodes that are not reachable from the root")
    return parents


def verify_tree_greedy_func(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    topk: int = -1,
):
    """Torch ``verify_tree_greedy_func`` (spec_tree.py:480): greedy longest accepted path.

    From the root, at each level the first child (sibling order) whose token equals the target's
    argmax at the current node is accepted, for at most ``accept_index.shape[1] - 1`` levels.

    Args (SGLang's, all ``[B, N]`` unless noted):
        predicts: ``int32[B * N]`` (mutable): receives the target token at every accepted node
            (the next accepted token, or the bonus at the last one).
        accept_index: ``int32[B, D]`` (mutable): global indices (``retrieve_index``) of the
            accepted path, root first, -1 padded.
        accept_token_num: ``int32[B]`` (mutable): number of accepted draft tokens (bonus excluded).
        candidates: draft tokens (node 0 = root); target_predict: target argmax per node.
        retrieve_index / retrieve_next_token / retrieve_next_sibling: tree links.
        topk: unused (kept for the dispatcher's signature).
    Returns:
        ``(predicts, accept_index, accept_token_num)``, the same tensors.
    """
    del topk
    depth_cap = accept_index.shape[1]
    if candidates.shape[1] == 1:  # a root-only tree (a plain decode round): the target's token is the bonus
        glob = retrieve_index[:, 0].to(torch.int64)
        accept_index.fill_(-1)
        accept_index[:, 0] = glob.to(accept_index.dtype)
        accept_token_num.zero_()
        predicts.view(-1)[glob] = target_predict[:, 0].to(predicts.dtype)
        return predicts, accept_index, accept_token_num
    parents = parents_from_links(retrieve_next_token, retrieve_next_sibling)
    result = greedy_verify(candidates.to(torch.int64), parents, target_predict.to(torch.int64))
    path = result.accept_index
    path_tokens = target_predict.to(torch.int64).gather(1, path.clamp(min=0))
    write_accepted_path(path, path_tokens, predicts, accept_index, accept_token_num, retrieve_index, depth_cap)
    return predicts, accept_index, accept_token_num


def write_accepted_path(
    path: torch.Tensor,
    path_tokens: torch.Tensor,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    retrieve_index: torch.Tensor,
    depth_cap: int,
) -> None:
    """Write an accepted node path into SGLang's verify outputs (``predicts``, ``accept_index``,
    ``accept_token_num``; layouts as in `verify_tree_greedy_func`).

    Args:
        path: ``int64[B, L]`` accepted tree-node indices, root first, -1 padded.
        path_tokens: ``int64[B, L]``: the token committed after each path node (the next path
            node's token, and the bonus after the last one); entries past the path are ignored.
        depth_cap: width of SGLang's ``accept_index`` (``max_tree_depth``); a longer path is cut,
            which keeps a valid bonus because ``path_tokens`` after a cut node is the next
            accepted token (a target sample, or the target argmax).
    """
    bs, n = retrieve_index.shape
    width = min(depth_cap, path.shape[1])
    path, path_tokens = path[:, :width], path_tokens[:, :width]
    if width < depth_cap:
        pad = torch.full((bs, depth_cap - width), -1, dtype=path.dtype, device=path.device)
        path = torch.cat([path, pad], dim=1)
        path_tokens = torch.cat([path_tokens, pad.to(path_tokens.dtype)], dim=1)
    valid = path >= 0
    glob = retrieve_index.to(torch.int64).gather(1, path.clamp(min=0))
    accept_index.copy_(torch.where(valid, glob, torch.full_like(glob, -1)).to(accept_index.dtype))
    accept_token_num.copy_((valid.sum(dim=1) - 1).to(accept_token_num.dtype))
    flat = predicts.view(-1)
    flat[glob[valid]] = path_tokens[valid].to(flat.dtype)


def reconstruct_indices_from_tree_mask_func(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Torch ``reconstruct_indices_from_tree_mask_func`` (kernels/ops/speculative/reconstruct_tree.py:163),
    used by the NGRAM worker (ngram_worker.py:342) to get verify metadata from the corpus's mask.

    Writes, in place: ``positions`` ``int64[B * N]`` = seq_len + number of strict ancestors,
    ``retrieve_index`` ``[B, N]`` = b * N + i, and the first-child / next-sibling links of the tree
    whose parent is the nearest strict ancestor (``graft_spec.tree.parents_from_mask``).

    Args:
        tree_mask: flat bool ``[B * N * N]`` (QLEN layout), row i True at i and its ancestors.
        verified_seq_len: ``int[B]``.
    """
    bs, n = batch_size, draft_token_num
    mask = tree_mask[: bs * n * n].view(bs, n, n).to(torch.bool)
    strict = mask & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril(-1)
    positions[: bs * n].copy_((verified_seq_len[:bs].to(torch.int64)[:, None] + strict.sum(dim=2)).reshape(-1))
    retrieve_index[:bs].copy_(torch.arange(bs * n, device=mask.device, dtype=torch.int64).view(bs, n))
    parents = parents_from_mask(mask)
    first_child, next_sibling = sibling_links(parents)
    retrieve_next_token[:bs].copy_(first_child)
    retrieve_next_sibling[:bs].copy_(next_sibling)
