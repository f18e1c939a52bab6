"""The V1 runner's side of tree verification: positions by depth, the step's trees, KV compaction.

vLLM's scheduler only counts tokens: a request whose drafts are a tree's nodes (parents first, node 0
the root) gets ``1 + n`` query tokens at slots ``P .. P + n`` (P = its computed tokens), which is
where the nodes' keys and values are written. `install` wraps two methods of one runner instance
(gpu_model_runner.py, 0.32 line numbers), and ``load_model`` (after it, every attention layer must run
graft's tree attention, `attention_refusal`):

* ``_prepare_inputs`` (:1920): after vLLM's, a tree row's RoPE positions become ``P + depth(j)``
  (slots and input ids stay by index; the drafter reads the same positions, :4964), and the step's
  trees are handed to the attention (`tree_step.set_step`) and the sampler
  (`TreeSampler.set_trees`; chains among them are trees too);
* ``_sample`` (:3437): the target forward is over, so the attention step is cleared (the drafter's
  layers attend as vLLM does), the sampler verifies, and each accepted path's KV moves from the slots
  of its tree indices to the chain's (the backend's `compact`) before anything reads it; the verdict
  (verified sizes, the target's top-k at every node) goes to the planner (`ChainStep.verified`), whose
  calibration and successor table then see the whole tree's outcome.

The drafter's inputs follow the accepted path through `GraftProposer.prepare_inputs`.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from graft_spec.pipeline import node_depths

from .tree_step import TreeStep, set_step
from .tree_sampler import TreeSampler
from .tree_verify import StepTrees

__all__ = ["attention_refusal", "install", "plan_trees", "proposal_prefixes", "refusal"]

logger = logging.getLogger("vllm.graft")
#: tree steps between two log lines of the runner's tree counters
LOG_EVERY = 50


def proposal_prefixes(req_ids: list, scheduled: dict, proposed) -> dict:
    """``{row: parents list}`` of the rows whose scheduled draft tokens are a non-empty prefix of the
    tree last proposed for them (chains included): node j of such a row is column j of its proposal.

    Args:
        req_ids: the input batch's request ids, by row.
        scheduled: request id -> the draft tokens vLLM scheduled (``scheduled_spec_decode_tokens``).
        proposed: request id -> ``(tokens, parents)`` of the tree last proposed for it, or None.
    """
    rows = {}
    for i, rid in enumerate(req_ids):
        drafts = list(scheduled.get(rid) or ())
        n = len(drafts)
        tree = proposed(rid) if n else None
        if tree is not None and len(tree[1]) >= n + 1 and list(tree[0][:n]) == drafts:
            rows[i] = list(tree[1][: n + 1])
    return rows


def plan_trees(prefixes: dict) -> dict:
    """``{row: parents list}`` of this step's tree rows (not chains), from `proposal_prefixes`.

    A row whose scheduled tokens are not a prefix of its last proposal is verified as a chain: the
    attention, the positions and the sampler all follow this plan, so a chain of tree tokens is
    still verified exactly (only less of it is accepted).
    """
    return {i: p for i, p in prefixes.items() if any(p[j] != j - 1 for j in range(1, len(p)))}


def refusal(vllm_config) -> Optional[str]:
    """Why tree verification cannot run with this engine config, or None: pipeline or tensor
    parallelism (not exercised: every rank must verify the same trees), M-RoPE, sliding-window,
    MLA, hybrid or attention-free models, a quantized KV cache (the tree attention reads the cache
    back), or a device other than the CPU and CUDA (tree attention exists for those two)."""
    from vllm.platforms import current_platform

    model, par, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    checks = (("a device other than the CPU and CUDA", not (current_platform.is_cpu() or current_platform.is_cuda())),
              ("pipeline parallelism", par.pipeline_parallel_size > 1),
              ("tensor parallelism", par.tensor_parallel_size > 1),
              ("M-RoPE", bool(getattr(model, "uses_mrope", False))),
              ("a sliding window", model.get_sliding_window() is not None),
              ("MLA", bool(getattr(model, "use_mla", False))),
              ("a hybrid model", bool(getattr(model, "is_hybrid", False))),
              ("an attention-free model", bool(getattr(model, "is_attention_free", False))),
              (f"kv_cache_dtype={cache.cache_dtype}", str(cache.cache_dtype) != "auto"))
    why = [name for name, hit in checks if hit]
    return ", ".join(why) if why else None


def attention_refusal(vllm_config) -> Optional[str]:
    """Why the loaded model's attention cannot verify trees, or None: every attention layer
    (``compilation_config.static_forward_context``) must run graft's tree attention (an implementation
    marked ``graft_tree``: vLLM's CPU or FlashAttention backend under graft's registration); another
    backend (FlashInfer, Triton, ...) is named."""
    context = vllm_config.compilation_config.static_forward_context
    other = sorted({type(layer.impl).__name__ for layer in context.values()
                    if getattr(layer, "impl", None) is not None and not getattr(layer.impl, "graft_tree", False)})
    return f"the attention backend {', '.join(other)}" if other else None


def install(runner, proposer, compact: Callable) -> None:
    """Tree verification on one V1 runner (module docstring): its ``rejection_sampler`` becomes a
    `TreeSampler`, ``_prepare_inputs``, ``_sample`` and ``load_model`` are wrapped on the instance;
    ``compact`` is the attention backend's KV compaction (`tree_attention.compact` on CPU,
    `tree_attention_gpu.compact` on CUDA).

    Raises:
        RuntimeError: the engine config is one `refusal` names (at startup, naming the cause).
    """
    why = refusal(runner.vllm_config)
    if why is not None:
        raise RuntimeError(f"graft: tree verification does not support {why}; "
                           "set GRAFT_VLLM_VERIFY=chain to verify one chain per request")
    old = runner.rejection_sampler
    sampler = TreeSampler(old.sampler, runner.speculative_config, runner.device)
    sampler.successor_k = proposer.graft.planner.successor_k
    runner.rejection_sampler = sampler
    prepare, sample, load_model = runner._prepare_inputs, runner._sample, runner.load_model
    state: dict = {"step": None, "prefixes": {}, "req_ids": []}
    counts = runner.graft_tree_counts = {"tree_steps": 0, "spine_steps": 0, "tree_rows": 0, "moved": 0,
                                          "observed_rows": 0}

    def _prepare_inputs(scheduler_output, num_scheduled_tokens):
        out = prepare(scheduler_output, num_scheduled_tokens)
        batch = runner.input_batch
        req_ids = list(batch.req_ids[: batch.num_reqs])
        prefixes = proposal_prefixes(req_ids, scheduler_output.scheduled_spec_decode_tokens,
                                     proposer.graft.proposed_tree)
        rows = plan_trees(prefixes)
        state.update(step=None, prefixes=prefixes, req_ids=req_ids)
        if not rows:
            set_step(None)
            sampler.set_trees(None)
            return out
        qsl = runner.query_start_loc.np
        for i, p in rows.items():
            depth = node_depths(torch.tensor([p], dtype=torch.int64))[0]
            start = int(qsl[i])
            base = int(batch.num_computed_tokens_cpu[i])
            runner.positions[start:start + len(p)] = (base + depth).to(runner.positions.device,
                                                                        runner.positions.dtype)
        spec = out[1]
        b = batch.num_reqs
        width = max(spec.num_draft_tokens) + 1
        parents = torch.arange(-1, width - 1, dtype=torch.int64).repeat(b, 1)   # chains elsewhere
        for i, p in rows.items():
            parents[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
        sizes = torch.tensor([n + 1 for n in spec.num_draft_tokens], dtype=torch.int64)
        step = TreeStep({i: torch.tensor(p, dtype=torch.int64) for i, p in rows.items()},
                        starts={i: int(qsl[i]) for i in rows})
        state["step"] = step
        set_step(step)
        sampler.set_trees(StepTrees(parents, sizes))
        return out

    def _sample(logits, spec_decode_metadata):
        set_step(None)
        result = sample(logits, spec_decode_metadata)
        step: Optional[TreeStep] = state["step"]
        state["step"] = None
        verdict = sampler.last
        proposer.tree_paths = None
        if step is None:
            return result
        if verdict is not None:
            counts["tree_steps"] += 1
            counts["tree_rows"] += len(step.rows)
            counts["moved"] += int(compact(step, verdict.accept_index))
            proposer.tree_paths = verdict.accept_index
            proposer.graft.verified(state["req_ids"], state["prefixes"], verdict)
            counts["observed_rows"] += len(state["prefixes"])
        else:
            counts["spine_steps"] += 1
        if (counts["tree_steps"] + counts["spine_steps"]) % LOG_EVERY == 0:
            logger.info("graft: tree verification: %s", counts)
        return result

    def _load_model(*args, **kwargs):
        out = load_model(*args, **kwargs)
        why = attention_refusal(runner.vllm_config)
        if why is not None:
            raise RuntimeError(f"graft: tree verification does not support {why}; on CUDA start vLLM with "
                               "attention_backend FLASH_ATTN, or set GRAFT_VLLM_VERIFY=chain")
        return out

    runner._prepare_inputs = _prepare_inputs
    runner._sample = _sample
    runner.load_model = _load_model
    logger.info("graft: the runner verifies graft trees (tree attention, tree sampler, KV compaction)")
