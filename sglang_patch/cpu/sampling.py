"""Sampled (non-greedy) EAGLE verification on CPU, and the verify tree-mask layout.

On a device without CUDA, SGLang 0.5.23 resolves the verify sampling kernels to ``None``
(``kernels/ops/speculative/verify_sampling.py:31``, ``kernels/ops/sampling/renorm.py:33``), so
``eagle_sample`` (``srt/speculative/eagle_utils.py:521``) cannot take its sampling branch (and
SGLang's own CPU engine forces greedy verification instead, ``_verify_uses_greedy`` :485).
`eagle_sample_hook` supplies torch implementations for the duration of each ``eagle_sample``
call, so sampled requests are verified by target-only tree rejection sampling
(``sglang_patch/tree_sampling.py``: graft's ``graft::tree_sample`` op, whose CPU implementation is
its torch reference), which is lossless: the tree's tokens are deterministic given the draft,
siblings are distinct, and the acceptance thresholds are 1.0
(``speculative_accept_threshold_single/acc`` defaults).
"""

from __future__ import annotations

import sys

import torch

from sglang_patch.tree_sampling import tree_speculative_sampling_target_only

EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"


def qlen_only_tree_mask_mode():
    """REPLACE for ``default_tree_mask_mode`` (eagle_utils.py:132): QLEN_ONLY, the ``B*N*N``
    tree-only layout SGLang's CPU engine uses; the torch verify attention reads it (and
    FULL_MASK, which other workers may still build)."""
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    return TreeMaskMode.QLEN_ONLY


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_ks[i]`` largest probabilities (ties at the cut kept) and renormalise.

    Same contract as flashinfer's ``top_k_renorm_probs`` used by SGLang on CUDA
    (``kernels/ops/sampling/renorm.py:12``).

    Args:
        probs: ``float[R, V]``; top_ks: ``int[R]`` (values >= V or <= 0 keep the whole row).
    Returns:
        ``float[R, V]``.
    """
    v = probs.shape[-1]
    k = top_ks.to(torch.int64).reshape(-1, 1)
    k = torch.where((k <= 0) | (k > v), v, k)
    kth = probs.sort(dim=-1, descending=True).values.gather(1, k - 1)
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest most-probable prefix of each row whose mass reaches ``top_ps[i]``.

    A token is dropped when the mass of the tokens sorted before it already exceeds ``top_p``,
    the rule of SGLang's torch sampler (``srt/layers/sampler.py:1014``).

    Args:
        probs: ``float[R, V]``; top_ps: ``float[R]``.
    Returns:
        ``float[R, V]`` renormalised.
    """
    srt, idx = probs.sort(dim=-1, descending=True)
    before = torch.cumsum(srt, dim=-1) - srt
    srt = torch.where(before > top_ps.reshape(-1, 1).to(srt.dtype), torch.zeros_like(srt), srt)
    kept = torch.zeros_like(probs).scatter_(-1, idx, srt)
    return kept / kept.sum(dim=-1, keepdim=True)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Replaces ``row_argmax`` (kernels/ops/speculative/row_argmax.py:134): ``x.argmax(-1)``,
    ``int64[R]`` (used by the Gumbel draft sampler, spec_utils.py:197)."""
    return x.argmax(dim=-1)


_KERNELS = {
    "top_k_renorm_prob": top_k_renorm_prob,
    "top_p_renorm_prob": top_p_renorm_prob,
    "tree_speculative_sampling_target_only": tree_speculative_sampling_target_only,
}


def eagle_sample_hook(orig, *args, **kwargs):
    """AROUND hook on ``eagle_sample`` (eagle_utils.py:521): while it runs, the module globals it
    resolved to ``None`` on this platform point at the torch implementations above."""
    module = sys.modules[EAGLE_UTILS]
    missing = {name: fn for name, fn in _KERNELS.items() if getattr(module, name, None) is None}
    for name, fn in missing.items():
        setattr(module, name, fn)
    try:
        return orig(*args, **kwargs)
    finally:
        for name in missing:
            setattr(module, name, None)
