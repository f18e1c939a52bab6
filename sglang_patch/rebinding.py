"""Every SGLang name graft rebinds for the length of a call, in one place.

A plugin that does not fork its engine changes SGLang 0.5.23's behaviour at a few points by
rebinding, for the length of one call, a module global that SGLang looks up at call time, or a
method through an instance attribute that shadows it (`rebound`); the engine's own object is back
afterwards, also on error. The points (file:line of SGLang 0.5.23's ``srt/speculative/``):

| rebound name | looked up at | by | why |
|---|---|---|---|
| ``eagle_worker_v2.build_eagle_verify_input`` | ``eagle_worker_v2.py:717`` | ``GraftDraftWorker.draft`` | the graft tree instead of the EAGLE tree |
| ``eagle_worker_v2.organize_draft_results`` | ``eagle_worker_v2.py:919`` | ``GraftDraftWorker.draft_forward`` | capture the dense draft tree |
| ``eagle_worker_v2.select_top_k_tokens`` | ``eagle_worker_v2.py:812`` | ``GraftDraftWorker.draft_forward`` (eager) | the draft stop gate |
| the draft runner's ``forward`` | ``eagle_worker_v2.py`` draft loop | ``GraftDraftWorker.draft_forward`` (eager) | count / skip draft forwards |
| the target model runner's ``spec_algorithm`` (NONE) | ``decode_cuda_graph_runner.py:362``, ``base_runner.py:510`` | a plain round's forward, its decode graphs' capture (`sglang_patch.plain_round`) | SGLang's decode path in a speculative server |
| ``eagle_worker_v2.DecodeCudaGraphRunner`` | ``eagle_worker_v2.py:1811`` | building the width-1 state (`sglang_patch.verify_widths`) | decode graphs (`PlainDecodeGraphRunner`) instead of one-node verify graphs |
| ``eagle_utils.tree_speculative_sampling_target_only``, ``eagle_utils.torch`` | ``eagle_utils.py:744-748`` | graft's verify (`sglang_patch.tree_sampling`) | sampled verify without the zero tensor |
| the draft worker's ``init_attention_backend``, ``eagle_worker_v2.EAGLEDraftCudaGraphRunner`` / ``EAGLEDraftNpuGraphRunner`` | ``eagle_worker_v2.py:1792-1793``, ``:488-491`` | building a width's state (`sglang_patch.verify_widths`) | one draft decode backend and graph set for every width >= 2 |

The CPU execution layer (``sglang_patch/cpu/``) replaces device kernels on a CPU host through its
one switch; it is not listed here.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["rebound"]


@contextlib.contextmanager
def rebound(owner, name: str, value) -> Iterator[None]:
    """Temporarily set ``owner.name = value``: a module global the engine looks up at call time, or a
    method shadowed by an instance attribute (removed afterwards, so the class's method is back
    rather than a stored bound copy)."""
    had_own = name in vars(owner)
    original = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
