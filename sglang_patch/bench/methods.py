"""The benchmarked methods and the SGLang server arguments each one runs with."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

#: Share of the budget N kept as draft nodes at each pruning stage, and the stages' default
#: thresholds (paper setting 8 / 24 / 40 of 60; thresholds from configs/qwen3-8b.yaml). Small heads
#: need their own thresholds: ``--thresholds`` (scripts/calibrate_checkpoints.py prints them).
STAGE_KEEP_FRACTIONS = (8 / 60, 24 / 60, 40 / 60)
STAGE_THRESHOLDS = (0.35, 0.25, 0.15)
_NO_RETRIEVAL = {"successor": False, "suffix": False, "corpus": False}
#: The graft variants: name -> GraftConfig overrides beyond the budget-dependent checkpoints.
#: pruned_only: the pruned draft tree, freed slots padded (no retrieval, no refill).
#: retrieval_only: one draft node kept (a stage that always fires), the rest retrieved.
GRAFT_VARIANTS: Dict[str, Dict[str, Any]] = {
    "graft": {},
    "pruned_only": {"retrieval": _NO_RETRIEVAL, "graft": {"refill_with_draft": False}},
    "retrieval_only": {"graft": {"refill_with_draft": False}},
}


def stage_depths(depth: int) -> List[int]:
    """Checkpoint node depths for a draft of ``depth`` steps: 1, 2 and depth-1 (deduplicated)."""
    return sorted({1, min(2, depth), max(depth - 1, 1)})


def stage_checkpoints(n: int, depth: int, variant: str,
                      thresholds: Sequence[float] = STAGE_THRESHOLDS) -> List[Dict[str, Any]]:
    """Pruning checkpoints for budget ``n`` and draft ``depth`` (node depths 1, 2, depth-1), with
    ``thresholds`` for those three depths.

    ``retrieval_only`` gets a single stage at depth 1 that fires unless c_1 >= 0.999999 and keeps
    one draft node (GraftConfig requires keep >= 1).
    """
    if variant == "retrieval_only":
        return [{"depth": 1, "threshold": 0.999999, "keep": 1}]
    depths = stage_depths(depth)
    out: List[Dict[str, Any]] = []
    prev = 0
    for d, f, th in zip(depths, STAGE_KEEP_FRACTIONS, thresholds):
        keep = max(prev + 1, round(n * f))
        if keep >= n:
            break
        out.append({"depth": d, "threshold": th, "keep": keep})
        prev = keep
    return out


@dataclass
class MethodSpec:
    """One server configuration of the benchmark.

    Attributes:
        method: ``nospec``, ``eagle3``, ``pruned_only``, ``retrieval_only``, ``graft``.
        label: unique name of this (method, N) setting.
        num_draft_tokens: verify budget N (None without speculation).
        steps, topk: draft depth and top-k (EAGLE tree shape before reranking / pruning).
        draft: EAGLE-3 head directory.
        graft_overrides: GraftConfig fields for the graft variants.
        base_graft_config: optional GraftConfig file merged under the overrides.
    """

    method: str
    label: str
    num_draft_tokens: Optional[int] = None
    steps: int = 0
    topk: int = 0
    draft: str = ""
    graft_overrides: Dict[str, Any] = field(default_factory=dict)
    base_graft_config: Optional[str] = None

    def server_args(self, work_dir: Path) -> List[str]:
        """SGLang CLI arguments for this method (the CPU defaults are added by the launcher)."""
        if self.method == "nospec":
            return []
        algo = "EAGLE3" if self.method == "eagle3" else "graft"
        args = ["--speculative-algorithm", algo, "--speculative-draft-model-path", self.draft,
                "--speculative-num-steps", str(self.steps), "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens)]
        if algo == "graft":
            cfg: Dict[str, Any] = {}
            if self.base_graft_config:
                from graft_spec.config import GraftConfig

                cfg = GraftConfig.from_file(self.base_graft_config).model_dump()
                for shape in ("num_draft_tokens", "topk", "depth"):  # the SGLang flags above set them
                    cfg.pop(shape)
            _deep_merge(cfg, self.graft_overrides)
            path = work_dir / f"{self.label}.json"
            path.write_text(json.dumps(cfg, indent=2))
            args += ["--graft-config", str(path)]
        return args


def _deep_merge(base: Dict[str, Any], over: Dict[str, Any]) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v


def build_methods(names: List[str], budgets: List[int], dense_n: int, depth: int, topk: int,
                  draft: str, base_graft_config: Optional[str],
                  thresholds: Sequence[float] = STAGE_THRESHOLDS) -> List[MethodSpec]:
    """Expand method names over the budgets. ``nospec`` runs first (it is every run's reference).

    Raises:
        ValueError: an unknown method name.
    """
    known = {"nospec", "eagle3_dense", "eagle3", *GRAFT_VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {sorted(known)}")
    out: List[MethodSpec] = []
    if "nospec" in names:
        out.append(MethodSpec("nospec", "nospec"))
    if "eagle3_dense" in names:
        out.append(MethodSpec("eagle3", "eagle3_dense", dense_n, depth, topk, draft))
    for n in budgets:
        if "eagle3" in names and not ("eagle3_dense" in names and n == dense_n):
            out.append(MethodSpec("eagle3", f"eagle3_n{n}", n, depth, topk, draft))
        for v in GRAFT_VARIANTS:
            if v in names:
                over = {**GRAFT_VARIANTS[v], "checkpoints": stage_checkpoints(n, depth, v, thresholds)}
                out.append(MethodSpec(v, f"{v}_n{n}", n, depth, topk, draft, over, base_graft_config))
    return out
