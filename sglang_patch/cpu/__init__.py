"""CPU execution layer for SGLang speculative decoding: torch replacements, one switch.

`install_cpu_layer` registers every replacement of this folder with SGLang's ``HookRegistry``
when `switch.cpu_layer_enabled` says the process runs on a plain CPU; otherwise it does nothing
and SGLang keeps its own kernels. The hooks are listed in `hooks.HOOKS` (target, kind, function);
docs/sglang_cpu.md explains each.
"""

from __future__ import annotations

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

    from sglang_patch.cpu.hooks import HOOKS

    for target, kind, fn in HOOKS:
        HookRegistry.register(target, fn, kind)
    _installed = True
    return True
