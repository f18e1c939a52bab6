"""The benchmarked methods and the SGLang server arguments each one runs with."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

#: GraftConfig overrides of the graft variants (merged over the base config file, if any).
GRAFT_VARIANTS: Dict[str, Dict[str, Any]] = {
    "graft": {},
    "pruned_only": {"retrieval": {"enabled": False}},
    "retrieval_only": {"draft_enabled": False},
}


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
                  draft: str, base_graft_config: Optional[str]) -> List[MethodSpec]:
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
                out.append(MethodSpec(v, f"{v}_n{n}", n, depth, topk, draft, dict(GRAFT_VARIANTS[v]),
                                      base_graft_config))
    return out
