"""The table of CPU-layer hooks: (SGLang target, hook type, our function).

Targets are SGLang 0.5.23 dispatcher functions (the names call sites look up at run time), so one
REPLACE covers every caller; ``HookRegistry.apply_hooks`` also rebinds ``from X import Y`` copies
in modules already imported (``srt/plugins/hook_registry.py:320``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from sglang_patch.cpu import attention, cache_ops, distributed, hashing, moe, overlap, rotary, sampling, tree_ops

_SPEC = "sglang.kernels.ops.speculative"

HOOKS = [
    # Tensor parallelism: gloo groups without the CUDA communicators (parallel_state.py:2160).
    (distributed.TARGET, HookType.AROUND, distributed.cpu_model_parallel_group),
    # Expert parallelism: the local-expert map is made on get_device() (standard.py:231), which has no
    # answer for a plain CPU.
    (moe.TARGET, HookType.AROUND, moe.get_device_hook),
    # ... and the torch MoE forward fails on the dispatcher's -1 (other rank's expert) ids.
    (moe.NATIVE_TARGET, HookType.AROUND, moe.moe_forward_native_hook),
    # Model construction: RotaryEmbedding would import vllm._custom_ops (never called on CPU).
    (f"{rotary.ROTARY_MODULE}.RotaryEmbedding.__init__", HookType.AROUND, rotary.rotary_init_hook),
    # EAGLE tree build / greedy verify (spec_tree.py:367, :480).
    (f"{_SPEC}.spec_tree.build_tree_kernel_efficient_func", HookType.REPLACE,
     tree_ops.build_tree_kernel_efficient_func),
    (f"{_SPEC}.spec_tree.verify_tree_greedy_func", HookType.REPLACE, tree_ops.verify_tree_greedy_func),
    # NGRAM verify metadata from the corpus mask (reconstruct_tree.py:163).
    (f"{_SPEC}.reconstruct_tree.reconstruct_indices_from_tree_mask_func", HookType.REPLACE,
     tree_ops.reconstruct_indices_from_tree_mask_func),
    # The tree mask layout the torch verify attention reads (eagle_utils.py:132), as SGLang's
    # own CPU engine does.
    ("sglang.srt.speculative.eagle_utils.default_tree_mask_mode", HookType.REPLACE,
     sampling.qlen_only_tree_mask_mode),
    # Sampled verification: real target-only tree sampling instead of no kernel (eagle_utils.py:521).
    ("sglang.srt.speculative.eagle_utils.eagle_sample", HookType.AROUND, sampling.eagle_sample_hook),
    # Seeded sampling hashes (sampler.py:958, spec_utils.py:174, eagle_utils.py:438) and argmax.
    ("sglang.kernels.ops.sampling.murmur_hash.murmur_hash32", HookType.REPLACE, hashing.murmur_hash32),
    (f"{_SPEC}.row_argmax.row_argmax", HookType.REPLACE, sampling.row_argmax),
    # Overlap-scheduler relay read (overlap_utils.py:507).
    (f"{_SPEC}.gather_spec_extras.gather_spec_extras", HookType.REPLACE, cache_ops.gather_spec_extras),
    # KV-slot bookkeeping (cache_locs.py:85, :596, :679, :752; eagle.py:32, :73).
    (f"{_SPEC}.cache_locs.assign_draft_cache_locs_contiguous_func", HookType.REPLACE,
     cache_ops.assign_draft_cache_locs_contiguous_func),
    (f"{_SPEC}.cache_locs.assign_extend_cache_locs_func", HookType.REPLACE,
     cache_ops.assign_extend_cache_locs_func),
    (f"{_SPEC}.cache_locs.assign_extend_cache_locs_uniform_func", HookType.REPLACE,
     cache_ops.assign_extend_cache_locs_uniform_func),
    (f"{_SPEC}.cache_locs.fill_front_out_cache_loc_func", HookType.REPLACE,
     cache_ops.fill_front_out_cache_loc_func),
    (f"{_SPEC}.eagle.fill_bonus_tokens_func", HookType.REPLACE, cache_ops.fill_bonus_tokens_func),
    (f"{_SPEC}.eagle.fill_accept_out_cache_loc_func", HookType.REPLACE,
     cache_ops.fill_accept_out_cache_loc_func),
    ("sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func", HookType.REPLACE,
     cache_ops.assign_req_to_token_pool_func),
    # KV moves (accepted-path compaction, spec_utils.py:859) on SGLang's torch path.
    ("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup", HookType.REPLACE,
     cache_ops.native_kv_move_init),
    # torch_native attention: tree verify, and the EAGLE draft backends.
    ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
     HookType.AROUND, attention.forward_extend_hook),
    ("sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend", HookType.AROUND,
     attention.add_torch_native_draft_backends),
]

#: Opt-in (``GRAFT_SGLANG_CPU_OVERLAP=1``, see `overlap`): keep the overlap scheduler on CPU.
OVERLAP_HOOK = ("sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu",
                HookType.REPLACE, overlap.keep_overlap_schedule)


def hook_table() -> list:
    """The hooks to register in this process: `HOOKS`, plus `OVERLAP_HOOK` when requested."""
    return HOOKS + ([OVERLAP_HOOK] if overlap.overlap_requested() else [])
