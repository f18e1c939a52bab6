"""Retrieval sources for Graft: the device successor table, and the host-side per-request suffix
index, shared corpus and cross-request output index that reach the device through the fixed-size
candidate buffer."""

from .base import HostSource, Proposal
from .buffer import HostCandidateBuffer, HostCandidates
from .corpus import CorpusIndex
from .outputs import OutputIndex
from .retriever import Retriever
from .successor import SuccessorTable, rank_template
from .suffix import SuffixIndex
from .trie import CountTrie

__all__ = ["HostSource", "Proposal", "HostCandidateBuffer", "HostCandidates", "CorpusIndex", "OutputIndex", "Retriever",
           "SuccessorTable", "rank_template", "SuffixIndex", "CountTrie"]
