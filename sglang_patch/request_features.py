"""Which request features a speculative round serves exactly, and which need SGLang's decode step.

SGLang 0.5.23's speculative verify (``eagle_utils.py:eagle_sample``) applies penalties in a relaxed
form (accumulated once per round, not after every accepted token, ``eagle_utils.py:562``), has no
``min_p`` filter and runs no custom logit processor, and its logprobs come from
``compute_spec_logprobs`` rather than the sampler's. A batch holding a request with any of these runs
a plain round (verify width 1), which is SGLang's own decode step (`sglang_patch.plain_round`): the
request's output and logprobs are then those of a server without speculation. Everything else
(greedy and sampled decoding, top-k / top-p, ``logit_bias``, structured output, stop strings, ``n``)
is exact in speculative rounds too; ``return_hidden_states`` is refused at the HTTP layer
(`sglang_patch.request_guard`). docs/serving.md has the table with the test of each row.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["plain_round_reason", "speculates", "OPT_OUT_KEY"]

#: ``sampling_params.custom_params`` key: ``{"graft_speculate": false}`` opts a request out of
#: speculation (its tree carries no candidate; a batch of opted-out requests runs plain rounds). A
#: value that is not a JSON boolean is refused with a 400 (`sglang_patch.request_guard`).
OPT_OUT_KEY = "graft_speculate"

#: ``Req`` attribute caching `plain_round_reason` (a request's parameters do not change).
_CACHE = "_graft_plain_reason"


def _reason(req) -> str:
    sp = getattr(req, "sampling_params", None)
    if sp is not None:
        if (getattr(sp, "frequency_penalty", 0.0) or 0.0) != 0.0:
            return "frequency_penalty"
        if (getattr(sp, "presence_penalty", 0.0) or 0.0) != 0.0:
            return "presence_penalty"
        if (getattr(sp, "repetition_penalty", 1.0) or 1.0) != 1.0:
            return "repetition_penalty"
        if (getattr(sp, "min_new_tokens", 0) or 0) > 0:
            return "min_new_tokens"
        if (getattr(sp, "min_p", 0.0) or 0.0) > 0.0:
            return "min_p"
        if getattr(sp, "watermark", None):
            return "watermark"
    if getattr(req, "return_logprob", False):
        return "return_logprob"
    if getattr(req, "custom_logit_processor", None):
        return "custom_logit_processor"
    return ""


def plain_round_reason(req) -> Optional[str]:
    """The sampling parameter that makes ``req`` need SGLang's decode step (its batch then runs plain
    rounds), or None. Cached on the request."""
    reason = getattr(req, _CACHE, None)
    if reason is None:
        reason = _reason(req)
        try:
            setattr(req, _CACHE, reason)
        except AttributeError:   # a slotted stand-in: not cached
            pass
    return reason or None


def speculates(req) -> bool:
    """False when the request asked for no speculation (``custom_params[OPT_OUT_KEY] is False``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return not (isinstance(params, dict) and params.get(OPT_OUT_KEY) is False)
