"""SGLang plugin entry point (group ``sglang.srt.plugins``, see pyproject.toml).

SGLang calls :func:`register` once per process (launcher, tokenizer manager, every scheduler
process; ``srt/plugins/__init__.py:103``), before ``HookRegistry.apply_hooks()``. Everything here
must therefore be idempotent and cheap.
"""


def register() -> None:
    """Install the CPU execution layer (only when no CUDA device) and register ``graft``.

    Source: SGLang 0.5.23 ``srt/plugins/__init__.py`` (``load_plugins``) and
    ``srt/plugins/hook_registry.py`` (hooks registered here are applied right after).
    """
    from sglang_patch.cpu import install_cpu_layer
    from sglang_patch.registration import register_graft

    install_cpu_layer()
    register_graft()
