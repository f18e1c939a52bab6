"""Retrieval sources for Graft: on the device the successor table, the lookup and the cross-request
output index (`OutputRing`); on the host the per-request suffix index and the shared corpus, which
reach the device through the fixed-size candidate buffer."""

from .base import HostSource, Proposal
from .buffer import HostCandidateBuffer, HostCandidates
from .corpus import CorpusIndex
from .output_ring import OutputRing
from .retriever import Retriever
from .successor import SuccessorTable, rank_template
from .suffix import SuffixIndex
from .trie import CountTrie

__all__ = ["HostSource", "Proposal", "HostCandidateBuffer", "HostCandidates", "CorpusIndex", "OutputRing", "Retriever",
           "SuccessorTable", "rank_template", "SuffixIndex", "CountTrie"]
