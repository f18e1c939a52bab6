"""`TreeStep`: the trees of the verify step being run, shared by the runner (tree_runner.py) and the
tree attention backends (tree_attention.py on CPU, tree_attention_gpu.py on CUDA), and the backends'
common ``forward`` (`TreeRowsMixin`). No vLLM import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["TreeStep", "TreeRowsMixin", "set_step", "current_step"]


@dataclass
class TreeStep:
    """The trees of the verify step being run.

    Attributes:
        rows: ``{request row: int64[q] parents}`` for every request whose scheduled tokens are a tree
            (node 0 its root, -1 there); rows not listed are attended as vLLM does.
        slots: ``{request row: int64[q]}`` the cache slots of each tree's nodes (filled by the first
            layer that attends with the step).
        layers: the ``(layer, impl, kv_cache)`` of every layer that attended with the step (the
            target's), for the KV compaction after verification (`compact`).
        context: ``{request row: (int64[T] slots, bool[q, T] visible)}`` every context position's
            slot and each node's visible keys (T = the row's sequence length), the same in every
            layer (filled by the first; the CPU backend).
        starts: ``{request row: int}`` the first query row of each tree (host: the runner's
            ``query_start_loc``), for the CUDA backend.
        device_rows: the CUDA backend's device `TreeRows` of the step (built by its first layer,
            `tree_attention_gpu.device_rows`), or None.
    """

    rows: dict
    starts: dict = field(default_factory=dict)
    slots: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    context: dict = field(default_factory=dict)
    device_rows: Optional[Any] = None


_STEP: Optional[TreeStep] = None


def set_step(step: Optional[TreeStep]) -> None:
    """Set (or clear, None) the trees the next target forward attends with."""
    global _STEP
    _STEP = step


def current_step() -> Optional[TreeStep]:
    """The trees set by `set_step`, or None."""
    return _STEP




class TreeRowsMixin:
    """``forward`` of a tree attention implementation: the vLLM implementation it is mixed into runs
    unchanged, then, when a step's trees are set (`set_step`) and the batch has metadata, the
    subclass's ``_check`` refuses what it does not implement and ``_tree_rows`` recomputes the tree
    rows into ``output`` (and records the layer in ``step.layers`` for the compaction)."""

    #: the mark `tree_runner.attention_refusal` looks for on every attention layer's implementation
    graft_tree = True

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        step = current_step()
        if step is None or attn_metadata is None or not step.rows:
            return out
        self._check()
        self._tree_rows(step, layer, query, kv_cache, attn_metadata, output)
        step.layers.append((layer, self, kv_cache))
        return out
