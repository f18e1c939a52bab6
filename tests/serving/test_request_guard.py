"""No server: ``sglang_patch.request_guard`` (400 instead of a scheduler crash for prompts the model
cannot take). The server-level check is tests/serving/test_serving_faults.py::test_bad_requests_get_clear_4xx."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_patch.request_guard import TARGET, check_prompt_tokens, prompt_problem

MANAGER = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))


def _req(**fields):
    base = {"input_embeds": None, "image_data": None, "video_data": None, "audio_data": None}
    return SimpleNamespace(**{**base, **fields})


def test_prompt_problem():
    assert prompt_problem([1, 2, 99], 100) is None
    assert "empty" in prompt_problem([], 100)
    assert "[0, 100)" in prompt_problem([1, 100], 100)
    assert "-1" in prompt_problem([-1, 5], 100)
    assert prompt_problem([5000], None) is None  # range unknown: only emptiness is checked
    assert prompt_problem(None, 100) is None


@pytest.mark.parametrize("ids", [[], [3, -2], [3, 100], [100000]])
def test_hook_rejects_with_value_error(ids):
    with pytest.raises(ValueError, match="Invalid prompt"):
        check_prompt_tokens(MANAGER, _req(), ids)


def test_hook_passes_valid_embedding_and_multimodal_requests():
    assert check_prompt_tokens(MANAGER, _req(), [0, 1, 99]) is None
    assert check_prompt_tokens(MANAGER, _req(input_embeds=[[0.0]]), []) is None
    # multimodal ids may carry placeholder values: only emptiness is checked
    assert check_prompt_tokens(MANAGER, _req(image_data=["x.png"]), [5, 123456]) is None
    with pytest.raises(ValueError):
        check_prompt_tokens(MANAGER, _req(image_data=["x.png"]), [])


def test_target_is_sglang_validation_method():
    import importlib

    module, cls, meth = TARGET.rsplit(".", 2)
    assert meth == "_validate_one_request" and cls == "TokenizerManager"
    import inspect

    fn = getattr(getattr(importlib.import_module(module), cls), meth)
    params = list(inspect.signature(fn).parameters)
    assert params[:3] == ["self", "obj", "input_ids"], params
