"""`GraftProposer`: vLLM 0.33's EAGLE-3 proposer, plus prune + retrieve + graft, emitting chains.

Per decode step (V1 runner, ``disable_padded_drafter_batch=True``, see config_patch.py):

1. vLLM's own EAGLE-3 loop runs unchanged (`SpecDecodeBaseProposer.propose`,
   llm_base_proposer.py:511-773: draft KV cache, aux hidden states, K passes). The
   `_greedy_sample` override (llm_base_proposer.py:437) hands each pass's logits to
   `ChainStep.record`, which keeps the top-k siblings and returns the top-1 token the
   loop continues with.
2. `ChainStep.finish` observes last step's tree against the committed tokens, syncs
   per-request state with ``runner.input_batch`` (requests still held in ``runner.requests``
   but left out of this step stay alive; greedy vs sampled from ``input_batch.greedy_reqs``),
   builds the spine tree, calls graft_spec's prune + retrieve + graft, and picks the best
   chain (expected accepted length) of at most K tokens per request.
3. The chains are returned as ``list[list[int]]``, which the runner passes on like the
   ngram/suffix drafts (gpu_model_runner.py:4636-4638; async scheduling is off).

Lossless: every chain is a deterministic function of the context, verified by vLLM's
rejection sampler with ``draft_probs=None`` (one-hot q, rejection_sampler.py:896-967).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from .config_patch import graft_config_of
from .step import ChainStep
from .tree_sampler import request_chain_reason

__all__ = ["GraftProposer"]


class GraftProposer(EagleProposer):
    """EAGLE-3 proposer whose drafts are Graft's best chains (see module docstring).

    Args:
        vllm_config: engine config whose ``speculative_config`` came from ``method="graft"``.
        device: drafter device.
        runner: the V1 model runner; kept to read ``runner.input_batch`` (the base class
            drops it, llm_base_proposer.py:73-80).
    Raises:
        ValueError: the speculative config is not a graft config.
    """

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None, trees: bool = False):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        self.graft = ChainStep(graft_config_of(self.speculative_config),
                               vllm_config.model_config.get_vocab_size(), trees=trees)
        #: ``int64[B, W]`` accepted tree paths of the step just verified (tree_runner.py), or None
        self.tree_paths: Optional[torch.Tensor] = None

    def prepare_inputs(self, common_attn_metadata: Any, sampled_token_ids: list, num_draft_tokens: list
                       ) -> tuple[Any, torch.Tensor]:
        """``SpecDecodeBaseProposer.prepare_inputs`` (llm_base_proposer.py:1157), with a verified
        tree's rows: the drafter reads the target's token, position and hidden state at each
        accepted node (its tree index), and writes its KV at the chain's slots (vLLM's slot mapping
        of the kept rows, unchanged), where `tree_attention.compact` moved the target's."""
        meta, token_indices = super().prepare_inputs(common_attn_metadata, sampled_token_ids, num_draft_tokens)
        paths, self.tree_paths = self.tree_paths, None
        if paths is None:
            return meta, token_indices
        old = common_attn_metadata.query_start_loc_cpu.tolist()
        new = meta.query_start_loc_cpu.tolist()
        idx = token_indices.clone()
        for i, n in enumerate(num_draft_tokens):
            keep = new[i + 1] - new[i]
            if n > 0 and keep > 0:
                idx[new[i]:new[i + 1]] = old[i] + paths[i, :keep].to(idx.device, idx.dtype)
        return meta, idx

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft pass hook: ``[B, H]`` hidden states -> ``int64[B]`` top-1 tokens (recorded)."""
        return self.graft.record(self.model.compute_logits(hidden_states))

    def propose(self, num_speculative_tokens: int, target_token_ids: torch.Tensor,
                target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                next_token_ids: torch.Tensor, *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM's EAGLE-3 draft loop, then Graft's chain per request.

        Arguments are those of `SpecDecodeBaseProposer.propose` (llm_base_proposer.py:511-526);
        ``next_token_ids`` ``[B]`` are the tree roots.
        Returns:
            one chain (``list[int]``, at most ``num_speculative_tokens``) per row of
            ``runner.input_batch``.
        """
        self.graft.begin()
        if self.graft.trees:   # N - 1 nodes are scheduled; the EAGLE-3 head drafts K = depth levels
            num_speculative_tokens = self.graft.config.depth
        super().propose(num_speculative_tokens, target_token_ids, target_positions,
                        target_hidden_states, next_token_ids, *args, **kwargs)
        batch = self.runner.input_batch
        b = next_token_ids.shape[0]
        rids = batch.req_ids[:b]
        greedy = getattr(batch, "greedy_reqs", None)   # gpu_input_batch.py:202, filled at :398-402
        sampled = [rid not in greedy for rid in rids] if greedy is not None else None
        chain_rows = None
        if self.graft.trees:   # requests whose sampling vLLM processes per chain position get a chain
            reqs = getattr(self.runner, "requests", {}) or {}
            chain_rows = {i for i, rid in enumerate(rids)
                          if request_chain_reason(getattr(reqs.get(rid), "sampling_params", None))}
        return self.graft.finish(next_token_ids, rids, batch.token_ids_cpu[:b],
                                 batch.num_prompt_tokens[:b], batch.num_tokens_no_spec[:b],
                                 num_speculative_tokens, alive=getattr(self.runner, "requests", None),
                                 sampled=sampled, chain_rows=chain_rows)
