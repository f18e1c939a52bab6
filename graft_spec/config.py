"""Validated configuration for Graft (prune-then-graft speculative decoding).

One model, one validator: every way of building a config (`GraftConfig(...)`,
`GraftConfig.from_file`, `GraftConfig.from_env`, `load_config`) ends in
`GraftConfig.model_validate`, so a value rejected in one path is rejected in all.

Vocabulary (paper = Graft, arXiv 2605.20104, Sec. 3; see docs in
/work/shared/reference/speculative-decoding-landscape.md §1):

* ``num_draft_tokens`` (N): verify budget per request per step, *root included*
  (same meaning as SGLang's ``--speculative-num-draft-tokens``).
* ``topk`` / ``depth``: EAGLE draft width and number of draft steps
  (SGLang ``--speculative-eagle-topk`` / ``--speculative-num-steps``).
* Selection. By default (no ``checkpoints``) every candidate node, draft or retrieved, is priced by
  its calibrated estimate of lying on the accepted path (calibration.py) and the N - 1 best form the
  tree: pruning and grafting are outcomes of one selection, with nothing to tune.
  ``checkpoints`` switch to the paper's confidence gating: at checkpoint ``s`` the request's
  confidence c_d = exp(max cumulative draft log-prob over nodes at depth ``d``) is compared with
  ``threshold``; the first checkpoint (in increasing depth) whose confidence is below its threshold
  selects the stage, and only ``keep`` draft nodes (root excluded) survive; the other
  ``N - 1 - keep`` slots go to retrieval. No checkpoint firing keeps the full draft tree.
* ``draft_nodes``: false = retrieval-only (no draft node competes for the budget).
* ``calibration``: the online calibrator's prior weight and memory.
* ``retrieval``: successor table (token recycling, device), per-request suffix index and optional
  shared corpus (host, fed to the device through a fixed-size candidate buffer).
* ``graft``: how the selection is constrained.
* ``batch_budget``: per round, the verify width every request of the batch gets (from a small fixed
  set, so CUDA graphs stay capturable), chosen from the calibrated expected gain and the measured
  round time (budget.py); a width of 1 is a plain decode step.
* ``stop_drafting_early``: in eager execution the drafter skips its remaining steps once no deeper
  draft node can enter the selection (or, with checkpoints, once every request fired one).

Precedence in `load_config`: file < environment < explicit overrides.

Environment: configuration fields live under their own prefix, ``GRAFTCFG_`` (`ENV_PREFIX`:
``GRAFTCFG_NUM_DRAFT_TOKENS=60``, nested with ``__``); the config file path is ``GRAFT_CONFIG``
(`ENV_FILE`). Other ``GRAFT_*`` names belong to tooling (``GRAFT_VENV``, ``GRAFT_NO_MODEL_BUILD``,
``GRAFT_SGLANG_CPU_LAYER``, ...) and are never parsed as configuration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Tuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ENV_PREFIX",
    "ENV_FILE",
    "read_config_file",
    "PruneStage",
    "RetrievalConfig",
    "GraftPolicy",
    "CalibrationConfig",
    "BatchBudgetConfig",
    "GraftConfig",
    "load_config",
]

_STRICT = ConfigDict(extra="forbid", frozen=True, validate_default=True)

#: Prefix of configuration fields in the environment (``GRAFTCFG_RETRIEVAL__SUFFIX=false``).
ENV_PREFIX = "GRAFTCFG_"
#: Environment variable holding a config file path.
ENV_FILE = "GRAFT_CONFIG"


class PruneStage(BaseModel):
    """One confidence-gating checkpoint (paper Sec. 3.1, "pruning as budget release").

    Fields:
        depth: node depth (root = 0, first draft tokens = 1) whose best cumulative
            draft probability is the confidence c_d; 1 <= depth <= GraftConfig.depth.
        threshold: prune when c_d < threshold; open interval (0, 1).
        keep: draft nodes (root excluded) kept when this stage fires; >= 1.
    """

    model_config = _STRICT

    depth: int = Field(ge=1, le=64, description="checkpoint node depth, 1..depth")
    threshold: float = Field(gt=0.0, lt=1.0, description="prune if c_d < threshold, in (0,1)")
    keep: int = Field(ge=1, description="draft nodes kept (root excluded) when the stage fires")


class RetrievalConfig(BaseModel):
    """Retrieval sources feeding the freed budget (paper Sec. 3.2).

    Successor table (token recycling, on the engine's device): ``[V, successor_k]`` int32, row t =
    target's top-k after token t. Candidate subtrees are expanded from the root token with a
    rank template of ``min(max_candidates, N - 1)`` slots whose prior path acceptance is the
    product of ``successor_prior * 0.5**rank`` (`SuccessorTable`'s rank decay) until the calibrator has data
    (see retrieval/successor.py).

    Suffix index (host): per-request counting trie over prompt + generated tokens, depth
    ``suffix_max_depth`` (match + continuation, so long repeated matches give deep chains);
    matches use at most ``suffix_max_match`` context tokens (default a quarter of the depth); continuations below
    ``suffix_min_prob`` (product of child/parent count ratios) are dropped; ``suffix_max_nodes``
    caps the trie per request (eviction in suffix.py). Its proposals (and the corpus's) share
    ``max_candidates`` slots per request in the host candidate buffer.

    Outputs (device; ``outputs``: ``"greedy"`` by default, ``"on"``, ``"off"``; true / false read as
    on / off): the output index holds what earlier requests
    generated (their prompt's last ``match_len`` tokens and their output, inserted when they stop;
    SuffixDecoding's global tree) in a device ring of the newest ``outputs_max_tokens`` tokens with
    m-gram hash tables (``8 * (2 + 2 K)`` bytes a token of ring at a power-of-two size, K = 8 match
    lengths at the default ``match_len`` 16: 37.7 MB at the default size, fixed at start-up), each
    request adding its first ``outputs_max_request_tokens``; live requests match the context the
    device holds against it inside the graft step, so the overlap scheduler's host lag does not
    reach it (retrieval/output_ring.py). ``"greedy"``: only greedy rows get its candidates, and the
    calibration that comes with it (agreement bins, the source correction; `CalibrationConfig`) applies
    to greedy rows only; the index then holds greedy requests' outputs only (a sampled answer after an
    m-gram is a draw, where a greedy row needs the greedy continuation; ``"on"`` holds both).
    Sampled completions rarely recur, so by default sampled rows neither feed nor read the index.

    Isolation: the successor table and the output index are the retrieval state learnt across
    requests (the suffix index and lookup are per request; the corpus is static). With
    ``isolation: tenant`` (default) requests share it only with requests of the same isolation key
    (SGLang: the pair ``extra_key``, ``cache_salt``, which also partitions its prefix cache; requests
    with neither share one group, as they share prefixes), up to ``max_tenants`` keys at once: a key
    keeps its group while its requests run, a new key takes the least recently used idle group (reset
    first), and when every group is held by running requests a new key's requests get request-private
    state (nothing learnt across requests reaches them or comes from them). ``shared``: every request
    learns from and benefits from all traffic (one caller's answers speed up, and so reveal
    themselves to, every other caller); ``request``: each request its own hashed table
    (`REQUEST_TABLE_ROWS` rows, pipeline.py) and no output index. What remains between keys is timing
    only: the batch budget and the calibration are shared statistics (docs/serving.md).

    Lookup (device): the last ``history_len`` committed tokens of every request stay on the
    device; the context's tail (up to `LOOKUP_MAX_MATCH` tokens, numerics/lookup.py) is matched within them and the
    continuation proposed as a chain of up to N - 1 tokens (loops wrap around), with no lag behind
    the device (numerics/lookup.py). The same window re-anchors the host proposals.

    Corpus: shared counting trie loaded from ``corpus_path`` (JSON/JSONL token-id lists),
    capped at ``corpus_max_mb`` megabytes of index.
    """

    model_config = _STRICT

    successor: bool = True
    successor_k: int = Field(default=8, ge=1, le=64)
    successor_max_depth: int = Field(default=8, ge=1, le=64)
    successor_prior: float = Field(default=0.4, gt=0.0, lt=1.0)

    suffix: bool = True
    suffix_max_depth: int = Field(default=64, ge=2, le=256)
    suffix_max_match: Optional[int] = Field(default=None, ge=1, le=255,
                                            description="context tokens matched; None = suffix_max_depth // 4")
    suffix_min_prob: float = Field(default=0.1, ge=0.0, lt=1.0)
    suffix_max_nodes: int = Field(default=200_000, ge=64)

    corpus: bool = False
    corpus_path: Optional[str] = None
    corpus_max_mb: float = Field(default=256.0, gt=0.0)

    outputs: Literal["off", "greedy", "on"] = "greedy"
    outputs_max_tokens: int = Field(default=262_144, ge=1024, le=1 << 28,
                                    description="tokens of the newest outputs the output index holds (all groups)")
    outputs_max_request_tokens: int = Field(default=2048, ge=16, le=1 << 20,
                                            description="output tokens one request adds to the output index (its first)")

    isolation: Literal["shared", "tenant", "request"] = Field(
        default="tenant",
        description="who shares the successor table and output index: everyone, requests of one isolation key, "
                    "nobody")
    max_tenants: int = Field(default=8, ge=1, le=4096,
                             description="isolation keys with their own group at once (idle groups reused)")

    lookup: bool = True
    history_len: int = Field(default=256, ge=16, le=65536,
                             description="committed tokens kept per slot on the device (lookup, re-anchoring)")

    max_candidates: int = Field(default=64, ge=1, le=1024,
                                description="successor template slots (at most N - 1) and host "
                                            "candidate slots per request (shared by suffix, corpus and outputs)")

    @field_validator("outputs", mode="before")
    @classmethod
    def _outputs_switch(cls, v):
        """true / false (``--graft-retrieval ...,outputs``, ``GRAFTCFG_RETRIEVAL__OUTPUTS=true``) = on / off."""
        return ("on" if v else "off") if isinstance(v, bool) else v

    @property
    def outputs_modes(self) -> Tuple[bool, bool]:
        """(greedy rows, sampled rows) that get the output index's candidates."""
        return {"off": (False, False), "greedy": (True, False), "on": (True, True)}[self.outputs]

    @model_validator(mode="after")
    def _check(self) -> "RetrievalConfig":
        if self.suffix_max_match is not None and self.suffix_max_match >= self.suffix_max_depth:
            raise ValueError(
                f"retrieval.suffix_max_match ({self.suffix_max_match}) must be < "
                f"retrieval.suffix_max_depth ({self.suffix_max_depth}) so a match leaves room "
                "for a continuation")
        if self.suffix_max_nodes < 4 * self.suffix_max_depth:
            raise ValueError(
                f"retrieval.suffix_max_nodes ({self.suffix_max_nodes}) must be >= 4 * "
                f"retrieval.suffix_max_depth ({4 * self.suffix_max_depth})")
        if self.corpus and not self.corpus_path:
            raise ValueError("retrieval.corpus_path is required when retrieval.corpus is true")
        return self

    @property
    def match_len(self) -> int:
        """Longest context suffix the suffix index, corpus and output index match on (``suffix_max_match``, or a
        quarter of ``suffix_max_depth``)."""
        return self.suffix_max_match or max(1, self.suffix_max_depth // 4)


class GraftPolicy(BaseModel):
    """How the freed budget is filled (paper Sec. 3.3, Algorithm 2).

    Fields:
        min_score: retrieved nodes whose estimated path acceptance probability is below
            this value are dropped, in [0, 1).
        root_width: at most this many *new* retrieved children of the root (None = no
            cap), so retrieval does not crowd the root level.
        refill_with_draft: slots that retrieval cannot fill are given back to the best
            pruned draft nodes before padding is used.
        exclusive_siblings: where to cap every node's estimate by its parent's minus those of its
            higher-ranked siblings (at most one child is accepted; ``kernels.select.sibling_caps``):
            ``"greedy"`` rows only (default), ``"always"`` or ``"never"``.
    """

    model_config = _STRICT

    min_score: float = Field(default=0.0, ge=0.0, lt=1.0)
    root_width: Optional[int] = Field(default=None, ge=1)
    refill_with_draft: bool = True
    exclusive_siblings: Literal["never", "greedy", "always"] = "greedy"


class CalibrationConfig(BaseModel):
    """Online calibration of the estimated path acceptance (calibration.py).

    Fields:
        source_window: trials per member source (and mode) over which the source correction
            measures its mean estimated vs observed acceptance (calibration.py, "Source
            correction"); 0 = off.
        request_window: rounds per request and retrieval source (successor, suffix, corpus, lookup,
            outputs) over which that request's own correction of the source's estimates is measured
            (request_correction.py; a round is one trial); 0 = off.
        agreement: price and credit a draft node a retrieval source also proposed in agreement bins
            of its own instead of the draft bins (calibration.py); None = on exactly for the rows
            that get the output index (``retrieval.outputs``).

    The bins' prior weight and memory are constants of calibration.py (`PRIOR_WEIGHT`, `HALVE_AT`).
    """

    model_config = _STRICT

    source_window: float = Field(default=256.0, ge=0.0)
    request_window: float = Field(default=64.0, ge=0.0)
    agreement: Optional[bool] = None


class BatchBudgetConfig(BaseModel):
    """The batch-aware verify budget (budget.py): each decode round the whole batch verifies ``w``
    tokens per request, ``w`` one of the ``widths``, chosen for the most expected tokens per second
    (calibrated expected accept length over the round time measured on the serving device).

    Fields:
        enabled: false = every round verifies ``num_draft_tokens`` per request (fixed N), but for
            the plain rounds below.
        widths: the per-request verify widths a round may use, root included (1 = a plain round:
            the engine's decode step, no drafting); () = ``(1, ceil(N / 2), N)``. 1 is always added:
            batches with a request that needs the engine's exact decode step (penalties, logprobs,
            ...; sglang_patch/request_features.py) or all of whose requests opted out run plain
            rounds whatever the budget says. Each width is a runtime state of its own (attention
            backend, CUDA graphs), built at startup.
        explore_every: rounds of one batch-size bucket between two re-measurements of a width that is
            not the current best (exploration cost: at most 1 round in ``explore_every``).
        explore_margin: only a width whose estimated tokens/s is within this fraction of the best
            width's is re-measured (a width priced far out, e.g. 24-wide trees at 32 requests on a
            CPU, is not re-run every ``explore_every`` rounds to confirm it).
        explore_stale: rounds of one batch-size bucket after which a width not run since is
            re-measured at the next ``explore_every`` turn whatever its estimated value, and its
            earlier times are dropped for the fresh one: a width priced out by times measured in
            another phase of the load (a slow first use, a busy machine) is priced again, and a wide
            width's rounds refresh the correction of its expected gain, which plain rounds never
            do. The exploration cost stays at most 1 round in ``explore_every``.
        min_samples: round times measured per (batch-size bucket, width) before its own median
            replaces the cost model's prediction (`graft_spec.budget.BatchBudget.cost_model`), and
            deferred draft catch-ups measured per bucket before plain rounds are charged for them.
        defer_draft_extend: plain (width-1) rounds skip the EAGLE draft extend; the draft catches
            up over the skipped tokens in one extend before the next drafting round (or when a
            request has ``max(widths)`` waiting). false = SGLang's behaviour, an extend every round.
        schedule: a fixed cycle of verify widths, one per decode round, instead of the budget's
            choice (to replay a width sequence exactly: tests, benchmarks); () = the budget chooses.
            Each must be one of the widths.
        width_reserve_mib: device memory (MiB, per rank) set aside for each extra verify width before
            the engine sizes its KV cache; None = estimated from the attention backend, the graph batch
            size and the context (SGLang: sglang_patch/kv_reserve.py). Widths that would take more
            than half of the KV memory are dropped at startup, widest first, with a warning.
    """

    model_config = _STRICT

    enabled: bool = True
    widths: tuple[int, ...] = ()
    explore_every: int = Field(default=64, ge=2, le=1_000_000)
    explore_margin: float = Field(default=0.25, ge=0.0, le=1.0)
    explore_stale: int = Field(default=512, ge=2, le=1_000_000)
    min_samples: int = Field(default=3, ge=1, le=1000)
    defer_draft_extend: bool = True
    schedule: tuple[int, ...] = ()
    width_reserve_mib: Optional[int] = Field(default=None, ge=0, le=1 << 20)


class GraftConfig(BaseModel):
    """Top-level Graft configuration (immutable, validated).

    Raises:
        pydantic.ValidationError: any field out of range, unknown fields
            (extra="forbid"), inconsistent checkpoints (depths not strictly increasing or
            deeper than ``depth``; keep counts not strictly increasing or >= N), or a
            budget the EAGLE tree cannot fill (N - 1 > topk + (depth - 1) * topk**2,
            the size of SGLang's score space, eagle_utils.py:100).
    """

    model_config = _STRICT

    num_draft_tokens: int = Field(default=24, ge=2, le=1024,
                                  description="verify budget N per request, root included")
    topk: int = Field(default=4, ge=2, le=64, description="EAGLE draft width")
    depth: int = Field(default=4, ge=1, le=64, description="EAGLE draft steps")
    checkpoints: tuple[PruneStage, ...] = ()
    draft_nodes: bool = Field(default=True, description="false = retrieval-only: no draft node is selected")
    calibration: CalibrationConfig = CalibrationConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    graft: GraftPolicy = GraftPolicy()
    batch_budget: BatchBudgetConfig = BatchBudgetConfig()
    stop_drafting_early: bool = Field(
        default=True,
        description="skip the remaining draft steps once no deeper draft node can be selected (with "
                    "checkpoints: once every request fired one); eager execution only, CUDA-graph "
                    "replays always draft the full depth")
    return_sources: bool = Field(
        default=False,
        description="add meta_info.graft_src to responses: the source of each output token (draft, successor, "
                    "suffix, outputs, ...); off by default, as an 'o' (output index) token tells a caller that "
                    "earlier text of its isolation key contained it")

    @model_validator(mode="after")
    def _check(self) -> "GraftConfig":
        n = self.num_draft_tokens
        space = self.topk + (self.depth - 1) * self.topk ** 2
        if n - 1 > space:
            raise ValueError(
                f"num_draft_tokens={n} needs N-1 <= topk + (depth-1)*topk^2 = {space} "
                f"(topk={self.topk}, depth={self.depth}); raise topk/depth or lower N")
        prev_depth, prev_keep = 0, 0
        for i, st in enumerate(self.checkpoints):
            if st.depth > self.depth:
                raise ValueError(f"checkpoints[{i}].depth={st.depth} must be <= depth={self.depth}")
            if st.depth <= prev_depth:
                raise ValueError(f"checkpoints[{i}].depth={st.depth} must be > previous "
                                 f"checkpoint depth {prev_depth} (strictly increasing)")
            if st.keep <= prev_keep:
                raise ValueError(f"checkpoints[{i}].keep={st.keep} must be > previous keep "
                                 f"{prev_keep} (strictly increasing)")
            if st.keep >= n:
                raise ValueError(f"checkpoints[{i}].keep={st.keep} must be < num_draft_tokens={n}")
            prev_depth, prev_keep = st.depth, st.keep
        widths = self.batch_budget.widths
        if widths:
            if list(widths) != sorted(set(widths)):
                raise ValueError(f"batch_budget.widths={list(widths)} must be strictly increasing")
            if widths[0] < 1 or widths[-1] > n:
                raise ValueError(f"batch_budget.widths={list(widths)} must lie in 1..num_draft_tokens={n}")
        unknown = sorted(set(self.batch_budget.schedule) - set(self.verify_widths))
        if unknown:
            raise ValueError(f"batch_budget.schedule: widths {unknown} are not among the verify widths "
                             f"{list(self.verify_widths)}")
        return self

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The per-request verify widths rounds may use, 1 (a plain round) always among them: a batch
        whose requests need the engine's exact decode step, or whose round code failed, runs plain
        (``(1, N)`` when the batch budget is off: N every other round)."""
        n = self.num_draft_tokens
        if not self.batch_budget.enabled:
            return (1, n)
        return tuple(sorted({1, *(self.batch_budget.widths or (max(2, -(-n // 2)), n))}))

    @property
    def agreement_modes(self) -> Tuple[bool, bool]:
        """(greedy rows, sampled rows) whose agreement nodes get their own calibration bins
        (``calibration.agreement``; None = the rows that get the output index)."""
        a = self.calibration.agreement
        return self.retrieval.outputs_modes if a is None else (a, a)

    @property
    def agreement_bins(self) -> bool:
        """Whether any row prices agreement nodes in their own bins (`agreement_modes`)."""
        return any(self.agreement_modes)

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "GraftConfig":
        """Load from a ``.json``, ``.yaml`` or ``.yml`` file.

        Raises:
            FileNotFoundError: missing file.
            ValueError: unknown suffix or a top level that is not a mapping.
            pydantic.ValidationError: invalid content.
        """
        return cls.model_validate(_read_file(path))

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, environ: Optional[Mapping[str, str]] = None
                 ) -> "GraftConfig":
        """Build from environment variables (see `env_overrides` for the naming rule)."""
        return cls.model_validate(env_overrides(prefix, environ))


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping in a ``.json`` / ``.yaml`` / ``.yml`` config file (not validated).

    Raises:
        FileNotFoundError: missing file.
        ValueError: unknown suffix, a syntax error (the message names the file, line and column), or
            a top level that is not a mapping.
    """
    return _read_file(path)


def _read_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config file {p}, line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    elif p.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"config file {p}{where}: YAML syntax error: {problem}") from None
    else:
        raise ValueError(f"config file {p}: unknown suffix {p.suffix!r} (use .json, .yaml or .yml)")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
    return data


def env_overrides(prefix: str = ENV_PREFIX, environ: Optional[Mapping[str, str]] = None
                  ) -> dict[str, Any]:
    """Turn ``{prefix}FIELD`` variables into a nested override dict.

    Naming: ``GRAFTCFG_NUM_DRAFT_TOKENS=60``; nested fields use a double underscore,
    ``GRAFTCFG_RETRIEVAL__SUFFIX_MAX_DEPTH=16``; lists are YAML/JSON,
    ``GRAFTCFG_CHECKPOINTS='[{depth: 1, threshold: 0.35, keep: 8}]'``. Values are parsed
    with ``yaml.safe_load`` (so ``true``/``60``/``0.5`` get their types).
    Every name under the prefix is configuration: unknown ones reach the validator and are
    rejected there.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(prefix):
            continue
        parts = [p.lower() for p in key[len(prefix):].split("__")]
        value = yaml.safe_load(raw) if raw.strip() else None
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"environment variable {key}: {part} is not a section")
        node[parts[-1]] = value
    return out


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in overrides.items():
        parts = k.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(v, Mapping):
            v = _expand_dotted(v)
        if isinstance(node.get(parts[-1]), dict) and isinstance(v, dict):
            node[parts[-1]] = _deep_merge(node[parts[-1]], v)
        else:
            node[parts[-1]] = v
    return out


def merge_config_sources(file: Optional[str | os.PathLike] = None,
                         overrides: Optional[Mapping[str, Any]] = None,
                         env: bool = True,
                         prefix: str = ENV_PREFIX,
                         environ: Optional[Mapping[str, str]] = None,
                         file_data: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The raw, not yet validated settings of `load_config` (file < env < overrides).

    Engine adapters use it to see which fields a user set explicitly (e.g. the tree shape,
    which SGLang may also set) before validating once with the final values. ``file_data``
    stands for the file's content when it was read elsewhere (a launcher that ships one snapshot
    of the settings to every rank); then nothing is read from disk.

    Raises:
        ValueError, FileNotFoundError: unreadable file or environment value.
    """
    e = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if file_data is not None:
        data = dict(file_data)
    else:
        if file is None and env and e.get(ENV_FILE):
            file = e[ENV_FILE]
        if file is not None:
            data = _read_file(file)
    if env:
        data = _deep_merge(data, env_overrides(prefix, e))
    if overrides:
        clean = {k: v for k, v in overrides.items() if v is not None}
        data = _deep_merge(data, _expand_dotted(clean))
    return data


def load_config(file: Optional[str | os.PathLike] = None,
                overrides: Optional[Mapping[str, Any]] = None,
                env: bool = True,
                prefix: str = ENV_PREFIX,
                environ: Optional[Mapping[str, str]] = None,
                file_data: Optional[Mapping[str, Any]] = None) -> GraftConfig:
    """The single loading path used by the engine adapters and scripts.

    Args:
        file: JSON/YAML path; when None and ``env`` is true, ``GRAFT_CONFIG`` is used
            if set.
        overrides: explicit values (e.g. CLI flags); nested dicts or dotted keys
            (``{"retrieval.suffix_max_depth": 12}``). ``None`` values are ignored so
            unset CLI flags do not clobber the file.
        env: read ``GRAFT_CONFIG`` and the ``{prefix}*`` variables (see `env_overrides`).
        environ: mapping used instead of ``os.environ`` (tests, snapshots).
        file_data: the file's content, read elsewhere (see `merge_config_sources`).

    Returns:
        GraftConfig validated once from file < env < overrides.

    Raises:
        pydantic.ValidationError, ValueError, FileNotFoundError (see `GraftConfig.from_file`).
    """
    return GraftConfig.model_validate(merge_config_sources(file, overrides, env, prefix, environ, file_data))
