"""Opt-in: the overlap scheduler (spec v2 with overlap) for SGLang's own speculative algorithms on CPU.

SGLang 0.5.23 turns the overlap scheduler off for its speculative algorithms when ``--device cpu``
(``srt/arg_groups/speculative_hook.py:66`` ``_disable_overlap_schedule_for_cpu``, called from the
EAGLE and NGRAM resolution steps, :1096 and :1292). With this layer the overlap path itself runs on
CPU (its relay read ``gather_spec_extras`` is replaced in ``cache_ops``) and gives the same tokens.
``GRAFT_SGLANG_CPU_OVERLAP=1`` lifts the guard for EAGLE / NGRAM (e.g. to compare them with graft
under the same scheduler). Graft itself does not go through that guard: it keeps SGLang's default
(overlap on) on CPU as on a GPU (`sglang_patch.args.apply_graft_server_defaults`).
"""

from __future__ import annotations

import os

ENV_VAR = "GRAFT_SGLANG_CPU_OVERLAP"


def overlap_requested() -> bool:
    """True when ``GRAFT_SGLANG_CPU_OVERLAP`` is set to 1/true/yes."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes")


def keep_overlap_schedule(server_args) -> None:
    """REPLACE for ``_disable_overlap_schedule_for_cpu``: leave ``disable_overlap_schedule`` as
    the user set it (``--disable-overlap-schedule`` still turns overlap off)."""
    del server_args
