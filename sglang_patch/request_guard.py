"""Reject prompts that crash SGLang 0.5.23's scheduler, and requests a graft server refuses, with a 400.

SGLang validates sampling parameters and lengths in the tokenizer manager (400 answers), and
rejects ``"input_ids": []``, but not the tokens of a prompt. These inputs reach the model and kill
the scheduler process (the whole server goes down, every running request is lost), with or without
speculative decoding (checked on CPU with the quick models):

* ``"text": ""`` with a tokenizer that adds no BOS token (0 prompt tokens):
  ``logits_processor.py:723`` indexes the hidden states of an empty extend (``IndexError``);
* a negative token id, or one ``>= vocab_size`` (``input_ids``, or a token-id prompt on
  ``/v1/completions``): out-of-range embedding lookup.

On a graft server (``--speculative-algorithm graft``) the same hook refuses a non-boolean
``custom_params.graft_speculate`` and ``return_hidden_states`` (`graft_request_problem`).

(tests/serving/test_serving_faults.py sends each one; docs/serving.md lists the behaviour.)

`check_prompt_tokens` is a ``BEFORE`` hook on ``TokenizerManager._validate_one_request(obj,
input_ids)`` (``tokenizer_manager.py:1307``), which SGLang calls for every single and batched
request after tokenization; a ``ValueError`` raised there becomes an HTTP 400 with its message,
exactly like SGLang's own context-length errors. Requests with ``input_embeds`` or multimodal data
are left alone (their ids may hold placeholder values). Registered from
``sglang_patch.plugin.register`` for every server, speculative or not.
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_patch.hooks import register_hook
from sglang_patch.request_features import OPT_OUT_KEY

#: SGLang 0.5.23 per-request validation after tokenization.
TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_MM_FIELDS = ("image_data", "video_data", "audio_data")



def prompt_problem(input_ids: Optional[Sequence[int]], vocab_size: Optional[int]) -> Optional[str]:
    """Why ``input_ids`` would crash the model, or None.

    Args:
        input_ids: tokenized prompt (None: the request carries embeddings instead).
        vocab_size: the target's vocabulary size (None: range not checked).
    """
    if input_ids is None:
        return None
    if len(input_ids) == 0:
        return "the prompt is empty (0 tokens); send at least one token"
    if vocab_size is not None:
        bad = [t for t in input_ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
        if bad:
            return (f"input_ids contain {len(bad)} token id(s) outside [0, {vocab_size}), "
                    f"e.g. {bad[0]!r}")
    return None


def graft_request_problem(obj) -> Optional[str]:
    """Why a graft server refuses the request ``obj`` (``GenerateReqInput`` of one request), or None:
    a ``custom_params.graft_speculate`` that is not a JSON boolean (a string "false" would be taken as
    true), or ``return_hidden_states`` (a plain round's target forward returns the EAGLE-3 capture
    layers' states, not the last layer's that SGLang returns without speculation)."""
    params = getattr(obj, "sampling_params", None)
    custom = params.get("custom_params") if isinstance(params, dict) else getattr(params, "custom_params", None)
    if isinstance(custom, dict) and OPT_OUT_KEY in custom and not isinstance(custom[OPT_OUT_KEY], bool):
        return (f"sampling_params.custom_params.{OPT_OUT_KEY} must be true or false, got "
                f"{custom[OPT_OUT_KEY]!r}")
    if getattr(obj, "return_hidden_states", False):
        return "return_hidden_states is not supported with --speculative-algorithm graft"
    return None


def _is_graft_server(manager) -> bool:
    algo = getattr(getattr(manager, "server_args", None), "speculative_algorithm", None)
    return isinstance(algo, str) and algo.upper() == "GRAFT"


def check_prompt_tokens(manager, obj, input_ids, *args, **kwargs):
    """``BEFORE`` hook: raise ``ValueError`` (HTTP 400) for a prompt that would crash the model, and on
    a graft server for a request it refuses (`graft_request_problem`).

    Args:
        manager: the ``TokenizerManager`` (``model_config.vocab_size``).
        obj: ``GenerateReqInput`` / ``EmbeddingReqInput`` of one request.
        input_ids: its token ids after tokenization.
    Returns:
        None (arguments unchanged).
    Raises:
        ValueError: empty prompt, a token id outside ``[0, vocab_size)``, or (graft) a refused request.
    """
    if _is_graft_server(manager):
        problem = graft_request_problem(obj)
        if problem is not None:
            raise ValueError(f"Invalid request: {problem}.")
    if getattr(obj, "input_embeds", None) is not None:
        return None
    multimodal = any(getattr(obj, f, None) for f in _MM_FIELDS)
    vocab = None if multimodal else getattr(getattr(manager, "model_config", None), "vocab_size", None)
    problem = prompt_problem(input_ids, vocab)
    if problem is not None:
        raise ValueError(f"Invalid prompt: {problem}.")
    return None


def register_request_guard() -> bool:
    """Register `check_prompt_tokens` with SGLang's HookRegistry (once per process).

    Resolving the target imports ``tokenizer_manager`` in every process: the HTTP process imports
    it anyway, schedulers and the detokenizer already have it loaded by the other plugin hooks
    (measured: +0.02 s). Returns True when newly registered.
    """
    return register_hook(TARGET, check_prompt_tokens, "BEFORE")
