"""Optional shared corpus of token sequences as a retrieval source (REST-style).

One `CountTrie` over many sequences (no substring crosses a sequence boundary), shared
by all requests; each request only keeps its last ``max_match`` context tokens. Matching
walks the trie with binary search over the match length (O(max_match log max_match)
dict lookups), then expands continuations like the suffix index.

Memory: insertion stops once the index reaches ``max_mb`` megabytes (checked every 128
tokens, so the overshoot is at most 128 * max_depth nodes); ``truncated`` tells whether
the corpus was cut. This pure-Python index is
meant for corpora of up to a few million tokens; larger ones belong in SGLang's C++
NGRAM corpus (reference sglang-0.5.23 §3).

File formats (`CorpusIndex.from_file`): ``.json`` = list of token-id lists; ``.jsonl`` =
one JSON value per line, a token-id list, ``{"tokens": [...]}`` or (with a tokenizer)
``{"text": "..."}``; ``.txt`` = one text per line (needs a tokenizer).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Callable, Hashable, Iterable, Optional, Sequence

from ..sources import SOURCE_CORPUS
from .base import HostSource, Proposal, longest_match_proposal
from .trie import CountTrie

__all__ = ["CorpusIndex", "corpus_entries", "check_corpus_file"]

Tokenizer = Callable[[str], Sequence[int]]


class CorpusIndex(HostSource):
    """Shared corpus trie; same arguments as `SuffixIndex` (but ``max_nodes``) plus ``max_mb``."""

    name = "corpus"
    member = SOURCE_CORPUS

    def __init__(self, max_depth: int = 16, max_match: int = 8, min_prob: float = 0.1,
                 max_mb: float = 256.0):
        if not 1 <= max_match < max_depth:
            raise ValueError("CorpusIndex needs 1 <= max_match < max_depth")
        self.max_match, self.min_prob = max_match, min_prob
        self.max_bytes = int(max_mb * 1024 * 1024)
        self.trie = CountTrie(max_depth)
        self.num_tokens = 0
        self.truncated = False
        self._tails: dict[Hashable, deque] = {}

    # ------------------------------------------------------------------ building
    def add_sequences(self, seqs: Iterable[Sequence[int]]) -> int:
        """Insert token sequences until the memory cap; returns tokens inserted."""
        added = 0
        for seq in seqs:
            if self.truncated:
                break
            self.trie.reset_stream()
            seq = list(seq)
            for i in range(0, len(seq), 128):
                chunk = seq[i:i + 128]
                self.trie.extend(chunk)
                added += len(chunk)
                if self.trie.memory_bytes() > self.max_bytes:
                    self.truncated = True
                    break
        self.trie.reset_stream()
        self.num_tokens += added
        return added

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer: Tokenizer, **kw) -> "CorpusIndex":
        """Build from raw texts with ``tokenizer(text) -> token ids``."""
        idx = cls(**kw)
        idx.add_sequences(tokenizer(t) for t in texts)
        return idx

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Optional[Tokenizer] = None, vocab_size: Optional[int] = None,
                  **kw) -> "CorpusIndex":
        """Load a corpus file (formats in the module docstring).

        Args:
            vocab_size: when given, every token id must lie in ``[0, vocab_size)``.
        Raises:
            FileNotFoundError: missing file.
            ValueError: unknown suffix, a malformed entry (not a list of token ids, a token outside
                ``[0, vocab_size)``, invalid JSON) or text entries without a tokenizer; the message
                names the file and the entry.
        """
        idx = cls(**kw)
        idx.add_sequences(corpus_entries(path, tokenizer, vocab_size))
        return idx

    # ------------------------------------------------------------------ interface
    def start(self, req_id: Hashable, prompt_ids: Sequence[int], tenant: Optional[Hashable] = None) -> None:
        self._tails[req_id] = deque((int(t) for t in prompt_ids[-self.max_match:]), maxlen=self.max_match)

    def extend(self, req_id: Hashable, new_tokens: Sequence[int]) -> None:
        tail = self._tails.get(req_id)
        if tail is not None:
            tail.extend(int(t) for t in new_tokens[-self.max_match:])

    def stop(self, req_id: Hashable) -> None:
        self._tails.pop(req_id, None)

    def live_requests(self) -> int:
        return len(self._tails)

    def memory_bytes(self) -> int:
        return self.trie.memory_bytes() + 64 * self.max_match * len(self._tails)

    def propose(self, req_id: Hashable, budget: int) -> Proposal:
        """Longest match of the request's context tail in the corpus, then its continuation."""
        tail = self._tails.get(req_id)
        if tail is None or budget <= 0 or self.num_tokens == 0:
            return Proposal()
        return longest_match_proposal((self.trie,), list(tail), self.max_match, budget, self.min_prob)


def corpus_entries(path: str | Path, tokenizer: Optional[Tokenizer] = None,
                   vocab_size: Optional[int] = None) -> Iterable[list]:
    """The token-id lists of a corpus file, one per entry, each checked as it is read.

    Args:
        path: ``.json`` (a list of token-id lists), ``.jsonl`` (one per line: a list, ``{"tokens":
            [...]}`` or ``{"text": ...}``) or ``.txt`` (one text per line).
        tokenizer: for text entries (None: text entries are refused).
        vocab_size: when given, token ids must lie in ``[0, vocab_size)``.
    Yields:
        ``list[int]`` per entry.
    Raises:
        FileNotFoundError: missing file.
        ValueError: naming the file and the entry: unknown suffix, invalid JSON, an entry that is not
            a list of non-negative integers (or below ``vocab_size``), text without a tokenizer.
    """
    p = Path(path)
    if p.suffix not in (".json", ".jsonl", ".txt"):
        raise ValueError(f"corpus {p}: unknown suffix {p.suffix!r} (.json, .jsonl, .txt)")
    if not p.is_file():
        raise FileNotFoundError(f"corpus {p}: no such file")

    def checked(ids, where: str) -> list:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"corpus {p}, {where}: expected a list of token ids, got {str(ids)[:80]}")
        bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
        if bad is not None:
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"corpus {p}, {where}: token id {bad} outside {bound}")
        return ids

    def text(obj, where: str) -> list:
        if tokenizer is None:
            raise ValueError(f"corpus {p}, {where}: text entries need a tokenizer")
        return checked(list(tokenizer(obj)), where)

    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"corpus {p}, line {exc.lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise ValueError(f"corpus {p}: the top level must be a list of token-id lists")
        for i, ids in enumerate(data):
            yield checked(ids, f"entry {i}")
    elif p.suffix == ".jsonl":
        with p.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"corpus {p}, line {n}: invalid JSON ({exc.msg})") from None
                if isinstance(obj, dict) and "tokens" in obj:
                    yield checked(obj["tokens"], f"line {n}")
                elif isinstance(obj, dict) and "text" in obj:
                    yield text(obj["text"], f"line {n}")
                else:
                    yield checked(obj, f"line {n}")
    else:
        with p.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield text(line.rstrip("\n"), f"line {n}")


def check_corpus_file(path: str | Path, vocab_size: Optional[int] = None) -> int:
    """Read a corpus file through `corpus_entries` without building the index (a server's start-up
    check, before the model loads); text entries are taken as valid (they need the tokenizer).

    Returns:
        entries read.
    Raises:
        FileNotFoundError / ValueError: as `corpus_entries`.
    """
    count = 0
    for _ in corpus_entries(path, tokenizer=lambda text: [], vocab_size=vocab_size):
        count += 1
    return count
