"""`TreeSampler`: vLLM's rejection sampler, verifying graft trees where the step scheduled them.

The runner's ``rejection_sampler`` (gpu_model_runner.py:663 in 0.32, :666 in 0.33) is called once
per speculative step with the step's `SpecDecodeMetadata`, the target logits at ``logits_indices``
and the batch's `SamplingMetadata` (``GPUModelRunner._sample``). `TreeSampler` is a subclass
(so the runner's own calls and dummy runs keep working) that takes this step's trees from
`set_trees` and:

* with no trees, calls vLLM's chain sampler unchanged;
* with trees and a batch whose sampling needs nothing but temperature / top-k / top-p, verifies
  every row as a tree (`tree_verify.verify_trees`) and returns vLLM's chain-format output;
* with trees in a batch that needs penalties, bad words, allowed token ids, min-tokens, a thinking
  budget or logprobs (a request may join the batch after the trees were proposed), verifies each
  row's spine - the nodes ``1..m`` whose parent is the node before, a chain whose logits rows saw
  exactly their chain prefix - with vLLM's own sampler (its processing, its kernels), the rest of
  the tree left unverified. Every emitted token then comes from vLLM's rule for a chain.

The accepted path of the step (`last`, a `TreeVerdict`) is kept for the KV compaction and the
drafter: path node j's KV sits at slot ``P + accept_index[j]`` until it is moved to ``P + j``.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from typing import Optional

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from .tree_verify import PLACEHOLDER_TOKEN_ID, StepTrees, TreeVerdict, verify_trees

__all__ = ["TreeSampler", "chain_reason", "request_chain_reason", "spine_lengths"]


def chain_reason(sampling_metadata) -> Optional[str]:
    """Why this batch's sampling must run on chains (vLLM's processing of draft positions assumes a
    chain prefix), or None when temperature, top-k and top-p are all it needs.

    Reads ``SamplingMetadata`` (v1/sample/metadata.py): penalties, bad words, allowed token ids,
    logprobs (of sampled or given tokens), min-tokens (``MinTokensLogitsProcessor.min_toks``) and
    the thinking-budget holder, the processors ``RejectionSampler.apply_logits_processors`` runs.
    """
    md = sampling_metadata
    if not md.no_penalties:
        return "penalties"
    if md.bad_words_token_ids:
        return "bad_words"
    if md.allowed_token_ids_mask is not None:
        return "allowed_token_ids"
    if md.max_num_logprobs is not None or getattr(md, "logprob_token_ids", None):
        return "logprobs"
    for proc in getattr(md.logitsprocs, "non_argmax_invariant", ()):
        if getattr(proc, "min_toks", None):
            return "min_tokens"
    holder = getattr(md, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return "thinking_budget"
    return None


def request_chain_reason(params) -> Optional[str]:
    """Why one request must be proposed a chain (its sampling is processed per draft position with
    a chain prefix: penalties, bad words, allowed token ids, logit bias, min-tokens, logprobs, a
    thinking budget, a grammar, vLLM's ``validate_tokens`` / bitmask per position), or None.
    ``params``: its vLLM ``SamplingParams`` (or None)."""
    if params is None:
        return None
    checks = (("penalties", getattr(params, "presence_penalty", 0.0) != 0.0
               or getattr(params, "frequency_penalty", 0.0) != 0.0
               or getattr(params, "repetition_penalty", 1.0) != 1.0),
              ("bad_words", bool(getattr(params, "bad_words", None))),
              ("allowed_token_ids", getattr(params, "allowed_token_ids", None) is not None),
              ("logit_bias", bool(getattr(params, "logit_bias", None))),
              ("min_tokens", bool(getattr(params, "min_tokens", 0))),
              ("logprobs", getattr(params, "logprobs", None) is not None
               or getattr(params, "logprob_token_ids", None) is not None),
              ("thinking_budget", getattr(params, "thinking_token_budget", None) is not None),
              ("structured_outputs", getattr(params, "structured_outputs", None) is not None))
    return next((name for name, hit in checks if hit), None)


def spine_lengths(trees: StepTrees) -> torch.Tensor:
    """``int64[B]``: draft nodes ``1..m`` of each tree whose parent is the node before (the
    spine, a chain from the root), cut to the row's size."""
    parents = trees.parents.to(torch.int64)
    w = parents.shape[1]
    col = torch.arange(w, device=parents.device)
    chain = (parents == col - 1) | (col == 0)
    chain &= col[None, :] < trees.sizes.to(parents.device)[:, None]
    return torch.cummin(chain.to(torch.int64), dim=1).values.sum(1) - 1


class TreeSampler(RejectionSampler):
    """vLLM's ``RejectionSampler`` that verifies the step's trees (module docstring).

    Constructed like ``RejectionSampler`` (``sampler, spec_config, device``).

    Attributes:
        last: the last tree step's `TreeVerdict` (None after a chain step).
        last_reason: why the last tree step verified spines only (`chain_reason`), else None.
        successor_k: the target's top-k the verdict reports at every node (`TreeVerdict.target_topk`,
            graft's successor table), 0 for none.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.successor_k = 0
        self._trees: Optional[StepTrees] = None
        self.last: Optional[TreeVerdict] = None
        self.last_reason: Optional[str] = None

    def set_trees(self, trees: Optional[StepTrees]) -> None:
        """The trees of the step about to be sampled (row-aligned with the input batch), or None
        for chains; consumed by the next `forward`."""
        self._trees = trees

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                sampling_metadata) -> SamplerOutput:
        """``RejectionSampler.forward`` (rejection_sampler.py:106): same arguments and output, the
        step's trees verified as the module docstring says."""
        trees, self._trees = self._trees, None
        self.last = None
        self.last_reason = None
        if trees is None:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        sizes = torch.tensor([n + 1 for n in metadata.num_draft_tokens], dtype=torch.int64)
        width = metadata.max_spec_len + 1
        if trees.parents.shape[0] != sizes.shape[0] or trees.parents.shape[1] < width:
            raise RuntimeError(f"graft: {tuple(trees.parents.shape)} tree parents for a step of "
                               f"{sizes.shape[0]} requests and up to {width} nodes")
        trees = StepTrees(trees.parents[:, :width], sizes)
        reason = chain_reason(sampling_metadata)
        if reason is not None:
            self.last_reason = reason
            return self._spines(metadata, logits, sampling_metadata, trees)
        md = sampling_metadata
        verdict = verify_trees(logits, metadata.draft_token_ids, trees, temperature=md.temperature,
                               all_greedy=md.all_greedy, top_k=md.top_k, top_p=md.top_p,
                               generators=md.generators, top_k_top_p=apply_top_k_top_p, topk=self.successor_k)
        self.last = verdict
        return SamplerOutput(sampled_token_ids=verdict.output_token_ids, logprobs_tensors=None)

    def _spines(self, metadata: SpecDecodeMetadata, logits: torch.Tensor, sampling_metadata,
                trees: StepTrees) -> SamplerOutput:
        """vLLM's chain sampler over each tree's spine (its logits rows taken out of the step's, so
        the chain layout, logprobs included, is vLLM's own), output padded to the step's width."""
        spine = spine_lengths(trees).tolist()
        keep, target, bonus, drafts = [], [], [], []
        flat = metadata.draft_token_ids.tolist()
        start = cu_draft = 0
        for n, m in zip(metadata.num_draft_tokens, spine):
            target.extend(range(len(keep), len(keep) + m))
            bonus.append(len(keep) + m)
            keep.extend(range(start, start + m + 1))
            drafts.extend(flat[cu_draft:cu_draft + m])
            start += n + 1
            cu_draft += n
        dev = logits.device

        def dev_int32(xs):
            return torch.tensor(xs, dtype=torch.int32, device=dev)

        rows = torch.tensor(keep, dtype=torch.int64, device=dev)
        chain = SpecDecodeMetadata(
            draft_token_ids=torch.tensor(drafts, dtype=metadata.draft_token_ids.dtype, device=dev),
            num_draft_tokens=spine, cu_num_draft_tokens=dev_int32(list(accumulate(spine))),
            cu_num_sampled_tokens=dev_int32(list(accumulate(m + 1 for m in spine))),
            target_logits_indices=dev_int32(target), bonus_logits_indices=dev_int32(bonus),
            logits_indices=metadata.logits_indices[rows])
        md = sampling_metadata
        if md.spec_token_ids is not None:
            md = replace(md, spec_token_ids=[list(s[:m]) for s, m in zip(md.spec_token_ids, spine)])
        out = super().forward(chain, None, logits[rows], md)
        ids, lp = out.sampled_token_ids, out.logprobs_tensors
        b, w = ids.shape
        pad = metadata.max_spec_len + 1 - w
        if pad > 0:   # vLLM's width for the step: placeholders after, logprob rows of zeros
            ids = torch.cat([ids, ids.new_full((b, pad), PLACEHOLDER_TOKEN_ID)], 1)
            if lp is not None:
                lp = lp._replace(**{name: _pad_rows(getattr(lp, name), b, w, pad)
                                    for name in ("logprob_token_ids", "logprobs", "selected_token_ranks")})
        return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=lp)


def _pad_rows(x: torch.Tensor, b: int, w: int, pad: int) -> torch.Tensor:
    """``[b * w, ...]`` -> ``[b * (w + pad), ...]``: each request's rows followed by ``pad`` zero rows."""
    x = x.reshape(b, w, *x.shape[1:])
    return torch.cat([x, x.new_zeros(b, pad, *x.shape[2:])], 1).reshape(b * (w + pad), *x.shape[2:])
