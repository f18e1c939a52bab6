"""Tree attention for vLLM's FlashAttention backend (CUDA): FlashAttention, then the tree rows in one
Triton launch per layer.

`TreeFlashAttentionBackend` is vLLM 0.33's ``FLASH_ATTN`` backend (v1/attention/backends/flash_attn.py)
registered in its place through vLLM's registry (``register_backend(AttentionBackendEnum.FLASH_ATTN,
...)``, registry.py:351; the CUDA platform loads a backend through ``get_path``, which honours
overrides). Its implementation runs vLLM's FlashAttention unchanged, then, for the rows of this
step's trees (`tree_step.set_step`), recomputes attention with `graft::paged_tree_attention`
(graft_spec/kernels/tree_attention.py): the context fully visible, the tree's keys through
`graft_spec.tree.ancestor_mask`, reading the paged cache in place through vLLM's own views
(``kv_cache.transpose(1, 2).split(head_size, dim=-1)``, flash_attn.py:1244). The step's tree rows
go to the device once per step (`device_rows`), before the first layer reads them.

The builder declares no CUDA-graph support (``AttentionCGSupport.NEVER``), so vLLM runs piecewise
graphs with attention eager between them, where the step's trees are read from Python each step.
`compact` moves the accepted paths' KV with device gathers and one ``do_kv_cache_update`` per layer
(slot -1 skips a node, reshape_and_cache_flash's padding rule).

Status: the kernel is checked against its torch reference by Triton's interpreter and compiled for
sm_90 in CI, and on a GPU by scripts/device_check.sh; this backend itself has run only on CPU tensors
in tests (vLLM's FlashAttention replaced by its causal rule), so tree verification on CUDA is opt-in
(``GRAFT_VLLM_VERIFY=tree``, docs/vllm.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)

from graft_spec.kernels.tree_attention import PagedCache, TreeRows, paged_tree_attention
from graft_spec.pipeline import ancestor_mask

from .tree_step import TreeRowsMixin, TreeStep

__all__ = ["TreeFlashAttentionBackend", "TreeFlashAttentionImpl", "FlashLayout", "device_rows", "compact", "register"]


class FlashLayout:
    """Keys and values of cache slots in vLLM 0.33's FlashAttention cache
    (``[num_blocks, H_kv, block_size, 2 * D]``, keys in the first D of the last axis)."""

    def __init__(self, head_size: int):
        self.head_size = head_size

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[S, H_kv, D]`` of slots ``int64[S]`` (block = slot // block size)."""
        bs = kv_cache.shape[2]
        rows = kv_cache[slots // bs, :, slots % bs]                                    # [S, H_kv, 2D]
        return rows[..., : self.head_size], rows[..., self.head_size:]


def device_rows(step: TreeStep, num_reqs: int, device: torch.device) -> TreeRows:
    """The step's `TreeRows` on ``device`` (built on the host from ``step.rows`` and ``step.starts``
    once per step, kept in ``step.device_rows``): node j of tree row i is query row
    ``starts[i] + j``; ``tree_lens`` is 0 for the requests without a tree."""
    if step.device_rows is not None:
        return step.device_rows
    width = max(p.shape[0] for p in step.rows.values())
    rows, req, vis = [], [], []
    tree_lens = torch.zeros(num_reqs, dtype=torch.int32)
    for i, parents in step.rows.items():
        q = parents.shape[0]
        mask = torch.zeros(q, width, dtype=torch.bool)
        mask[:, :q] = ancestor_mask(parents[None].to(torch.int64))[0]
        rows.append(step.starts[i] + torch.arange(q, dtype=torch.int64))
        req.append(torch.full((q,), i, dtype=torch.int64))
        vis.append(mask)
        tree_lens[i] = q
    out = TreeRows(torch.cat(rows).to(device, non_blocking=True), torch.cat(req).to(device, non_blocking=True),
                   torch.cat(vis).to(device, non_blocking=True), tree_lens.to(device, non_blocking=True))
    step.device_rows = out
    return out


class TreeFlashAttentionImpl(TreeRowsMixin, FlashAttentionImpl):
    """vLLM's FlashAttention, then the tree rows recomputed (module docstring)."""

    _layout: Optional[FlashLayout] = None

    def _tree_rows(self, step: TreeStep, layer, query, kv_cache, attn_metadata, output) -> None:
        if self._layout is None:
            self._layout = FlashLayout(self.head_size)
        if not step.slots:
            for i, parents in step.rows.items():
                start = step.starts[i]
                step.slots[i] = attn_metadata.slot_mapping[start:start + parents.shape[0]].to(torch.int64)
        trees = device_rows(step, attn_metadata.seq_lens.shape[0], query.device)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        n = attn_metadata.num_actual_tokens
        paged_tree_attention(output[:n].view(n, self.num_heads, self.head_size),
                             query[:n].view(n, self.num_heads, self.head_size),
                             PagedCache(key_cache, value_cache, attn_metadata.block_table, attn_metadata.seq_lens),
                             trees, self.scale)

    def _check(self) -> None:
        why = [name for name, bad in (("a quantized KV cache", str(self.kv_cache_dtype) != "auto"),
                                      ("ALiBi", self.alibi_slopes is not None),
                                      ("a logits soft cap", bool(self.logits_soft_cap)),
                                      ("a sliding window", self.sliding_window not in (None, (-1, -1), -1)),
                                      ("attention sinks", getattr(self, "sinks", None) is not None),
                                      ("decode context parallelism", getattr(self, "dcp_world_size", 1) > 1))
               if bad]
        if why:
            raise RuntimeError(f"graft: tree attention on FlashAttention does not support {', '.join(why)}")


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """vLLM's builder, declaring no CUDA-graph support: attention runs eager between piecewise graphs,
    where the step's trees are read each step."""

    _cudagraph_support = AttentionCGSupport.NEVER


class TreeFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend with `TreeFlashAttentionImpl` (module docstring)."""

    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeFlashAttentionMetadataBuilder


def compact(step: TreeStep, accept_index: torch.Tensor) -> torch.Tensor:
    """`tree_attention.compact` on the device: each accepted path's keys and values move from the
    slots of its tree indices to the chain's in every layer that attended with the step, one gather
    and one ``do_kv_cache_update`` per layer (nodes already in place get slot -1: not written).
    Sources are read before anything is written.

    Args:
        step: the verified step (its slots and layers).
        accept_index: ``int64[B, W]`` root-first tree indices of each row's accepted path, -1 padded.
    Returns:
        ``int64[]`` nodes moved per layer (a device scalar: no host read here).
    """
    dev = accept_index.device
    if not step.slots or not step.layers:
        return torch.zeros((), dtype=torch.int64, device=dev)
    rows = sorted(step.slots)
    slots = torch.nn.utils.rnn.pad_sequence([step.slots[i] for i in rows], batch_first=True, padding_value=-1)
    width = min(slots.shape[1], accept_index.shape[1])
    path = accept_index[torch.tensor(rows, device=dev)][:, :width].to(slots.device)     # [R, w]
    col = torch.arange(width, device=slots.device)
    move = (path >= 0) & (path != col)
    dst = torch.where(move, slots[:, :width], -1).reshape(-1)
    src = torch.where(move, slots.gather(1, path.clamp(min=0)), slots[:, :width].clamp(min=0)).reshape(-1)
    for layer, impl, kv_cache in step.layers:
        k, v = impl._layout.gather(kv_cache, src)
        impl.do_kv_cache_update(layer, k.contiguous(), v.contiguous(), kv_cache, dst)
    return move.sum()


def register() -> None:
    """Put `TreeFlashAttentionBackend` in place of vLLM's ``FLASH_ATTN`` (registry.py:351). Layers
    built afterwards (the runner's ``load_model``) get it; idempotent."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.FLASH_ATTN, f"{__name__}.TreeFlashAttentionBackend")
