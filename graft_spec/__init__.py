"""graft-spec core: engine-agnostic, batched torch functions for Graft speculative decoding.

Read in this order: tree.py (trees, EAGLE rerank), calibration.py (the one currency: estimated
path acceptance), retrieval/ (successor table, suffix index, corpus, host candidate buffer),
merge.py (merge into N nodes), prune.py (the paper's confidence gating), step.py (the per-round
device step), verify.py (greedy / target-only rejection sampling), pipeline.py (GraftPlanner),
budget.py (the batch budget: each round's verify width).

The functions ``prune`` and ``graft`` are deliberately not re-exported here so that
``graft_spec.prune`` and ``graft_spec.merge`` stay the modules; import them from there.
"""

from .budget import BatchBudget
from .calibration import Calibrator
from .config import BatchBudgetConfig, CalibrationConfig, GraftConfig, GraftPolicy, PruneStage, RetrievalConfig, load_config
from .metrics import AcceptanceStats
from .pipeline import GraftPlanner
from .prune import PruneResult
from .step import DraftCandidates, GraftStep, StepOutput
from .sources import NUM_SOURCES, SOURCE_DRAFT, SOURCE_NAMES, SOURCE_PADDING
from .tree import (DraftTree, ancestor_mask, eagle_rerank, eagle_step, node_depths, parents_from_mask, sibling_links,
                   tree_from_selection)
from .verify import VerifyResult, greedy_verify, logits_to_probs, sample_verify

__all__ = [
    "BatchBudget", "BatchBudgetConfig", "Calibrator", "CalibrationConfig", "GraftConfig", "GraftPolicy", "PruneStage", "RetrievalConfig",
    "load_config", "AcceptanceStats", "GraftPlanner", "PruneResult", "DraftCandidates", "GraftStep",
    "StepOutput",
    "NUM_SOURCES", "SOURCE_DRAFT", "SOURCE_NAMES", "SOURCE_PADDING", "DraftTree",
    "ancestor_mask", "eagle_rerank", "eagle_step", "node_depths", "parents_from_mask", "sibling_links",
    "tree_from_selection",
    "VerifyResult", "greedy_verify", "logits_to_probs", "sample_verify",
]
