"""Retrieval sources for Graft: successor matrix, per-request suffix index, shared corpus."""

from .base import Candidates, RetrievalSource
from .corpus import CorpusIndex
from .retriever import Retriever
from .successor import SuccessorMatrix, rank_template
from .suffix import SuffixIndex
from .trie import CountTrie

__all__ = ["Candidates", "RetrievalSource", "CorpusIndex", "Retriever", "SuccessorMatrix",
           "rank_template", "SuffixIndex", "CountTrie"]
