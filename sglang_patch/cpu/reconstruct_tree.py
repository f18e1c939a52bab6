"""Stand-in for ``sglang.kernels.ops.speculative.reconstruct_tree`` on hosts without ``sgl_kernel``.

SGLang 0.5.23's module imports ``sgl_kernel.speculative`` at import time on any device other than
CUDA/ROCm/XPU (``reconstruct_tree.py:47-50``), so on a plain CPU it cannot be imported, and neither
can the NGRAM worker that imports it (``srt/speculative/ngram_worker.py:10``). A HookRegistry hook
cannot help: the registry must import the module to patch it. `install_cpu_layer` therefore
registers this module under SGLang's name (only when ``sgl_kernel`` is not installed); it exposes
the one function the NGRAM worker uses, implemented in torch.
"""

from sglang_patch.cpu.tree_ops import reconstruct_indices_from_tree_mask_func

#: The SGLang module this file stands in for.
SGLANG_MODULE = "sglang.kernels.ops.speculative.reconstruct_tree"

__all__ = ["SGLANG_MODULE", "reconstruct_indices_from_tree_mask_func"]
