"""vLLM plugin entry point: ``vllm.general_plugins`` -> ``vllm_worker.plugin:register``.

vLLM calls `register` in every process before it builds or uses a config
(plugins/__init__.py:77-90; call sites: engine/arg_utils.py:929-931 in process 0,
v1/engine/core.py:132-135 in the engine core, v1/worker/worker_base.py:287-289 in
workers). It must be idempotent and cheap to repeat.

What it installs:

* config side (`vllm_worker.config_patch`): ``speculative_config={"method": "graft",
  "model": <EAGLE-3 head>, "num_speculative_tokens": K, "graft_config": <file>}``
  validates, aliases to EAGLE-3 and selects the V1 runner;
* runner side: ``GPUModelRunner.__init__`` (gpu_model_runner.py:650-651 builds
  ``EagleProposer``) is wrapped so that, for a graft config, the drafter is replaced by
  `GraftProposer` (a subclass, so the runner's ``isinstance(..., EagleProposer)`` checks
  at :4366, :4836, :6755, :6808 keep passing) before the runner loads its weights. The
  CPU runner subclasses ``GPUModelRunner`` (cpu_model_runner.py:23) and is covered too.
  Before the swap every vLLM name the plugin hooks is checked to exist (`hooks.check`, the list
  with each name's file:line in vLLM 0.32 and 0.33).
"""

from __future__ import annotations

import functools
import logging

from . import hooks
from .config_patch import is_graft, patch_speculative_config, tree_verify_enabled

__all__ = ["register"]

logger = logging.getLogger("vllm.graft")
_registered = False


def _patch_runner() -> None:
    from vllm.v1.worker import gpu_model_runner as gmr

    cls = gmr.GPUModelRunner
    if getattr(cls.__init__, "_graft", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _install_graft_drafter(self)

    __init__._graft = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _install_graft_drafter(runner) -> None:
    """Swap the runner's EAGLE drafter for `GraftProposer` when the config asks for graft."""
    spec = getattr(runner, "speculative_config", None)
    drafter = getattr(runner, "drafter", None)
    if not is_graft(spec) or drafter is None:
        return
    from vllm.v1.spec_decode.eagle import EagleProposer

    from .proposer import GraftProposer

    if isinstance(drafter, GraftProposer):
        return
    if type(drafter) is not EagleProposer:
        raise RuntimeError(f"graft: expected the runner to build an EagleProposer, got {type(drafter).__name__}")
    from vllm.platforms import current_platform

    trees = tree_verify_enabled()
    hooks.check(trees, "cpu" if current_platform.is_cpu() else "cuda", runner)   # every hooked name, at startup
    runner.drafter = GraftProposer(runner.vllm_config, runner.device, runner, trees=trees)
    if trees:
        from . import tree_runner

        if current_platform.is_cpu():
            from . import tree_attention as backend
        else:
            from . import tree_attention_gpu as backend
        backend.register()
        tree_runner.install(runner, runner.drafter, backend.compact)
        logger.info("graft: drafter is GraftProposer (EAGLE-3 tree -> prune -> graft), verified as trees "
                    "on the V1 model runner")
    else:
        logger.info("graft: drafter is GraftProposer (EAGLE-3 tree -> prune -> graft -> best chain) "
                    "on the V1 model runner")


def register() -> None:
    """Install the config and runner patches once per process (idempotent)."""
    global _registered
    if _registered:
        return

    patch_speculative_config()
    try:
        _patch_runner()
    except ImportError as e:  # a platform without the V1 GPU runner module
        logger.warning("graft: V1 model runner not importable (%s); method='graft' cannot run here", e)
    _registered = True
