"""What the ``graft`` speculative algorithm *is* to SGLang: its ``CustomSpecAlgo`` subclass.

SGLang dispatches on ``is_*()`` predicates instead of algorithm names. Graft drafts with an EAGLE-3
draft model and verifies through the EAGLE V2 verify path, so it answers like EAGLE3 for every
predicate that selects draft-model loading, aux hidden-state capture, the draft KV pool, CUDA graphs
and the overlap relay. What differs (the tree that is verified) lives in
:mod:`sglang_patch.graft_worker`.

Source: SGLang 0.5.23 ``srt/speculative/spec_registry.py:26`` (``CustomSpecAlgo``) and
``spec_info.py`` (the enum's predicates). The default ``CustomSpecAlgo`` lacks
``create_future_map`` / ``carries_draft_hidden_states`` / ``need_topk``, which the scheduler calls
unconditionally (``scheduler.py:1540,1681``), hence this subclass.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_patch.args import apply_graft_server_defaults

if TYPE_CHECKING:  # pragma: no cover
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

#: Registry name (SGLang upper-cases names; the CLI accepts ``graft`` in any case).
ALGORITHM_NAME = "GRAFT"


class GraftSpec(CustomSpecAlgo):
    """``--speculative-algorithm graft``: EAGLE-3 drafting + prune-then-graft hybrid tree verify.

    Behaves as ``SpeculativeAlgorithm.EAGLE3`` for every predicate except ``supports_mixed_chunk``
    (False: a mixed step would degrade running requests to a plain decode, as for custom algorithms
    in general). ``handle_server_args`` fills the tree shape and scheduling defaults that SGLang only
    applies to built-in EAGLE (see :func:`sglang_patch.args.apply_graft_server_defaults`).
    """

    # --- what it reuses from EAGLE-3 -------------------------------------------------------------
    def is_eagle(self) -> bool:
        return True

    def is_eagle3(self) -> bool:
        return True

    def need_topk(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        """Same relay buffers as EAGLE (``overlap_utils.FutureMap``)."""
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        from sglang.srt.speculative.eagle_disaggregation import build_eagle_disagg_draft_input

        return build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map)

    # --- server arguments -------------------------------------------------------------------------
    def handle_server_args(self, server_args: "ServerArgs") -> None:
        """Declare graft's defaults and validate its settings (runs on SGLang's stand-in record).

        Raises:
            ValueError: one message naming the offending field (see ``sglang_patch.args``).
        """
        apply_graft_server_defaults(server_args)

    def create_worker(self, server_args: "ServerArgs"):
        """Return :class:`~sglang_patch.graft_worker.GraftWorker` (overlap scheduler or not: the
        graft step reads nothing from the host, and host proposals are re-anchored on the device)."""
        return self.factory(server_args)
