"""Graft settings for SGLang: ``--graft-*`` CLI flags, config loading, server-argument defaults.

One way to configure (STYLE.md): every source ends in ``graft_spec.config.load_config`` and thus in
``GraftConfig.model_validate``. Precedence, lowest first: GraftConfig defaults < config file
(``--graft-config`` or ``GRAFT_CONFIG``) < ``GRAFTCFG_<FIELD>`` environment variables (nested
fields with ``__``; a prefix of their own, so tooling variables such as ``GRAFT_VENV`` never parse as
configuration) < ``--graft-<field>`` flags (nested fields with ``-``: ``--graft-retrieval-suffix-max-depth``).
Convenience flags: ``--graft-budget N`` (= ``num_draft_tokens``) and
``--graft-retrieval successor,suffix,lookup,outputs[,corpus]|none``.

The tree shape is shared with SGLang: ``GraftConfig.num_draft_tokens / topk / depth`` are
``--speculative-num-draft-tokens / --speculative-eagle-topk / --speculative-num-steps``. SGLang's
flags win when given; the graft config supplies them otherwise; a conflict between two explicit
values is an error.

SGLang cannot grow ``ServerArgs`` fields from a plugin (``msgspec.defstruct``,
``server_args.py:522``), so the flags are added by an ``AFTER`` hook on ``ServerArgs.add_cli_args``
and their values are stashed by an ``AFTER`` hook on ``ServerArgs.from_cli_args`` as the underscore
attribute ``_graft_cli`` (allowed bookkeeping, ``server_args.py:474``; pickled into the scheduler
processes by ``__reduce__``, ``:652``). ``Engine(**kwargs)`` rejects unknown keywords, which is what
the environment fallback is for.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml

from graft_spec.config import ENV_FILE, ENV_PREFIX, GraftConfig, load_config, merge_config_sources, read_config_file
from graft_spec.retrieval.corpus import check_corpus_file

logger = logging.getLogger(__name__)

#: Record attribute holding the ``--graft-*`` values (underscore: bookkeeping, survives pickling).
CLI_ATTR = "_graft_cli"
#: argparse ``dest`` prefix of the generated flags.
_DEST = "graft__"
#: Server defaults applied to graft like SGLang applies them to EAGLE (speculative_hook.py:1086).
DEFAULT_MAX_RUNNING_REQUESTS = 48
#: Fields shared with SGLang's tree-shape flags: GraftConfig field -> ServerArgs field.
SHARED_SHAPE = {
    "num_draft_tokens": "speculative_num_draft_tokens",
    "topk": "speculative_eagle_topk",
    "depth": "speculative_num_steps",
}
_RETRIEVAL_SOURCES = ("successor", "suffix", "corpus", "lookup", "outputs")


class GraftSettingsError(ValueError):
    """An invalid graft setting; the message names the field and where its value came from."""


# --------------------------------------------------------------------------------------------------
# GraftConfig fields <-> flags / environment names
# --------------------------------------------------------------------------------------------------
def _config_class():
    return GraftConfig


def config_field_paths(model=None, prefix: Tuple[str, ...] = ()) -> List[Tuple[str, ...]]:
    """Leaf field paths of GraftConfig, e.g. ``[("num_draft_tokens",), ("retrieval", "suffix")]``.

    A field whose type is itself a pydantic model is expanded; lists/tuples of models (e.g.
    ``checkpoints``) stay one leaf that takes a YAML/JSON list.
    """
    from pydantic import BaseModel

    model = model or _config_class()
    paths: List[Tuple[str, ...]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            paths.extend(config_field_paths(ann, prefix + (name,)))
        else:
            paths.append(prefix + (name,))
    return paths


def flag_name(path: Tuple[str, ...]) -> str:
    """``("retrieval", "suffix_max_depth")`` -> ``--graft-retrieval-suffix-max-depth``."""
    return "--graft-" + "-".join(p.replace("_", "-") for p in path)


def env_name(path: Tuple[str, ...]) -> str:
    """``("retrieval", "suffix_max_depth")`` -> ``GRAFTCFG_RETRIEVAL__SUFFIX_MAX_DEPTH``."""
    return ENV_PREFIX + "__".join(p.upper() for p in path)


def parse_value(text: str) -> Any:
    """A flag value parsed like the environment (``yaml.safe_load``: ints, floats, bools, lists)."""
    return yaml.safe_load(text) if text.strip() else None


def _retrieval_flag(text: str) -> Dict[str, bool]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        names = []
    unknown = sorted(set(names) - set(_RETRIEVAL_SOURCES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--graft-retrieval: unknown source(s) {unknown}; use a comma list of "
            f"{', '.join(_RETRIEVAL_SOURCES)} or 'none'"
        )
    return {name: name in names for name in _RETRIEVAL_SOURCES}


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


#: Key of ``_graft_cli`` holding the launcher's snapshot of the config file and environment.
SNAPSHOT = "__snapshot__"


def snapshot_sources(cli: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The config file's content and the ``GRAFTCFG_*`` / ``GRAFT_CONFIG`` environment as the launcher
    sees them, to ship with the server arguments: every scheduler (every TP / DP rank, every node)
    then builds the config from the same values instead of reading its own file and environment.

    Raises:
        GraftSettingsError: the config file cannot be read.
    """
    env = {k: v for k, v in _environ(environ).items() if k.startswith(ENV_PREFIX) or k == ENV_FILE}
    file = cli.get("config") or env.get(ENV_FILE)
    try:
        data = read_config_file(file) if file else None
    except (OSError, ValueError) as exc:
        raise GraftSettingsError(f"invalid graft setting: {exc}") from None
    return {"file": file, "file_data": data, "env": env}


def _sources(cli: Optional[Mapping[str, Any]], environ: Optional[Mapping[str, str]]):
    """``(flags, file, file_data, env)``: from the shipped snapshot when there is one (and no explicit
    ``environ``), else from this process's file and environment."""
    flags = dict(cli or {})
    snap = flags.pop(SNAPSHOT, None)
    file = flags.pop("config", None)
    if snap is not None and environ is None:
        return flags, snap["file"], snap["file_data"], snap["env"]
    return flags, file, None, _environ(environ)


def _describe_origin(loc: Tuple[str, ...], cli: Mapping[str, Any], env: Mapping[str, str],
                     file: Optional[str]) -> str:
    """Where the value at ``loc`` came from: the longest field prefix set by a flag, else by an
    environment variable, else the config file, else the GraftConfig default."""
    for depth in range(len(loc), 0, -1):
        if ".".join(loc[:depth]) in cli:
            return "--graft-budget" if loc[:depth] == ("num_draft_tokens",) else flag_name(loc[:depth])
    for depth in range(len(loc), 0, -1):
        if env_name(loc[:depth]) in env:
            return env_name(loc[:depth])
    return f"config file {file}" if file else "default"


def build_graft_config(cli: Optional[Mapping[str, Any]] = None,
                       environ: Optional[Mapping[str, str]] = None,
                       shape: Optional[Mapping[str, int]] = None):
    """Validated GraftConfig from file < environment < CLI (< ``shape``), via ``load_config``.

    Args:
        cli: the ``_graft_cli`` dict: ``{"config": path, "num_draft_tokens": 24,
            "retrieval.suffix": False, ...}`` (dotted keys for nested fields).
        environ: environment mapping (default ``os.environ``).
        shape: final tree shape from SGLang (``num_draft_tokens`` / ``topk`` / ``depth``), applied
            last so the config validators (e.g. checkpoint ``keep < N``) see the real shape.

    Returns:
        ``graft_spec.config.GraftConfig``.

    Raises:
        GraftSettingsError: one message listing every invalid field, its value and its source.
    """
    from pydantic import ValidationError

    cli, file, file_data, env = _sources(cli, environ)
    overrides = dict(cli)
    overrides.update(dict(shape or {}))
    try:
        return load_config(file=file, overrides=overrides, env=True, environ=env, file_data=file_data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(str(x) for x in err.get("loc", ()) if not isinstance(x, int))
            field = ".".join(str(x) for x in err.get("loc", ())) or "<config>"
            if shape and loc and loc[0] in shape:
                origin = f"--{SHARED_SHAPE[loc[0]].replace('_', '-')}"
            else:
                origin = _describe_origin(loc, cli, env, file or env.get("GRAFT_CONFIG"))
            value = err.get("input")
            shown = f" = {value!r}" if not isinstance(value, dict) else ""
            problems.append(f"{field}{shown} (from {origin}): {err.get('msg')}")
        raise GraftSettingsError("invalid graft setting: " + "; ".join(problems)) from None
    except (OSError, ValueError) as exc:  # file missing / unreadable / bad suffix / bad env section
        raise GraftSettingsError(f"invalid graft setting: {exc}") from None


# --------------------------------------------------------------------------------------------------
# SGLang hooks: CLI
# --------------------------------------------------------------------------------------------------
def add_graft_cli_args(result, parser: argparse.ArgumentParser):
    """``AFTER`` hook on ``ServerArgs.add_cli_args(parser)``: ``--graft-config``, ``--graft-budget``,
    ``--graft-retrieval`` and one ``--graft-<field>`` per GraftConfig leaf. Returns None."""
    if any(a.dest == _DEST + "config" for a in parser._actions):
        return None
    group = parser.add_argument_group("graft speculative decoding (graft-spec plugin)")
    group.add_argument("--graft-config", dest=_DEST + "config", default=None, metavar="PATH",
                       help="JSON/YAML GraftConfig file (environment: GRAFT_CONFIG).")
    group.add_argument("--graft-budget", dest=_DEST + "num_draft_tokens", default=None, type=int,
                       metavar="N", help="Verify budget N, root included (= GraftConfig.num_draft_tokens;"
                       " SGLang's --speculative-num-draft-tokens).")
    group.add_argument("--graft-retrieval", dest=_DEST + "retrieval", default=None,
                       type=_retrieval_flag, metavar="SOURCES",
                       help="Retrieval sources: comma list of successor,suffix,lookup,outputs,corpus or 'none' "
                       "(a listed source is on, an unlisted one off; outputs listed = on for every row, "
                       "its default is greedy rows: --graft-retrieval-outputs greedy).")
    try:
        paths = config_field_paths()
    except Exception as exc:  # graft_spec missing or broken: keep SGLang usable for other algorithms
        logger.warning("graft flags unavailable (%s)", exc)
        return None
    for path in paths:
        if path == ("num_draft_tokens",):
            continue  # --graft-budget covers it, and --graft-num-draft-tokens is added as an alias below
        group.add_argument(flag_name(path), dest=_DEST + ".".join(path), default=None,
                           type=parse_value, metavar="VALUE",
                           help=f"GraftConfig.{'.'.join(path)} (environment: {env_name(path)}).")
    group.add_argument("--graft-num-draft-tokens", dest=_DEST + "num_draft_tokens", default=None,
                       type=int, metavar="N", help=argparse.SUPPRESS)
    return None


def graft_cli_values(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``--graft-*`` values of a parsed namespace as ``{dotted field: value}`` (+ ``config``)."""
    cli: Dict[str, Any] = {}
    for key, value in vars(args).items():
        if not key.startswith(_DEST) or value is None:
            continue
        name = key[len(_DEST):]
        if name == "retrieval":  # --graft-retrieval: per-source booleans, explicit flags win
            for src, on in value.items():
                cli.setdefault(f"retrieval.{src}", on)
            continue
        cli[name] = value
    return cli


def stash_graft_cli_args(result, cls, args: argparse.Namespace):
    """``AFTER`` hook on ``ServerArgs.from_cli_args``: store ``--graft-*`` values on the record as
    ``_graft_cli``; with ``--speculative-algorithm graft``, validate them now so a bad value fails
    the launch with one clear message (the full check, with the tree shape, runs again in
    ``GraftSpec.handle_server_args``).

    Raises:
        GraftSettingsError: invalid graft settings.
    """
    cli = graft_cli_values(args)
    algo = getattr(result, "speculative_algorithm", None)
    if algo is not None and str(algo).upper() == "GRAFT":
        cli[SNAPSHOT] = snapshot_sources(cli)
        setattr(result, CLI_ATTR, cli)
        effective_graft_config(result)
        return None
    setattr(result, CLI_ATTR, cli)
    if len(cli) > 0:
        logger.warning("--graft-* flags given without --speculative-algorithm graft; ignored")
    return None


# --------------------------------------------------------------------------------------------------
# SGLang hook: server-argument resolution (GraftSpec.handle_server_args)
# --------------------------------------------------------------------------------------------------
def _explicit_shape(cli: Mapping[str, Any], environ: Optional[Mapping[str, str]]) -> Dict[str, int]:
    """Tree-shape values the user set for graft (flag, environment or file), not defaults.

    Read from the merged sources before validation: the rest of the config may only be valid with
    SGLang's shape (e.g. a checkpoint deeper than the default ``depth``).
    """
    cli, file, file_data, env = _sources(cli, environ)
    try:
        raw = merge_config_sources(file=file, overrides=cli, env=True, environ=env, file_data=file_data)
    except (OSError, ValueError) as exc:
        raise GraftSettingsError(f"invalid graft setting: {exc}") from None
    return {f: raw[f] for f in SHARED_SHAPE if raw.get(f) is not None}


def resolve_tree_shape(sa, environ: Optional[Mapping[str, str]] = None) -> Dict[str, int]:
    """The tree shape graft runs with: SGLang flags first, then the graft config, then defaults.

    Args:
        sa: ServerArgs, or SGLang's resolving view / stand-in of one.
        environ: environment mapping (tests).
    Returns:
        ``{"num_draft_tokens": N, "topk": k, "depth": d}``.
    Raises:
        GraftSettingsError: an explicit graft value contradicts an explicit SGLang flag.
    """
    cli = getattr(sa, CLI_ATTR, None) or {}
    explicit = _explicit_shape(cli, environ)

    shape: Dict[str, int] = {}
    for field, sa_field in SHARED_SHAPE.items():
        sg_value = getattr(sa, sa_field, None)
        if sg_value is not None and field in explicit and explicit[field] != sg_value:
            raise GraftSettingsError(
                f"invalid graft setting: {field} = {explicit[field]} (graft config) contradicts "
                f"--{sa_field.replace('_', '-')} = {sg_value}; set one of them"
            )
        if sg_value is not None:
            shape[field] = int(sg_value)
        else:  # validated (with the rest of the config) by effective_graft_config
            shape[field] = explicit.get(field, GraftConfig.model_fields[field].default)
    return shape


def effective_graft_config(sa, environ: Optional[Mapping[str, str]] = None):
    """GraftConfig with the tree shape SGLang resolved (used by the worker and by validation)."""
    resolve_tree_shape(sa, environ)  # raises on a graft value that contradicts an SGLang flag
    sglang_shape = {f: int(getattr(sa, sa_f)) for f, sa_f in SHARED_SHAPE.items()
                    if getattr(sa, sa_f, None) is not None}
    return build_graft_config(getattr(sa, CLI_ATTR, None), environ, shape=sglang_shape)


#: Attention backends that verify trees with topk > 1 and page_size > 1 (speculative_hook.py:1271).
PAGED_TREE_BACKENDS = ("flashinfer", "fa3", "triton")
#: Attention backends that ignore the tree mask (chain-only verify, speculative_hook.py:1176).
CHAIN_ONLY_BACKENDS = ("trtllm_mha",)


def refuse_unsafe_combinations(sa) -> None:
    """The checks SGLang's EAGLE validation (``speculative_hook.py:1072-1283``) would make, which a
    custom algorithm skips (``speculative_hook.py:264``), plus graft's own; each names the flag.

    Raises:
        GraftSettingsError: accept thresholds other than 1.0 (lossy by design), a chain-only
            attention backend, page_size > 1 on a backend without paged tree verify,
            ``--enable-dp-attention``, or a ROCm device (no tree sampling kernel: SGLang would verify
            sampled requests greedily, ignoring their temperature).
    """
    for flag in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        value = getattr(sa, flag, 1.0)
        if value is not None and float(value) != 1.0:
            raise GraftSettingsError(
                f"--{flag.replace('_', '-')} = {value}: graft verifies losslessly, which needs 1.0 "
                "(lower thresholds accept tokens the target would not sample)")
    backends = {getattr(sa, f, None) for f in ("attention_backend", "decode_attention_backend",
                                                "prefill_attention_backend")} - {None}
    chain = sorted(backends & set(CHAIN_ONLY_BACKENDS))
    if chain:
        raise GraftSettingsError(
            f"--attention-backend {chain[0]} verifies chains only (topk 1); graft verifies trees "
            f"(topk > 1): use one of {', '.join(PAGED_TREE_BACKENDS)}")
    page = getattr(sa, "page_size", 1) or 1
    if page > 1 and backends and not backends <= set(PAGED_TREE_BACKENDS):
        raise GraftSettingsError(
            f"--page-size {page} with --attention-backend {sorted(backends)[0]}: trees (topk > 1) with "
            f"page_size > 1 are verified only by {', '.join(PAGED_TREE_BACKENDS)}; use --page-size 1")
    if getattr(sa, "enable_dp_attention", False):
        raise GraftSettingsError(
            "--enable-dp-attention is not supported with graft yet: data-parallel attention ranks "
            "hold different requests but must run the same draft steps, and graft's eager stop gate "
            "and tree agreement are per attention-TP group")
    try:
        from sglang.srt.utils import is_hip

        hip = is_hip()
    except Exception:  # noqa: BLE001 - SGLang builds without the helper: not ROCm
        hip = False
    if hip:
        raise GraftSettingsError(
            "graft on ROCm: SGLang 0.5.23 has no tree sampling kernel there and would verify sampled "
            "requests greedily (ignoring temperature); not supported")


#: Flags SGLang refuses for its own adaptive runtime states (SGLang 0.5.23
#: ``speculative/adaptive_spec_params.py:75-99``), which graft's batch budget builds and swaps too
#: (`sglang_patch.verify_widths`): flag -> why the state swap breaks it.
WIDTH_STATE_REFUSED = {
    "enable_two_batch_overlap": "the state swap would discard the TboAttnBackend wrapper",
    "enable_pdmux": "the state swap does not update decode_attn_backend_group",
}


def refuse_width_state_combinations(sa, cfg) -> None:
    """Refuse the flags SGLang refuses for its own adaptive runtime states (`WIDTH_STATE_REFUSED`):
    graft always has more than one verify width (a plain round among them); attention DP and multi-layer EAGLE, the
    others SGLang lists there, graft refuses in any case. Topk > 1, which SGLang also refuses there,
    is graft's tree and its width states are tested with it (tests/test_sglang_graft_server.py).

    Raises:
        GraftSettingsError: naming the flag (drop it).
    """
    if len(cfg.verify_widths) <= 1:
        return
    for flag, why in WIDTH_STATE_REFUSED.items():
        if getattr(sa, flag, False):
            raise GraftSettingsError(
                f"--{flag.replace('_', '-')} with graft (verify widths {list(cfg.verify_widths)}: a plain "
                f"round is always among them): {why} (SGLang refuses it for its own adaptive states, "
                "adaptive_spec_params.py:75-99); drop the flag")


def model_vocab_size(model_path: Optional[str]) -> Optional[int]:
    """``vocab_size`` of a local model directory's ``config.json`` (its text config's for multimodal
    models), read before the model loads; None when it cannot be read (a hub id, no file)."""
    import json

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) else None


def apply_graft_server_defaults(sa, environ: Optional[Mapping[str, str]] = None) -> None:
    """Body of ``GraftSpec.handle_server_args``: validate and declare graft's server defaults.

    ``sa`` is SGLang's write-recording stand-in (``overrides.py:138``): plain attribute writes to
    ServerArgs fields become declarations. Custom algorithms get none of EAGLE's defaults
    (``speculative_hook.py:1072``), so this sets them: tree shape (from the graft config),
    ``max_running_requests`` (48, like EAGLE), mixed chunk off. The overlap scheduler stays SGLang's
    default (on) on every device, CPU included: SGLang turns it off for its own speculative
    algorithms on CPU (``speculative_hook.py:66``), but graft's CPU runs are a proxy for the GPU path,
    which runs overlap; ``--disable-overlap-schedule`` gives the synchronous loop, as for any server
    (docs/sglang_cpu.md "Overlap scheduler").

    Raises:
        GraftSettingsError: missing draft model, ``topk == 1``, rejection sampling, pipeline
            parallelism, `refuse_unsafe_combinations`, `refuse_width_state_combinations`, or any
            invalid GraftConfig field (message names the field).
    """
    if getattr(sa, "speculative_draft_model_path", None) is None:
        raise GraftSettingsError(
            "--speculative-algorithm graft needs --speculative-draft-model-path "
            "(an EAGLE-3 draft model for the target)"
        )
    if getattr(sa, "speculative_eagle_topk", None) == 1:
        raise GraftSettingsError(
            "invalid graft setting: topk = 1 (from --speculative-eagle-topk): graft verifies a tree, "
            "and SGLang treats topk == 1 verify inputs as chains (attention backends ignore the tree "
            "mask, verify skips the accepted-path compaction); use --speculative-eagle-topk >= 2"
        )
    if getattr(sa, "speculative_use_rejection_sampling", False):
        raise GraftSettingsError(
            "--speculative-use-rejection-sampling needs topk == 1 chains; graft samples with "
            "target-only tree verification (lossless with distinct siblings) instead"
        )
    if (getattr(sa, "pp_size", 1) or 1) > 1:
        raise GraftSettingsError("graft does not support pipeline parallelism (--pp-size > 1)")
    for flag in ("speculative_adaptive", "enable_multi_layer_eagle"):
        if getattr(sa, flag, False):
            raise GraftSettingsError(f"graft does not support --{flag.replace('_', '-')}")
    refuse_unsafe_combinations(sa)

    if getattr(sa, "enable_lora", False) or getattr(sa, "lora_paths", None):
        raise GraftSettingsError(
            "--enable-lora / --lora-paths with graft: the EAGLE-3 draft has no adapters and graft's "
            "tests do not cover LoRA verify; serve LoRA adapters without speculation")
    cfg = effective_graft_config(sa, environ)
    refuse_width_state_combinations(sa, cfg)
    if cfg.retrieval.corpus:   # before the model loads: a bad file stops the server now, naming it
        try:
            check_corpus_file(cfg.retrieval.corpus_path, model_vocab_size(getattr(sa, "model_path", None)))
        except (OSError, ValueError) as exc:
            raise GraftSettingsError(f"invalid graft setting: retrieval.corpus_path: {exc}") from None
    for field, sa_field in SHARED_SHAPE.items():
        if getattr(sa, sa_field, None) != getattr(cfg, field):
            setattr(sa, sa_field, getattr(cfg, field))
    if getattr(sa, "max_running_requests", None) is None:
        sa.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
    if getattr(sa, "enable_mixed_chunk", False):
        sa.enable_mixed_chunk = False
        logger.warning("graft: mixed chunked prefill disabled (a mixed step would run running "
                       "requests as plain decodes)")
    logger.info("graft: num_draft_tokens=%d topk=%d depth=%d checkpoints=%d retrieval=%s",
                cfg.num_draft_tokens, cfg.topk, cfg.depth, len(cfg.checkpoints),
                ",".join(s for s in _RETRIEVAL_SOURCES if getattr(cfg.retrieval, s)) or "none")
