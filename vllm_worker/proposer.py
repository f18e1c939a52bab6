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

from typing import Any

import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from .config_patch import graft_config_of
from .step import ChainStep

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

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        self.graft = ChainStep(graft_config_of(self.speculative_config),
                               vllm_config.model_config.get_vocab_size())

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
        super().propose(num_speculative_tokens, target_token_ids, target_positions,
                        target_hidden_states, next_token_ids, *args, **kwargs)
        batch = self.runner.input_batch
        b = next_token_ids.shape[0]
        rids = batch.req_ids[:b]
        greedy = getattr(batch, "greedy_reqs", None)   # gpu_input_batch.py:202, filled at :398-402
        sampled = [rid not in greedy for rid in rids] if greedy is not None else None
        return self.graft.finish(next_token_ids, rids, batch.token_ids_cpu[:b],
                                 batch.num_prompt_tokens[:b], batch.num_tokens_no_spec[:b],
                                 num_speculative_tokens, alive=getattr(self.runner, "requests", None),
                                 sampled=sampled)
