"""Sampled tree verify in SGLang by graft's own kernel: no zero draft-probability tensor.

SGLang's ``eagle_sample`` (``srt/speculative/eagle_utils.py:521``) verifies sampled requests with
``tree_speculative_sampling_target_only`` and hands it ``draft_probs = torch.zeros_like(target_probs)``
(``:744-748``), a ``float32[B, N, V]`` tensor as large as the target probabilities (1.75 GB at batch
48, N 60 and Qwen3's vocabulary) that the CUDA kernel only writes the rejected children's mass into.
Graft's kernel (``graft_spec/kernels/tree_sample.py``) zeroes the tried children of the last node
instead, so while graft verifies (`graft_sampling`):

* ``eagle_utils.tree_speculative_sampling_target_only`` is `tree_speculative_sampling_target_only`
  below (the fused kernel on a CUDA device, its torch reference elsewhere), driven by SGLang's
  coins, so ``sampling_seed`` keeps its meaning;
* ``eagle_utils.torch`` is `TORCH_WITH_ZERO_VIEWS`, whose ``zeros_like`` returns a stride-0 view of
  one zero (4 bytes) instead of allocating: ``eagle_sample`` calls ``zeros_like`` for nothing else.

The CPU layer (``cpu/sampling.py``) uses the same function for every algorithm on a device whose
SGLang build has no tree sampling kernel.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

from graft_spec.pipeline import tree_sample
from sglang_patch.rebinding import rebound

EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """SGLang's ``tree_speculative_sampling_target_only`` (kernels/ops/speculative/sampling.py:33) by
    ``graft::tree_sample``: writes ``predicts`` ``int32[B * N]``, ``accept_index`` ``int32[B, D]`` and
    ``accept_token_num`` ``int32[B]`` in place (layouts in `graft_spec.kernels.tree_sample.tree_sample_reference`).

    Args (SGLang's names): ``candidates`` and the ``retrive_*`` links ``[B, N]``; ``uniform_samples``
    ``float32[B, N]`` (one coin per node) and ``uniform_samples_for_final_sampling`` ``float32[B]``;
    ``target_probs`` ``float32[B, N, V]``; ``draft_probs`` is not read (target-only: may be a
    stride-0 view); ``deterministic`` has no effect (the result is a function of the coins).
    Raises:
        ValueError: thresholds other than 1.0 (lossy by design; graft refuses them at startup too,
            ``sglang_patch/args.py``).
    """
    del draft_probs, deterministic
    if threshold_single != 1.0 or threshold_acc != 1.0:
        raise ValueError("graft tree sampling is lossless only: speculative accept thresholds must be 1.0")
    tree_sample(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs)


class _TorchWithZeroViews:
    """``torch`` for ``eagle_utils`` while graft verifies: every attribute is torch's, except
    ``zeros_like``, which returns a read-only-in-practice stride-0 view of one zero element."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros_like(t: torch.Tensor, *, dtype=None, device=None, **_: object) -> torch.Tensor:
        one = torch.zeros((), dtype=dtype or t.dtype, device=device or t.device)
        return one.expand(t.shape)


#: The module object bound as ``eagle_utils.torch`` during graft's verify.
TORCH_WITH_ZERO_VIEWS = _TorchWithZeroViews()


@contextlib.contextmanager
def graft_sampling() -> Iterator[None]:
    """For the duration of a graft verify: ``eagle_utils``' tree sampling function and its
    ``torch.zeros_like`` as in the module docstring; both restored afterwards (also on error)."""
    module = sys.modules[EAGLE_UTILS]
    with rebound(module, "tree_speculative_sampling_target_only", tree_speculative_sampling_target_only), \
            rebound(module, "torch", TORCH_WITH_ZERO_VIEWS):
        yield
