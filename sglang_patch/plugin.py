"""SGLang plugin entry point (group ``sglang.srt.plugins``, see pyproject.toml).

SGLang calls :func:`register` once per process (launcher, tokenizer manager, every scheduler
process; ``srt/plugins/__init__.py:103``), before ``HookRegistry.apply_hooks()``. Everything here
must therefore be idempotent and cheap.
"""

from __future__ import annotations

from sglang_patch.bench.op_census import register_op_census
from sglang_patch.cpu import install_cpu_layer
from sglang_patch.kv_reserve import register_kv_reserve
from sglang_patch.prefill_finish import register_prefill_finish
from sglang_patch.registration import register_graft
from sglang_patch.request_guard import register_request_guard
from sglang_patch.server_stats import register_server_stats


def register() -> None:
    """Install the CPU execution layer (only when no CUDA device), register ``graft``, the
    serving-stats readback (`sglang_patch.server_stats`) and the prompt guard
    (`sglang_patch.request_guard`).

    Source: SGLang 0.5.23 ``srt/plugins/__init__.py`` (``load_plugins``) and
    ``srt/plugins/hook_registry.py`` (hooks registered here are applied right after).
    """
    install_cpu_layer()
    register_graft()
    register_server_stats()  # GET /server_info -> internal_states[i]["graft"]
    register_kv_reserve()  # the batch budget's widths come off the KV cache before it is sized
    register_request_guard()  # 400 instead of a scheduler crash for empty / out-of-vocab prompts
    register_prefill_finish()  # requests that finish in their prefill free their graft state
    register_op_census()  # only with GRAFT_OP_CENSUS set (python -m sglang_patch.bench.op_census)
