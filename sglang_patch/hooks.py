"""One registration point for the plugin's hooks on SGLang functions: each target hooked once per
process (SGLang re-runs plugins in every spawned process).

Source: SGLang 0.5.23 ``srt/plugins/hook_registry.py:84`` (``HookRegistry.register``).
"""

from __future__ import annotations

import sys

__all__ = ["register_hook"]

#: targets this process registered a plugin hook on (`register_hook`)
_HOOKED: set = set()


def register_hook(target: str, hook, hook_type: str = "AFTER", only_if_imported: str = "") -> bool:
    """Register ``hook`` on ``target`` with SGLang's HookRegistry, once per process and target.

    Args:
        target: dotted path of the patched function (``HookRegistry.register``'s target).
        hook: the hook function.
        hook_type: ``"BEFORE"`` or ``"AFTER"`` (``HookType`` member name).
        only_if_imported: a module name: register only in processes that have imported it (resolving
            the target elsewhere would import a module stack the process never runs).
    Returns:
        True when newly registered.
    """
    if target in _HOOKED or (only_if_imported and only_if_imported not in sys.modules):
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType[hook_type])
    _HOOKED.add(target)
    return True
