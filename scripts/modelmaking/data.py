"""Token streams for training and evaluation, and deterministic batch sampling from them."""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer


def encode_stream(tok: Tokenizer, docs: list[str], sep_id: int) -> np.ndarray:
    """Concatenate the token ids of ``docs``, each followed by ``sep_id``.

    Returns a 1-D ``uint16`` array (vocabularies here are < 65536).
    """
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep_id)
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and arr.max() >= 2**16:
        raise ValueError("vocabulary too large for a uint16 token stream")
    return arr.astype(np.uint16)


def random_windows(
    stream: np.ndarray, seq_len: int, batch_size: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` windows of ``seq_len`` tokens at random offsets: int64 ``[B, T]``."""
    high = len(stream) - seq_len
    if high <= 0:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than seq_len={seq_len}")
    starts = torch.randint(0, high, (batch_size,), generator=generator).tolist()
    rows = [stream[s : s + seq_len].astype(np.int64) for s in starts]
    return torch.from_numpy(np.stack(rows))


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Consecutive non-overlapping windows from the start of ``stream``: int64 ``[N, T]``.

    ``N = min(max_tokens, len(stream)) // seq_len``; the same windows for every model size that
    shares a tokenizer, so held-out numbers are reproducible.
    """
    n = min(max_tokens, len(stream)) // seq_len
    if n == 0:
        raise ValueError("held-out stream too short for one window")
    arr = stream[: n * seq_len].astype(np.int64).reshape(n, seq_len)
    return torch.from_numpy(arr)
