"""graft-spec core: engine-agnostic, batched torch functions for Graft speculative decoding.

Read in this order: tree.py (trees, EAGLE rerank), prune.py (confidence gating),
retrieval/ (successor matrix, suffix index, corpus), graft.py (merge into N nodes),
verify.py (greedy / target-only rejection sampling), pipeline.py (GraftPlanner).
"""

from .config import GraftConfig, GraftPolicy, PruneStage, RetrievalConfig, load_config
from .graft import graft
from .metrics import AcceptanceStats
from .pipeline import BuildInfo, GraftPlanner
from .prune import PruneResult, prune
from .tree import (NUM_SOURCES, SOURCE_DRAFT, SOURCE_NAMES, SOURCE_PADDING, SOURCE_RETRIEVED, DraftTree,
                   ancestor_mask, eagle_rerank, eagle_step, node_depths, parents_from_mask, sibling_links)
from .verify import VerifyResult, greedy_verify, logits_to_probs, sample_verify

__all__ = [
    "GraftConfig", "GraftPolicy", "PruneStage", "RetrievalConfig", "load_config",
    "graft", "AcceptanceStats", "BuildInfo", "GraftPlanner", "PruneResult", "prune",
    "NUM_SOURCES", "SOURCE_DRAFT", "SOURCE_NAMES", "SOURCE_PADDING", "SOURCE_RETRIEVED", "DraftTree",
    "ancestor_mask", "eagle_rerank", "eagle_step", "node_depths", "parents_from_mask", "sibling_links",
    "VerifyResult", "greedy_verify", "logits_to_probs", "sample_verify",
]
