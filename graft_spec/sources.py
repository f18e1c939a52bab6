"""The sources of candidate nodes: one enumeration for tree nodes, calibration and metrics.

A tree node's ``source`` (`tree.DraftTree`) is the source whose candidate won the node in
`merge.merge_select`; each source that proposed a node is one of its *members* and has its own
calibration bins (calibration.py). Padding fills the budget and proposes nothing, so it is a node
source but not a member: the members are the sources ``0 .. NUM_MEMBERS - 1``.
"""

from __future__ import annotations

import torch

__all__ = [
    "SOURCE_DRAFT", "SOURCE_SUCCESSOR", "SOURCE_SUFFIX", "SOURCE_CORPUS", "SOURCE_LOOKUP", "SOURCE_OUTPUTS",
    "SOURCE_AGREE", "SOURCE_PADDING", "NUM_MEMBERS", "NUM_SOURCES", "SOURCE_NAMES", "SOURCE_LETTERS",
    "RETRIEVAL_SOURCES", "GRAFTED_SOURCES", "grafted",
]

SOURCE_DRAFT = 0      #: the draft model (the root is tagged draft too)
SOURCE_SUCCESSOR = 1  #: the successor table (token recycling)
SOURCE_SUFFIX = 2     #: the request's suffix index
SOURCE_CORPUS = 3     #: the shared corpus
SOURCE_LOOKUP = 4     #: prompt lookup in the slot's device history
SOURCE_OUTPUTS = 5    #: earlier requests' outputs (the output index)
SOURCE_AGREE = 6      #: the draft and at least one retrieval source (set by merge_select)
SOURCE_PADDING = 7    #: filler node, a child of the root, when the budget cannot be filled
NUM_MEMBERS = 7       #: sources that propose nodes and are calibrated (all but padding)
NUM_SOURCES = 8
SOURCE_NAMES = ("draft", "successor", "suffix", "corpus", "lookup", "outputs", "agree", "padding")
#: One letter per source (``meta_info.graft_src`` of SGLang responses; ``t`` = the target's token).
SOURCE_LETTERS = "dsxcloap"
#: The sources priced by `Calibrator.retrieval_bins` (depth, path probability, match length).
RETRIEVAL_SOURCES = (SOURCE_SUFFIX, SOURCE_CORPUS, SOURCE_LOOKUP, SOURCE_OUTPUTS)
#: Sources whose accepted nodes were grafted: retrieved, with no draft member.
GRAFTED_SOURCES = (SOURCE_SUCCESSOR, *RETRIEVAL_SOURCES)


def grafted(source: torch.Tensor) -> torch.Tensor:
    """``bool``, shaped like ``source`` (int): the nodes a retrieval source won with no draft member
    (`GRAFTED_SOURCES`: successor .. outputs)."""
    return (source >= SOURCE_SUCCESSOR) & (source <= SOURCE_OUTPUTS)
