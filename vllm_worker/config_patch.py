"""Teach vLLM 0.33's `SpeculativeConfig` the method ``"graft"``.

vLLM keys EAGLE-3 behaviour (draft KV cache, aux hidden states, block drop, the
``EAGLEConfig`` rewrap) on the literal method string in ~20 places
(vllm-0.33-spec-internals.md §4 step 3), so ``"graft"`` is accepted by the validator and
then *aliased* to ``"eagle3"``; the validated `GraftConfig` is kept in the new
``graft_config`` field as inline JSON, which is what marks the config as Graft
(`is_graft`, `graft_config_of`). Everything vLLM does for EAGLE-3 stays on.

Patches (all on ``vllm.config.speculative.SpeculativeConfig``, applied once):

1. ``method``: the ``Literal`` annotation (config/speculative.py:74-82, field :419) is
   widened with ``"graft"``.
2. New optional field ``graft_config: str | None`` — path to a JSON/YAML `GraftConfig`
   file, or an inline JSON object. The class forbids extra keys (config/utils.py:71), so
   the field is added the same way as (1). Settings can also come from ``GRAFTCFG_*``
   environment variables (`graft_spec.config.load_config`: file < environment; an inline
   JSON object is used on its own).
   After validation the field holds the resolved config as inline JSON: that marks the
   config as Graft without private attributes, and a config rebuilt from its fields
   (``method="eagle3"`` + that JSON) is the same graft config.
3. ``__post_init__`` (config/speculative.py:1226) is wrapped: for ``"graft"`` it loads and
   validates the `GraftConfig`, checks the vLLM settings Graft needs (below), sets
   ``method = "eagle3"``, runs vLLM's own validation, then stores the resolved config.
   For every ``eagle3`` config (graft or not) the wrapper then reads an EAGLE-3 head's aux-layer
   ids as SGLang does (`translate_aux_layer_ids`), so one head drafts alike in both engines.
4. ``VllmConfig._get_v2_model_runner_unsupported_features`` (config/vllm.py:3053-3088)
   reports Graft, so vLLM selects the V1 runner and logs why (config/vllm.py:756-762).

Settings forced or checked for ``"graft"`` (and why):

* ``disable_padded_drafter_batch = True``: the proposer then runs after the runner's
  bookkeeping (gpu_model_runner.py:4345-4455), so ``input_batch.token_ids_cpu`` already
  holds this step's accepted tokens, which retrieval must index before proposing.
  This also turns async scheduling off (config/vllm.py:1663-1664).
* ``draft_sample_method = "greedy"`` and ``rejection_sample_method = "standard"``: the
  chain is a deterministic function of the context, so vLLM verifies it with a one-hot q
  (rejection_sampler.py:896-967) and stays lossless. Other values are refused.
* ``num_speculative_tokens`` (K) = longest chain = EAGLE draft depth; it defaults to
  ``GraftConfig.depth``, and a graft file that sets ``depth`` must agree with K.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Literal, Optional, get_args

from graft_spec.config import GraftConfig, load_config

__all__ = ["GRAFT_METHOD", "patch_speculative_config", "graft_config_of", "is_graft", "translate_aux_layer_ids",
           "tree_verify_enabled"]

GRAFT_METHOD = "graft"
_PATCHED_FLAG = "_graft_spec_patched"
logger = logging.getLogger("vllm.graft")  # child of vLLM's logger: same handler and format


def is_graft(spec_config: Any) -> bool:
    """True for a `SpeculativeConfig` built from ``method="graft"``.

    The mark is the config's own state (``method == "eagle3"`` and ``graft_config`` holding
    the resolved inline JSON), not a private attribute, so it survives pickling to the
    engine core and anything that rebuilds the config from its fields.
    """
    return getattr(spec_config, "method", None) == "eagle3" and _is_inline(getattr(spec_config, "graft_config", None))


def graft_config_of(spec_config: Any):
    """The validated `graft_spec.config.GraftConfig` of a graft `SpeculativeConfig`.

    Raises:
        ValueError: ``spec_config`` was not built from ``method="graft"``.
    """
    if not is_graft(spec_config):
        raise ValueError("speculative_config was not built with method='graft'")

    return GraftConfig.model_validate_json(spec_config.graft_config)


def load_graft_settings(path: Optional[str], num_speculative_tokens: Optional[int]):
    """Load + validate the `GraftConfig` for a graft `SpeculativeConfig`.

    Args:
        path: ``speculative_config["graft_config"]``: a JSON/YAML file, an inline JSON
            object (``'{"topk": 3}'``, used on its own, no environment), or None
            (``GRAFT_CONFIG`` and ``GRAFTCFG_*`` from the environment are then used).
        num_speculative_tokens: vLLM's K, or None when the user left it unset.
    Returns:
        ``GraftConfig`` whose ``depth`` equals K (K unset -> the config's depth).
    Raises:
        ValueError: messages start with ``speculative_config.graft_config`` and name the
            offending field (pydantic's message is included).
    """
    from pydantic import ValidationError


    inline = _is_inline(path)
    src = "inline JSON" if inline else (path or os.environ.get("GRAFT_CONFIG") or "GRAFTCFG_* env")
    where = f"speculative_config.graft_config ({src})"
    try:
        cfg = load_config(overrides=json.loads(path), env=False) if inline else load_config(file=path)
        if num_speculative_tokens is not None and cfg.depth != num_speculative_tokens:
            if "depth" in cfg.model_fields_set:
                raise ValueError(
                    f"{where}: depth={cfg.depth} must equal num_speculative_tokens="
                    f"{num_speculative_tokens} (vLLM verifies one chain of at most K tokens; "
                    "the EAGLE-3 head drafts K levels)")
            cfg = GraftConfig.model_validate({**cfg.model_dump(), "depth": num_speculative_tokens})
    except ValidationError as e:
        raise ValueError(f"{where} is invalid: {e}") from None
    except (OSError, ValueError) as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    return cfg


def tree_verify_enabled() -> bool:
    """Whether graft's trees are verified as trees: ``GRAFT_VLLM_VERIFY=tree`` (the default on the
    CPU platform, vllm_worker/tree_attention.py; opt-in on CUDA, vllm_worker/tree_attention_gpu.py,
    whose FlashAttention path has not run on a GPU in this project's checks) or ``chain`` (one chain per
    request, the default off the CPU platform).

    Raises:
        ValueError: another value, or ``tree`` on a platform other than the CPU and CUDA.
    """
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    mode = os.environ.get("GRAFT_VLLM_VERIFY", "tree" if cpu else "chain")
    if mode not in ("tree", "chain"):
        raise ValueError(f"GRAFT_VLLM_VERIFY={mode!r}: expected 'tree' or 'chain'")
    if mode == "tree" and not (cpu or current_platform.is_cuda()):
        raise ValueError("GRAFT_VLLM_VERIFY=tree: tree attention exists for vLLM's CPU and CUDA (FlashAttention) "
                         "backends only; use 'chain' on this platform")
    if mode == "tree" and not cpu:
        logger.warning("graft: GRAFT_VLLM_VERIFY=tree on CUDA: FlashAttention plus graft's Triton tree "
                       "attention (vllm_worker/tree_attention_gpu.py); its kernel is checked against the "
                       "reference by scripts/device_check.sh, the backend has not run on a GPU here")
    return mode == "tree"


def _is_inline(value: Optional[str]) -> bool:
    return isinstance(value, str) and value.lstrip().startswith("{")


def _check_vllm_settings(cfg: Any) -> None:
    """Refuse vLLM settings under which the graft chain would be wrong or lossy."""
    if cfg.model is None:
        raise ValueError("speculative_config.model is required for method='graft': "
                         "the path of an EAGLE-3 draft head (LlamaForCausalLMEagle3)")
    if cfg.draft_sample_method != "greedy":
        raise ValueError("speculative_config.draft_sample_method must be 'greedy' for method='graft' "
                         "(grafted/pruned chains have no draft distribution q; vLLM then uses a "
                         f"one-hot q, which is lossless), got {cfg.draft_sample_method!r}")
    if cfg.rejection_sample_method != "standard":
        raise ValueError("speculative_config.rejection_sample_method must be 'standard' for "
                         f"method='graft' (lossless), got {cfg.rejection_sample_method!r}")
    if getattr(cfg, "use_local_argmax_reduction", False):
        raise ValueError("speculative_config.use_local_argmax_reduction is not supported with method='graft': "
                         "graft reads the draft's top-k log-probs from the full logits of every draft pass "
                         "(GraftProposer._greedy_sample replaces the local-argmax path, "
                         "llm_base_proposer.py:437-450)")
    if getattr(cfg, "use_heterogeneous_vocab", False):
        raise ValueError("speculative_config.use_heterogeneous_vocab is not supported with method='graft'")
    if getattr(cfg, "parallel_drafting", False):
        raise ValueError("speculative_config.parallel_drafting is not supported with method='graft'")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise ValueError("method='graft' needs the V1 model runner (GraftProposer extends the V1 "
                         "EagleProposer); unset VLLM_USE_V2_MODEL_RUNNER")


def translate_aux_layer_ids(spec_config: Any) -> Optional[tuple]:
    """Read an EAGLE-3 head's ``eagle_config.eagle_aux_hidden_state_layer_ids`` as SGLang does.

    The two engines number the captured target layers differently: SGLang 0.5.23 captures the
    *output* of layer k (``layers_to_capture = [k + 1 ...]``, models/qwen3.py:790-791, models/llama.py
    alike), vLLM the *input* of layer k (`_maybe_add_hidden_state` at index ``idx + 1`` after layer
    ``idx``, models/qwen2.py:423-434; ids read as they are in gpu_model_runner.py
    `_get_eagle3_aux_layers_from_config`), one layer early. Heads whose ids sit in ``eagle_config``
    and start at 0 or 1 are in the output-of-layer convention (SpecForge / SGLang-trained heads,
    ``scripts/make_models.py``; SGLang's own rule, sgl-project/sglang#25454: a first id of 1 means
    output-of-layer, 0 would be the embeddings as an input): for them the ids + 1 are set as the
    config's top-level ``eagle_aux_hidden_state_layer_ids``, which both vLLM runners read first
    (and which enters vLLM's compile hash, config/speculative.py:636-645). Left as they are: heads
    without ids (both engines default to the same ``(2, L // 2, L - 3)`` inputs), a top-level id
    list (the `speculators` format, vLLM's convention), and ids starting at 2 or more.

    Args:
        spec_config: a validated `SpeculativeConfig` (any method; only ``eagle3`` is touched).
    Returns:
        The translated ids, or None when nothing was changed.
    """
    dm = getattr(spec_config, "draft_model_config", None)
    if getattr(spec_config, "method", None) != "eagle3" or dm is None:
        return None
    hf = dm.hf_config
    if getattr(hf, "eagle_aux_hidden_state_layer_ids", None):
        return None
    ec = getattr(hf, "eagle_config", None)
    ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
    if not ids or min(int(i) for i in ids) > 1:
        return None
    new = [int(i) + 1 for i in ids]
    setattr(hf, "eagle_aux_hidden_state_layer_ids", new)
    logger.info("graft plugin: EAGLE-3 head eagle_config.eagle_aux_hidden_state_layer_ids=%s are outputs of "
                "those target layers (SGLang's reading); vLLM captures layer inputs, so using %s",
                list(ids), new)
    return tuple(new)


def _wrap_post_init(cls: type) -> None:
    original = cls.__post_init__

    def __post_init__(self) -> None:
        replayed = self.method == "eagle3" and _is_inline(getattr(self, "graft_config", None))
        if self.method != GRAFT_METHOD and not replayed:
            if getattr(self, "graft_config", None) is not None:
                raise ValueError("speculative_config.graft_config is only valid with method='graft' "
                                 f"(method={self.method!r})")
            original(self)
            translate_aux_layer_ids(self)
            return
        trees = tree_verify_enabled()
        if replayed and trees:   # rebuilt from a resolved tree config: K lives in the graft config
            gcfg = GraftConfig.model_validate_json(self.graft_config)
        else:
            gcfg = load_graft_settings(self.graft_config, self.num_speculative_tokens)
        _check_vllm_settings(self)
        # chains: K tokens after the root; trees: N - 1 nodes after the root, drafted K levels deep
        self.num_speculative_tokens = gcfg.num_draft_tokens - 1 if trees else gcfg.depth
        if not self.disable_padded_drafter_batch:
            logger.info("graft: setting disable_padded_drafter_batch=True so the proposer runs after "
                        "bookkeeping and sees this step's accepted tokens (async scheduling goes off)")
            self.disable_padded_drafter_batch = True
        self.method = "eagle3"
        original(self)
        if self.method != "eagle3":  # vLLM must not have re-detected another method
            raise ValueError(f"method='graft' needs an EAGLE-3 draft head; vLLM resolved {self.method!r}")
        translate_aux_layer_ids(self)
        self.graft_config = gcfg.model_dump_json()  # the mark read by is_graft / graft_config_of
        if trees:
            logger.info("graft: speculative method 'graft' = EAGLE-3 draft tree (%d levels, topk=%d) + prune + "
                        "graft, one tree of N=%d nodes per request verified as a tree "
                        "(num_speculative_tokens=%d); V1 model runner", gcfg.depth, gcfg.topk,
                        gcfg.num_draft_tokens, self.num_speculative_tokens)
        else:
            logger.info("graft: speculative method 'graft' = EAGLE-3 draft tree + prune + graft, one chain "
                        "of <= %d tokens per request (N=%d, topk=%d); using the V1 model runner because "
                        "GraftProposer extends the V1 EagleProposer and vLLM 0.33 verifies chains only",
                        self.num_speculative_tokens, gcfg.num_draft_tokens, gcfg.topk)

    __post_init__.__qualname__ = f"{cls.__qualname__}.__post_init__"
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def _widen_method(cls: type) -> None:
    field = cls.__dataclass_fields__["method"]
    old = field.type
    literal = next(a for a in get_args(old) if a is not type(None))
    if GRAFT_METHOD in get_args(literal):
        return
    new = Optional[Literal[GRAFT_METHOD, literal]]  # nested Literals flatten
    field.type = new
    cls.__annotations__["method"] = new
    cls.__pydantic_fields__["method"].annotation = new


def _add_graft_config_field(cls: type) -> None:
    if "graft_config" in cls.__dataclass_fields__:
        return
    from pydantic.fields import FieldInfo

    ann = Optional[str]
    f = dataclasses.field(default=None)
    f.name, f.type = "graft_config", ann
    f._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
    cls.__dataclass_fields__["graft_config"] = f
    cls.__annotations__["graft_config"] = ann
    cls.__pydantic_fields__["graft_config"] = FieldInfo.from_annotated_attribute(ann, None)
    cls.graft_config = None


def _patch_runner_choice() -> None:
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if getattr(original, "_graft", False):
        return

    def _get_v2_model_runner_unsupported_features(self) -> list[str]:
        out = original(self)
        if is_graft(self.speculative_config):
            out.append("speculative method 'graft' (its GraftProposer extends the V1 EagleProposer)")
        return out

    _get_v2_model_runner_unsupported_features._graft = True  # type: ignore[attr-defined]
    VllmConfig._get_v2_model_runner_unsupported_features = _get_v2_model_runner_unsupported_features


def patch_speculative_config() -> None:
    """Apply patches 1-4 (module docstring). Idempotent; touches only vLLM classes."""
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config.speculative import SpeculativeConfig as cls

    _patch_runner_choice()
    if cls.__dict__.get(_PATCHED_FLAG):
        return
    _wrap_post_init(cls)
    _widen_method(cls)
    _add_graft_config_field(cls)
    rebuild_dataclass(cls, force=True)
    setattr(cls, _PATCHED_FLAG, True)
