"""The batch budget's verify widths as SGLang runtime states, and the per-request opt-out.

Each verify width ``w`` of ``GraftConfig.verify_widths`` is one SGLang ``SpecRuntimeState``
(``speculative/adaptive_runtime_state.py``): draft and target attention backends and their CUDA
graphs captured for ``w`` verify tokens per request. They are built once at startup, after SGLang's
own capture (``EAGLEWorkerV2.build_adaptive_runtime_state``, ``eagle_worker_v2.py:1777``), and a
round switches between them before it starts (``apply_runtime_state``, :1862). Width 1 is SGLang's
own ``steps = 0`` state: no drafting, the root alone is verified (a plain decode step, whose draft
extend still runs so the draft KV stays warm); every other width drafts the full depth. The KV the
scheduler reserves per round is sized for the widest state (``max_speculative_num_draft_tokens``,
``runtime_context.py:1982``), as for SGLang's own adaptive steps.

The choice itself (`graft_spec.budget.BatchBudget`) is host-side and made before the round is
launched; with tensor parallelism the first rank's choice is broadcast on the CPU group (one small
host collective per round, no device sync), so every rank runs the same shapes.
"""

from __future__ import annotations

import logging
from typing import Dict, Sequence

import torch
from sglang.srt.speculative import eagle_worker_v2 as _ev2
from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

logger = logging.getLogger(__name__)

__all__ = ["OPT_OUT_KEY", "speculates", "WidthStates", "agree_width"]

#: ``sampling_params.custom_params`` key: ``{"graft_speculate": false}`` opts a request out of
#: speculation (its tree carries no candidate; a batch of opted-out requests runs plain decode steps).
OPT_OUT_KEY = "graft_speculate"


def speculates(req) -> bool:
    """False when the request asked for no speculation (``custom_params[OPT_OUT_KEY] is False``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return not (isinstance(params, dict) and params.get(OPT_OUT_KEY) is False)


class WidthStates:
    """One ``SpecRuntimeState`` per verify width of a `GraftWorker` (``EAGLEWorkerV2``).

    Args:
        worker: the graft worker (its current state is the full width N).
    """

    def __init__(self, worker):
        self.worker = worker
        self.states: Dict[int, SpecRuntimeState] = {}

    def build(self, widths: Sequence[int]) -> None:
        """Register the current (full-width) state and build one for every other width (startup)."""
        w = self.worker
        dw = w._draft_worker
        self.states[w.speculative_num_draft_tokens] = SpecRuntimeState(
            speculative_num_steps=w.speculative_num_steps,
            speculative_num_draft_tokens=w.speculative_num_draft_tokens,
            draft_attn_backend=dw.draft_attn_backend,
            cuda_graph_runner=dw.cuda_graph_runner,
            target_attn_backend=w._target_worker.model_runner.attn_backend,
            target_graph_runner=w._target_worker.model_runner.decode_cuda_graph_runner,
            draft_extend_attn_backend=dw.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend,
        )
        graphs_off = _ev2.check_cuda_graph_backend(_ev2.Phase.DECODE, _ev2.Backend.DISABLED)
        cuda_graph_bs = None if graphs_off else _ev2.get_exec().graph.cuda_graph_bs_decode
        with (_ev2.draft_tp_context(dw.parallel_layout), _ev2.speculative_moe_backend_context(),
              _ev2.speculative_moe_a2a_backend_context()):
            for width in widths:
                if width in self.states:
                    continue
                steps = 0 if width == 1 else w.speculative_num_steps
                self.states[width] = w.build_adaptive_runtime_state(
                    speculative_num_steps=steps, speculative_num_draft_tokens=width, cuda_graph_bs=cuda_graph_bs)
        logger.info("graft batch budget: verify widths %s (runtime states built)", sorted(self.states))

    def activate(self, width: int) -> None:
        """Switch the worker to ``width`` (no-op when it is current).

        Raises:
            KeyError: a width without a built state.
        """
        w = self.worker
        if w.speculative_num_draft_tokens == width:
            return
        state = self.states[width]
        if w.speculative_num_steps == state.speculative_num_steps:
            # SGLang's apply_runtime_state returns early when the step counts match
            # (eagle_worker_v2.py:1864); widths >= 2 share the draft depth.
            w.speculative_num_steps = -1
        w.apply_runtime_state(state)


def agree_width(group, width: int) -> int:
    """The first TP rank's width (a broadcast on the group's CPU (gloo) group: no device sync)."""
    t = torch.tensor([width], dtype=torch.int64)
    torch.distributed.broadcast(t, src=group.ranks[0], group=group.cpu_group)
    return int(t[0])
