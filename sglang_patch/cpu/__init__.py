"""CPU execution layer for SGLang speculative decoding: torch replacements, one switch.

`install_cpu_layer` registers every replacement of this folder with SGLang's ``HookRegistry``
when `switch.cpu_layer_enabled` says the process runs on a plain CPU; otherwise it does nothing
and SGLang keeps its own kernels. The hooks are listed in `hooks.HOOKS` (target, kind, function);
`hooks.hook_table` adds the opt-in overlap hook. docs/sglang_cpu.md explains each.

One SGLang module cannot be hooked because it cannot be imported without ``sgl_kernel``
(``kernels/ops/speculative/reconstruct_tree.py``, needed by the NGRAM worker); when ``sgl_kernel``
is absent, `reconstruct_tree` is registered under its name instead (see that module).
"""

from __future__ import annotations

import importlib.util
import sys

from sglang_patch.cpu.switch import cpu_layer_enabled

_installed = False


def install_cpu_layer() -> bool:
    """Register the CPU replacements through SGLang's HookRegistry when no accelerator is present.

    Must run before ``HookRegistry.apply_hooks()`` (i.e. from the plugin entry point, SGLang 0.5.23
    ``srt/plugins/__init__.py:103``); idempotent per process.

    Returns:
        True when the layer is (now or already) registered in this process.
    """
    global _installed
    if _installed:
        return True
    if not cpu_layer_enabled():
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_patch.cpu.hooks import hook_table

    for target, kind, fn in hook_table():
        HookRegistry.register(target, fn, kind)
    _stand_in_unimportable_modules()
    _installed = True
    return True


def _stand_in_unimportable_modules() -> None:
    """Register `reconstruct_tree` as SGLang's module of that name when ``sgl_kernel`` is absent."""
    from sglang_patch.cpu import reconstruct_tree

    if reconstruct_tree.SGLANG_MODULE not in sys.modules and importlib.util.find_spec("sgl_kernel") is None:
        sys.modules[reconstruct_tree.SGLANG_MODULE] = reconstruct_tree
