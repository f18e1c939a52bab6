"""vLLM 0.33 config side of the plugin: ``speculative_config={"method": "graft", ...}`` on CPU.

Runs vLLM's real `EngineArgs.create_engine_config` on the CPU platform (reference §6) with
the quick Qwen3 target and EAGLE-3 head; the plugin is found through its
``vllm.general_plugins`` entry point, exactly as in production. Skipped only when vLLM is
not importable (scripts/install_cpu.sh installs it with GRAFT_WITH_VLLM=1, which
scripts/run_tests.sh sets).
"""

from __future__ import annotations

import json
import os
import pickle
from typing import get_args

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (GRAFT_WITH_VLLM=1 bash scripts/install_cpu.sh)")


def _cpu_platform():
    """Resolve vLLM's platform as CpuPlatform (reference §6: the CUDA wheel on a GPU-less box
    is otherwise UnspecifiedPlatform), without leaking VLLM_TARGET_DEVICE into the environment
    of other tests' subprocesses (SGLang imports vllm when it is installed)."""
    old = os.environ.get("VLLM_TARGET_DEVICE")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.platforms import current_platform

        current_platform.device_type  # noqa: B018  (resolves the lazy platform once)
    finally:
        if old is None:
            os.environ.pop("VLLM_TARGET_DEVICE")
    return current_platform


_PLATFORM = _cpu_platform()
from vllm.engine.arg_utils import EngineArgs  # noqa: E402


from vllm_worker.config_patch import graft_config_of, is_graft  # noqa: E402


def _engine_config(models, **spec):
    sc = {"method": "graft", "model": str(models.draft), "num_speculative_tokens": 3, **spec}
    return EngineArgs(model=str(models.target), speculative_config=sc, max_model_len=512,
                      max_num_seqs=4, max_num_batched_tokens=512).create_engine_config()


_TARGET: dict = {}


def _spec_config(models, omit=(), **spec):
    """`SpeculativeConfig(**spec)` through its real validator, as `EngineArgs` builds it
    (engine/arg_utils.py:2100-2139), with the target configs built once per module."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    from vllm_worker.plugin import register

    register()
    if not _TARGET:
        _TARGET["target_model_config"] = ModelConfig(model=str(models.target), max_model_len=512)
        _TARGET["target_parallel_config"] = ParallelConfig()
    sc = {"method": "graft", "model": str(models.draft), "num_speculative_tokens": 3, **spec}
    return SpeculativeConfig(**{k: v for k, v in sc.items() if k not in omit}, **_TARGET)


@pytest.fixture(scope="module")
def graft_engine_config(quick_models):
    return _engine_config(quick_models)


def test_graft_engine_config_on_cpu_platform(graft_engine_config, quick_models):
    cfg = graft_engine_config
    assert _PLATFORM.is_cpu(), "VLLM_TARGET_DEVICE=cpu must select CpuPlatform"
    spec = cfg.speculative_config
    assert spec.method == "eagle3" and is_graft(spec)              # aliased, marked
    g = graft_config_of(spec)
    # the CPU platform verifies trees: N - 1 nodes scheduled after the root, drafted K = 3 levels deep
    assert spec.use_eagle() and spec.num_speculative_tokens == g.num_draft_tokens - 1
    assert spec.draft_model_config.hf_config.architectures == ["LlamaForCausalLMEagle3"]
    assert type(spec.draft_model_config.hf_config).__name__ == "EAGLEConfig"  # vLLM's rewrap
    assert str(quick_models.draft) in spec.model
    assert g.depth == 3                                             # GraftConfig depth = K
    assert spec.disable_padded_drafter_batch is True
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.use_v2_model_runner is False
    assert any("graft" in f for f in cfg._get_v2_model_runner_unsupported_features())
    back = pickle.loads(pickle.dumps(cfg)).speculative_config       # engine core gets a pickle
    assert is_graft(back) and graft_config_of(back) == graft_config_of(spec)


def test_chain_verification_schedules_k_tokens(quick_models, monkeypatch):
    monkeypatch.setenv("GRAFT_VLLM_VERIFY", "chain")
    spec = _spec_config(quick_models)
    assert spec.num_speculative_tokens == 3 and graft_config_of(spec).depth == 3
    again = _spec_config(quick_models, method=spec.method, graft_config=spec.graft_config)
    assert again.num_speculative_tokens == 3


def test_unknown_verify_mode_is_refused(quick_models, monkeypatch):
    monkeypatch.setenv("GRAFT_VLLM_VERIFY", "dag")
    with pytest.raises(ValueError, match="GRAFT_VLLM_VERIFY='dag'"):
        _spec_config(quick_models)


def test_plain_eagle3_is_untouched(quick_models):
    cfg = EngineArgs(model=str(quick_models.target), max_model_len=512, speculative_config={
        "method": "eagle3", "model": str(quick_models.draft), "num_speculative_tokens": 2}).create_engine_config()
    spec = cfg.speculative_config
    assert spec.method == "eagle3" and not is_graft(spec)
    assert spec.disable_padded_drafter_batch is False
    assert not any("graft" in f for f in cfg._get_v2_model_runner_unsupported_features())


def test_graft_settings_from_file_and_environment(quick_models, tmp_path, monkeypatch):
    path = tmp_path / "graft.yaml"
    path.write_text("num_draft_tokens: 20\ntopk: 3\ncheckpoints:\n"
                    "  - {depth: 1, threshold: 0.4, keep: 6}\nretrieval: {suffix_max_depth: 12}\n")
    monkeypatch.setenv("GRAFTCFG_RETRIEVAL__SUCCESSOR_K", "4")
    g = graft_config_of(_spec_config(quick_models, graft_config=str(path)))
    assert (g.num_draft_tokens, g.topk, g.depth) == (20, 3, 3)
    assert g.checkpoints[0].keep == 6 and g.retrieval.suffix_max_depth == 12
    assert g.retrieval.successor_k == 4                              # environment over file
    monkeypatch.setenv("GRAFT_CONFIG", str(path))                    # file named by the env
    assert graft_config_of(_spec_config(quick_models)).num_draft_tokens == 20


def test_inline_json_config_and_rebuild_from_resolved_config(quick_models, monkeypatch):
    monkeypatch.setenv("GRAFTCFG_TOPK", "5")                        # ignored by inline JSON
    spec = _spec_config(quick_models, graft_config='{"topk": 3, "num_draft_tokens": 14}')
    g = graft_config_of(spec)
    assert (g.topk, g.num_draft_tokens, g.depth) == (3, 14, 3)
    # the resolved config stays in the field: rebuilding the config from its fields
    # (method is now "eagle3") gives the same graft config, whatever the environment says
    monkeypatch.setenv("GRAFTCFG_TOPK", "6")
    again = _spec_config(quick_models, method=spec.method, graft_config=spec.graft_config)
    assert is_graft(again) and graft_config_of(again) == g


def test_k_defaults_to_graft_depth(quick_models, tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"depth": 5, "num_draft_tokens": 30}))
    spec = _spec_config(quick_models, omit=("num_speculative_tokens",), graft_config=str(path))
    assert spec.num_speculative_tokens == 29 and graft_config_of(spec).depth == 5   # trees: N - 1, K levels


@pytest.mark.parametrize("content, field", [
    ({"topk": 1}, "topk"),
    ({"num_draft_tokens": 1}, "num_draft_tokens"),
    ({"retrieval": {"suffix_max_match": 70}}, "suffix_max_match"),
    ({"checkpoints": [{"depth": 9, "threshold": 0.5, "keep": 4}]}, "checkpoints[0].depth"),
    ({"bogus_knob": 3}, "bogus_knob"),
    ({"depth": 4}, "depth=4 must equal num_speculative_tokens=3"),
])
def test_invalid_graft_settings_name_the_field(quick_models, tmp_path, content, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as e:
        _spec_config(quick_models, graft_config=str(path))
    msg = str(e.value)
    assert "speculative_config.graft_config" in msg and field in msg, msg


def test_invalid_graft_env_names_the_field(quick_models, monkeypatch):
    monkeypatch.setenv("GRAFTCFG_TOPK", "0")
    with pytest.raises(ValueError, match=r"(?s)graft_config.*topk"):
        _spec_config(quick_models)


@pytest.mark.parametrize("spec, field", [
    ({"draft_sample_method": "probabilistic"}, "draft_sample_method"),
    ({"rejection_sample_method": "synthetic"}, "rejection_sample_method"),
    ({"model": None}, "speculative_config.model"),
    ({"graft_config": "/nonexistent/graft.yaml"}, "No such file"),
    # issue 45 (e): the local-argmax path skips the hook graft reads the draft's top-k from
    ({"use_local_argmax_reduction": True}, "use_local_argmax_reduction"),
])
def test_vllm_settings_graft_refuses(quick_models, spec, field):
    with pytest.raises(ValueError, match=field):
        _spec_config(quick_models, **spec)


def test_graft_config_key_only_with_graft(quick_models):
    with pytest.raises(ValueError, match="only valid with method='graft'"):
        _spec_config(quick_models, method="eagle3", graft_config="x.yaml")


def test_v2_runner_forced_on_is_refused(quick_models, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="V1 model runner"):
        _spec_config(quick_models)


def test_register_is_idempotent():
    from vllm.config import SpeculativeConfig
    from vllm.config.vllm import VllmConfig

    from vllm_worker import plugin

    plugin.register()
    before = (SpeculativeConfig.__post_init__, VllmConfig._get_v2_model_runner_unsupported_features)
    plugin._registered = False          # force the patch functions to run again
    plugin.register()
    plugin.register()
    after = (SpeculativeConfig.__post_init__, VllmConfig._get_v2_model_runner_unsupported_features)
    assert before == after
    method = SpeculativeConfig.__dataclass_fields__["method"].type
    literal = next(a for a in get_args(method) if a is not type(None))
    assert list(get_args(literal)).count("graft") == 1
    assert not hasattr(SpeculativeConfig.__post_init__.__wrapped__, "__wrapped__")


def _hf(top=None, nested=None):
    from types import SimpleNamespace

    hf = SimpleNamespace(eagle_config={"use_aux_hidden_state": True} | (
        {"eagle_aux_hidden_state_layer_ids": nested} if nested is not None else {}))
    if top is not None:
        hf.eagle_aux_hidden_state_layer_ids = top
    return SimpleNamespace(method="eagle3", draft_model_config=SimpleNamespace(hf_config=hf))


@pytest.mark.parametrize("spec, want", [
    (_hf(nested=[0, 2, 4]), (1, 3, 5)),             # scripts/make_models.py heads (SGLang: outputs of 0, 2, 4)
    (_hf(nested=[1, 23, 44]), (2, 24, 45)),          # SpecForge defaults for 48 layers = both engines' default
    (_hf(nested=[2, 18, 33]), None),                 # input-of-layer heads (sgl-project/sglang#25454) as they are
    (_hf(), None),                                   # no ids: both engines default to (2, L // 2, L - 3)
    (_hf(top=[1, 3, 5], nested=[0, 2, 4]), None),    # speculators format (vLLM's own convention) wins
])
def test_eagle3_aux_layer_ids_read_as_sglang_reads_them(spec, want):
    """Issue 45 (a): the same head captures the same target layers in both engines."""
    from vllm_worker.config_patch import translate_aux_layer_ids

    before = getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None)
    assert translate_aux_layer_ids(spec) == want
    after = getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None)
    assert after == (list(want) if want else before)
    assert translate_aux_layer_ids(spec) is None                   # idempotent (configs are re-validated)


@pytest.mark.parametrize("method", ["eagle3", "graft"])
def test_engine_config_reads_the_quick_head_aux_ids_as_sglang(quick_models, method):
    cfg = EngineArgs(model=str(quick_models.target), max_model_len=512, speculative_config={
        "method": method, "model": str(quick_models.draft), "num_speculative_tokens": 4}).create_engine_config()
    hf = cfg.speculative_config.draft_model_config.hf_config
    nested = hf.eagle_config["eagle_aux_hidden_state_layer_ids"]
    assert hf.eagle_aux_hidden_state_layer_ids == [i + 1 for i in nested]
