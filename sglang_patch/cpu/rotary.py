"""Rotary embedding construction on a plain CPU.

``RotaryEmbedding.__init__`` (SGLang 0.5.23 ``srt/layers/rotary_embedding/base.py:92-142``) picks a
"fallback kernel" for every device that is not CUDA/CPU-engine/XPU/NPU/MUSA/MPS/out-of-tree, and on
such a device imports ``vllm._custom_ops.rotary_embedding``. Without vLLM that import fails (with a
CUDA build of vLLM it imports, minus its ``_C`` ops), although the kernel is never called there:
with no accelerator the op's dispatcher resolves to the pure-torch ``forward_native``
(``kernels/fused_op.py`` ``_platform_key`` returns ``""``, ``_resolve_forward_method`` falls back to
``forward_native``). So model construction must not depend on vLLM being importable.

`rotary_init_hook` runs the stock constructor down its no-fallback-kernel branch, so the module
uses SGLang's own torch rotary (``forward_native``, ``rotary_embedding/utils.py:36``).
"""

from __future__ import annotations

import sys

ROTARY_MODULE = "sglang.srt.layers.rotary_embedding.base"


def rotary_init_hook(orig, self, *args, **kwargs):
    """AROUND hook on ``RotaryEmbedding.__init__``: construct without the fallback kernel.

    The constructor's kernel choice reads the module flag ``_is_cpu`` (base.py:124); it is set for
    the duration of the call only, so nothing else in the module sees it.
    """
    module = sys.modules[ROTARY_MODULE]
    saved = module._is_cpu
    module._is_cpu = True
    try:
        orig(self, *args, **kwargs)
    finally:
        module._is_cpu = saved
