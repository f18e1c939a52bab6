"""Registration of ``--speculative-algorithm graft`` with SGLang (called by ``sglang_patch.plugin``).

Two things are registered, both idempotently (SGLang re-runs plugins in every spawned process):

1. ``SpeculativeAlgorithm.register("GRAFT", spec_class=GraftSpec)`` whose factory returns
   :class:`sglang_patch.graft_worker.GraftWorker` (imported lazily: only scheduler processes build it).
2. ``AFTER`` hooks on ``ServerArgs.add_cli_args`` / ``ServerArgs.from_cli_args`` that add the
   ``--graft-*`` flags and stash their values on the record as ``_graft_cli`` (underscore bookkeeping
   survives pickling into the scheduler processes; ``server_args.py:474,652``).

Source: SGLang 0.5.23 ``srt/speculative/spec_info.py:67`` (``register``), ``spec_registry.py:246``
(duplicate names rejected), ``srt/plugins/hook_registry.py:84`` (``HookRegistry.register``).
"""

from __future__ import annotations

import logging

from sglang_patch.args import add_graft_cli_args, stash_graft_cli_args
from sglang_patch.spec_algo import ALGORITHM_NAME, GraftSpec

logger = logging.getLogger(__name__)

_HOOKS_REGISTERED = False


def _graft_worker_factory(server_args):
    """WorkerFactory: ``ServerArgs -> worker class`` (``spec_registry.WorkerFactory``)."""
    from sglang_patch.graft_worker import GraftWorker

    return GraftWorker


def register_graft() -> None:
    """Register the graft algorithm and its CLI flags; safe to call any number of times."""
    global _HOOKS_REGISTERED
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec


    if get_spec(ALGORITHM_NAME) is None:
        # supports_overlap=True: the graft step has no host read and re-anchors the host's
        # proposals on the device, so it runs under SGLang's default overlap scheduler.
        SpeculativeAlgorithm.register(
            ALGORITHM_NAME, supports_overlap=True, spec_class=GraftSpec
        )(_graft_worker_factory)

    if not _HOOKS_REGISTERED:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType


        HookRegistry.register(
            "sglang.srt.server_args.ServerArgs.add_cli_args",
            add_graft_cli_args,
            HookType.AFTER,
        )
        HookRegistry.register(
            "sglang.srt.server_args.ServerArgs.from_cli_args",
            stash_graft_cli_args,
            HookType.AFTER,
        )
        _HOOKS_REGISTERED = True
