"""The tensors graft hands to SGLang's verify step: a hybrid tree as an ``EagleVerifyInput``.

Translation only (STYLE.md): the tree and its verify arrays come from the device graft step
(``graft_spec.pipeline.GraftPlanner.build``); this module lays them out the way SGLang's EAGLE verify
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
from typing import Optional

import torch
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_utils import TreeMaskMode

from graft_spec.pipeline import StepOutput
from sglang_patch.tree_mask import write_tree_mask, write_verify_mask

__all__ = ["GraftVerifyInput", "tree_mask_numel", "write_tree_mask", "build_graft_verify_input"]


@dataclass
class GraftVerifyInput(EagleVerifyInput):
    """``EagleVerifyInput`` of a hybrid tree.

    Extra attributes:
        node_source: ``int64[B, N]`` graft_spec ``SOURCE_*`` tag of every node (accounting).
        graft_out: the ``graft_spec.step.StepOutput`` the input was laid out from (member bins and
            estimates for the calibration update after verify).

    ``max_tree_depth`` (the width of ``accept_index``, ``eagle_utils.py:633``) is N, like NGRAM's
    irregular trees (``ngram_info.py``): grafted paths may be deeper than ``spec_steps + 1``.
    ``tree_topk`` is -1 (irregular tree) for the verify kernels; ``topk`` stays the server's
    draft top-k (> 1), which keeps the attention backends on their tree-mask path.
    """

    node_source: Optional[torch.Tensor] = None
    graft_out: Optional[StepOutput] = None

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num

    @property
    def tree_topk(self) -> int:
        return -1


def tree_mask_numel(mode: TreeMaskMode, bs: int, n: int, seq_lens_sum: int = 0) -> int:
    """Cells of the verify mask for a batch (FULL_MASK: ``n * (seq_len + n)`` summed over requests).

    Raises:
        NotImplementedError: a layout no SGLang 0.5.23 backend reads from this path (bit packing).
    """
    if mode == TreeMaskMode.QLEN_ONLY:
        return bs * n * n
    if mode == TreeMaskMode.FULL_MASK:
        return n * int(seq_lens_sum) + bs * n * n
    raise NotImplementedError(f"graft: tree mask mode {mode!r} is not supported")


def build_graft_verify_input(out: StepOutput, seq_lens: torch.Tensor, *, mode: TreeMaskMode, topk: int,
                             steps: int, mask_buffer: Optional[torch.Tensor] = None, fill_prefix: bool = True,
                             full_mask_numel: Optional[int] = None) -> GraftVerifyInput:
    """Lay out one round's hybrid tree for SGLang's verify (no host read).

    Args:
        out: the round's ``graft_spec.step.StepOutput`` (tree ``[B, N]``, positions, mask, links).
        seq_lens: ``int[B]`` committed lengths (device), the root's position.
        mode: the target backend's mask layout (``verify_mask.mode``, else the worker default).
        topk, steps: server draft shape (kept on the input for SGLang's bookkeeping).
        mask_buffer: the backend's preallocated ``verify_mask.buffer`` when it fits the batch.
        fill_prefix: whether the FULL_MASK prefix columns must be (re)filled with True.
        full_mask_numel: cells of a FULL_MASK allocated here (no buffer): ``tree_mask_numel`` from the
            host's ``seq_lens_sum`` when SGLang keeps it, else an upper bound (over-size is safe, as in
            ``eagle_worker_common.py:417``).
    Returns:
        `GraftVerifyInput` (``graft_out`` = ``out``, for the round's bookkeeping after verify).
    """
    tree = out.tree
    b, n = tree.tokens.shape
    device = tree.tokens.device
    if mask_buffer is not None:
        custom_mask = mask_buffer
    elif mode == TreeMaskMode.FULL_MASK:
        custom_mask, fill_prefix = torch.empty(full_mask_numel, dtype=torch.bool, device=device), True
    else:
        custom_mask = torch.empty(tree_mask_numel(mode, b, n), dtype=torch.bool, device=device)
    # one launch on a GPU: the requests' prefix cells (FULL_MASK) and tree cells (tree_mask.py)
    write_verify_mask(custom_mask, out.mask, seq_lens, int(mode), fill_prefix and mode == TreeMaskMode.FULL_MASK)
    return GraftVerifyInput(
        draft_token=tree.tokens.reshape(-1),
        custom_mask=custom_mask,
        positions=out.positions.reshape(-1),
        retrieve_index=torch.arange(b * n, device=device, dtype=torch.int64).view(b, n),
        retrieve_next_token=out.first_child,
        retrieve_next_sibling=out.next_sibling,
        retrieve_cum_len=None,
        spec_steps=steps,
        topk=topk,
        draft_token_num=n,
        capture_hidden_mode=None,
        seq_lens_sum=None,
        seq_lens_cpu=None,
        node_source=tree.source,
        graft_out=out,
    )
