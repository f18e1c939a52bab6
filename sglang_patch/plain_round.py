"""A plain round (verify width 1) run as SGLang's own decode step.

When the batch budget picks width 1 the round verifies nothing: it is a decode step, and graft runs
it as the target's ``ForwardMode.DECODE`` forward, the forward a server without speculation runs
(same attention path, logits processor, sampler, penalties, logprobs and grammar mask), instead of a
one-node ``TARGET_VERIFY`` round through EAGLE's verify path. For the length of the forward the
batch and the target's model runner look like a non-speculative server's (`as_plain_decode`:
``spec_algorithm`` NONE, no ``spec_info``, ``seq_lens`` including the new token, positions and the
KV slot at the committed length), so SGLang takes its decode path end to end, and on a CUDA device
replays the decode graphs `PlainDecodeGraphRunner` captured at startup.

Differences from a no-speculation decode step, all outside the target's forward:

* the target returns its hidden state at the root (``CaptureHiddenMode.LAST``, which EAGLE-3's
  draft needs to catch up over the tokens of plain rounds, `sglang_patch.deferred_draft`);
* the result is shaped as a speculative round's (``accept_lens`` 1, ``new_seq_lens``, an
  ``EagleDraftInput`` carrying the new token as its bonus token; top-k and hidden state are left to
  the overlap relay, which keeps the last drafting round's, ``overlap_utils.py:700-711``), because
  the scheduler of a speculative server processes every decode result as one
  (``batch_result_processor.py:770``).

Nothing of graft's runs in the round besides recording the skipped draft extend: no tree, no host
proposals, no observe. The token history and the host sources catch up from the committed tokens
before the next drafting round.

Source: SGLang 0.5.23 ``managers/schedule_batch.py:3736`` (``prepare_for_decode``: ``seq_lens + 1``,
one KV slot per request), ``model_executor/forward_batch_info.py:1228`` (decode positions =
``seq_lens - 1``), ``managers/tp_worker.py:622`` (forward and sample),
``model_executor/runner/decode_cuda_graph_runner.py:356-367`` (a speculative model runner captures
``TARGET_VERIFY`` graphs only).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from sglang.kernels.ops.speculative import cache_locs as _cache_locs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_patch.rebinding import rebound

__all__ = ["as_plain_decode", "plain_decode_round", "PlainDecodeGraphRunner"]

#: ScheduleBatch fields a plain round sets for its forward (and restores afterwards).
_BATCH_FIELDS = ("forward_mode", "input_ids", "out_cache_loc", "seq_lens", "seq_lens_cpu", "seq_lens_sum",
                 "spec_info", "spec_algorithm")


def no_speculation(model_runner):
    """The target's model runner without a speculative algorithm for the length of the block, as in a
    server without speculation: SGLang then captures and replays ``DECODE`` graphs and runs its
    decode path (``decode_cuda_graph_runner.py:362``, ``base_runner.py:510``)."""
    return rebound(model_runner, "spec_algorithm", SpeculativeAlgorithm.NONE)


@contextlib.contextmanager
def as_plain_decode(batch, model_runner, req_to_token: torch.Tensor) -> Iterator[torch.Tensor]:
    """``batch`` as SGLang's decode batch of its roots, for the length of the block.

    The root (last round's bonus token, ``batch.spec_info.bonus_tokens``) is the input token at
    position ``seq_lens`` (committed tokens before it), written to the KV slot the speculative
    allocation reserved there (``req_to_token[slot, seq_lens]``); ``seq_lens`` include it, as after
    ``ScheduleBatch.prepare_for_decode``. Every field is restored on exit, also on error.

    Yields:
        ``seq_lens + 1`` (the round's new committed lengths, the tensor the forward read).
    """
    saved = {f: getattr(batch, f) for f in _BATCH_FIELDS}
    seq = batch.seq_lens
    bs = seq.shape[0]
    new_lens = seq + 1
    try:
        batch.input_ids = batch.spec_info.bonus_tokens.reshape(bs)
        # one KV slot per request, at the root's position: SGLang's verify-window kernel, width 1
        batch.out_cache_loc = _cache_locs.assign_extend_cache_locs_uniform_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token, start_offset=seq, batch_size=bs,
            draft_token_num=1, device=seq.device)
        batch.seq_lens = new_lens
        if saved["seq_lens_cpu"] is not None:
            batch.seq_lens_cpu = saved["seq_lens_cpu"] + 1
        batch.seq_lens_sum = None if saved["seq_lens_sum"] is None else saved["seq_lens_sum"] + bs
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_info = None
        batch.spec_algorithm = SpeculativeAlgorithm.NONE
        with no_speculation(model_runner):
            yield new_lens
    finally:
        for f, v in saved.items():
            setattr(batch, f, v)


def plain_decode_round(target_worker, batch, req_to_token: torch.Tensor, on_publish=None, grammar_barrier=None,
                       keep_draft_state: bool = False) -> GenerationBatchResult:
    """One plain round of ``batch``: the target's decode forward and sampling, shaped as a speculative
    round's result.

    Args:
        target_worker: SGLang's ``TpModelWorker`` of the target.
        batch: the decode ``ScheduleBatch`` (``spec_info``: an ``EagleDraftInput`` with the roots).
        req_to_token: ``int32[P, max_context]`` SGLang's request-to-KV-slot table.
        on_publish: the overlap scheduler's publish callback (``scheduler.py:4690``), called once
            with the new committed lengths.
        grammar_barrier: the overlap scheduler's grammar barrier (advances the previous round's
            grammar states; called before a batch with grammars is sampled, as EAGLE's verify does,
            ``spec_utils.py:774``).
        keep_draft_state: hand the input's draft top-k and hidden state on (no overlap relay keeps
            them: the non-overlap scheduler passes ``next_draft_input`` as the next ``spec_info``).
    Returns:
        ``GenerationBatchResult`` with ``next_token_ids`` ``[B]``, ``accept_lens`` ``int32[B]`` of ones,
        ``new_seq_lens`` ``[B]``, ``next_draft_input`` (``EagleDraftInput``; the new tokens as bonus
        tokens), ``speculative_num_draft_tokens`` 1 and ``logits_output.hidden_states`` ``[B, H_t]`` the
        target's hidden state at each root.
    """
    draft_input = batch.spec_info
    if batch.has_grammar and grammar_barrier is not None:
        grammar_barrier()
    with as_plain_decode(batch, target_worker.model_runner, req_to_token) as new_lens:
        result = target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.LAST)
    if on_publish is not None:
        on_publish(new_lens)
    bs = new_lens.shape[0]
    # the new tokens are the next bonus tokens (the overlap relay casts them to its buffer's dtype)
    nxt = EagleDraftInput(bonus_tokens=result.next_token_ids, capture_hidden_mode=CaptureHiddenMode.LAST)
    if keep_draft_state:
        nxt.topk_p, nxt.topk_index = draft_input.topk_p, draft_input.topk_index
        nxt.hidden_states = draft_input.hidden_states
    result.next_draft_input = nxt
    result.accept_lens = _ones(bs, new_lens.device)
    result.new_seq_lens = new_lens
    result.speculative_num_draft_tokens = 1
    out = result.logits_output
    if out is not None and out.next_token_logprobs is not None:
        # a speculative result carries logprobs per request and accepted token (``[B, 1]`` here)
        out.next_token_logprobs = out.next_token_logprobs.reshape(bs, 1)
    return result


_ONES: dict = {}


def _ones(bs: int, device) -> torch.Tensor:
    """``int32[bs]`` of ones: a view of a buffer kept per device (grown, never written after)."""
    buf = _ONES.get(str(device))
    if buf is None or buf.shape[0] < bs:
        buf = _ONES[str(device)] = torch.ones(max(bs, 64), dtype=torch.int32, device=device)
    return buf[:bs]


class PlainDecodeGraphRunner(DecodeCudaGraphRunner):
    """SGLang's decode CUDA-graph runner for plain rounds: ``DECODE`` forwards of one token per
    request, captured with the target's last hidden state (``CaptureHiddenMode.LAST``, which the
    draft's catch-up reads) in a speculative server. Built at startup in place of the width-1
    ``TARGET_VERIFY`` graphs (`sglang_patch.verify_widths`), with the model runner seen as a
    non-speculative one (`no_speculation`) so the capture takes SGLang's decode path
    (``decode_cuda_graph_runner.py:356-367``); plain rounds replay it under the same view.
    """

    _hidden_mode: Optional[CaptureHiddenMode] = None

    def __init__(self, model_runner, *, attn_backend=None, speculative_num_steps=None,
                 speculative_num_draft_tokens=None, **kwargs):
        del speculative_num_steps, speculative_num_draft_tokens   # a decode graph verifies nothing
        with no_speculation(model_runner):
            super().__init__(model_runner, attn_backend=attn_backend, speculative_num_steps=0,
                             speculative_num_draft_tokens=1, **kwargs)

    @property
    def return_hidden_states_mode(self) -> CaptureHiddenMode:
        """At least ``LAST`` (``BaseRunner.__init__`` assigns the server's mode, ``base_runner.py:238``)."""
        return self._hidden_mode

    @return_hidden_states_mode.setter
    def return_hidden_states_mode(self, mode: CaptureHiddenMode) -> None:
        self._hidden_mode = max(mode, CaptureHiddenMode.LAST)
