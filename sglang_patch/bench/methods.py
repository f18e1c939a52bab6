"""The benchmarked methods and the SGLang server arguments each one runs with.

Every speculative method verifies at most N tokens per request per step (the same budget); all but
``graft`` verify exactly N every step (graft's batch budget may pick a narrower width, or a plain
decode step, when that gives more tokens per second):

| method | server |
|---|---|
| ``nospec`` | the target alone (every run's reference) |
| ``eagle3`` | SGLang's EAGLE-3 (``--speculative-algorithm EAGLE3``), top-k x depth, N |
| ``ngram`` | SGLang's NGRAM (retrieval from its own trie, ``--speculative-num-draft-tokens N``) |
| ``retrieval_only`` | graft with no draft node selected (``--graft-draft-nodes false``), fixed N |
| ``pruned_only`` | graft with retrieval off (the draft tree alone, priced and cut by the calibration), fixed N |
| ``graft_fixed`` | graft with the batch budget off (``--graft-batch-budget-enabled false``): N every step |
| ``graft`` | graft with no graft config at all: what a user gets out of the box (batch budget on) |
| ``graft_paper`` | graft with the paper's threshold checkpoints (``--thresholds``), for reference |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

#: Share of the budget N kept as draft nodes at each paper checkpoint (8 / 24 / 40 of 60).
STAGE_KEEP_FRACTIONS = (8 / 60, 24 / 60, 40 / 60)
#: The third-party reimplementation's thresholds (configs/qwen3-8b-paper.yaml); small heads need their own.
STAGE_THRESHOLDS = (0.35, 0.25, 0.15)
METHODS = ("nospec", "eagle3", "ngram", "retrieval_only", "pruned_only", "graft_fixed", "graft", "graft_paper")
_FIXED = ["--graft-batch-budget-enabled", "false"]
_GRAFT_EXTRA = {
    "graft": [],
    "graft_fixed": _FIXED,
    "graft_paper": _FIXED,
    "retrieval_only": ["--graft-draft-nodes", "false", *_FIXED],
    "pruned_only": ["--graft-retrieval", "none", *_FIXED],
}


def stage_depths(depth: int) -> List[int]:
    """Checkpoint node depths for a draft of ``depth`` steps: 1, 2 and depth-1 (deduplicated)."""
    return sorted({1, min(2, depth), max(depth - 1, 1)})


def stage_checkpoints(n: int, depth: int, thresholds: Sequence[float] = STAGE_THRESHOLDS) -> List[dict]:
    """The paper's pruning checkpoints for budget ``n`` and draft ``depth`` (node depths 1, 2 and
    depth-1, keeping 8 / 24 / 40 sixtieths of N), with ``thresholds`` for those depths."""
    out: List[dict] = []
    prev = 0
    for d, f, th in zip(stage_depths(depth), STAGE_KEEP_FRACTIONS, thresholds):
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
        method: one of `METHODS`; label: unique name of this (method, N) setting;
        num_draft_tokens: verify budget N (None without speculation);
        steps, topk: draft depth and top-k (EAGLE-3 and graft);
        draft: EAGLE-3 head directory; thresholds: ``graft_paper`` checkpoints' thresholds.
    """

    method: str
    label: str
    num_draft_tokens: Optional[int] = None
    steps: int = 0
    topk: int = 0
    draft: str = ""
    thresholds: Sequence[float] = field(default_factory=lambda: list(STAGE_THRESHOLDS))

    def server_args(self) -> List[str]:
        """SGLang CLI arguments for this method (the CPU defaults are added by the launcher)."""
        if self.method == "nospec":
            return []
        n = str(self.num_draft_tokens)
        if self.method == "ngram":
            return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", n]
        algo = "EAGLE3" if self.method == "eagle3" else "graft"
        args = ["--speculative-algorithm", algo, "--speculative-draft-model-path", self.draft,
                "--speculative-num-steps", str(self.steps), "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-draft-tokens", n]
        if self.method == "graft_paper":
            import json

            cps = stage_checkpoints(self.num_draft_tokens, self.steps, self.thresholds)
            args += ["--graft-checkpoints", json.dumps(cps)]
        args += _GRAFT_EXTRA.get(self.method, [])
        if algo == "graft":   # meta_info.graft_src: the grafted share of accepted tokens
            args += ["--graft-return-sources", "true"]
        return args


def build_methods(names: Sequence[str], budgets: Sequence[int], depth: int, topk: int, draft: str,
                  thresholds: Sequence[float] = STAGE_THRESHOLDS) -> List[MethodSpec]:
    """Expand method names over the budgets; ``nospec`` runs first (it is every run's reference).

    Raises:
        ValueError: an unknown method name, or a budget the draft shape cannot fill
            (N - 1 > topk + (depth - 1) * topk**2).
    """
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {list(METHODS)}")
    space = topk + (depth - 1) * topk * topk
    bad = [n for n in budgets if n - 1 > space]
    if bad:
        raise ValueError(f"budgets {bad} exceed the draft tree of top-{topk} x {depth} ({space + 1} nodes)")
    out: List[MethodSpec] = []
    if "nospec" in names:
        out.append(MethodSpec("nospec", "nospec"))
    for n in budgets:
        for m in METHODS[1:]:
            if m in names:
                out.append(MethodSpec(m, f"{m}_n{n}", n, depth, topk, draft, list(thresholds)))
    return out


def interleave_order(servers: List[Any], i: int) -> List[Any]:
    """The order in which run ``i`` goes to the servers (`sglang_patch.bench` ``--interleave``, and
    each repetition of `sglang_patch.bench.paired`): as given for even ``i``, reversed for odd ``i``
    (ABBA), so no method always runs first or last in its cell. With a fixed
    order the last server always ran after the others' load (graft, behind nospec, EAGLE-3 and
    fixed-N graft in issue 15's command), and a machine whose speed moves within a burst of runs
    reads that as the method's ratio."""
    return list(servers) if i % 2 == 0 else list(reversed(servers))
