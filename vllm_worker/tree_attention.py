"""Tree attention for vLLM's CPU backend: each tree node attends to the context and its own ancestors.

vLLM 0.33 has no tree attention (its tree_attn.py was removed; it took one static mask for every
request). A verify step with graft trees schedules each request's tree nodes as its query tokens,
parents first; vLLM's kernels attend causally, so node j would also see the nodes before it that are
not its ancestors. `TreeCPUAttentionBackend` is vLLM's CPU backend (v1/attention/backends/cpu_attn.py)
registered in its place through vLLM's registry (``register_backend(AttentionBackendEnum.CPU_ATTN,
...)``, v1/attention/backends/registry.py:340; the CPU platform returns ``CPU_ATTN.get_path()``, which
honours overrides, platforms/cpu.py:179). Its implementation runs vLLM's kernel unchanged, then, for
the rows of this step's trees (`set_step`), recomputes attention in torch: the context's keys all
visible, the tree's keys only where `graft_spec.tree.ancestor_mask` says so. Keys and values are read
back from the paged cache through `KVLayout`, a probe of where vLLM's own cache writer
(``cpu_attn_reshape_and_cache``, whose layout is packed per instruction set, cpu_attn.py:73) puts
every element. Rows outside the trees (prefills, plain decodes, the drafter's layers: the step is
cleared before drafting) are vLLM's.

The CPU path is for correctness (the tests of the plugin run on it); it refuses what it does not
implement: quantized KV caches, ALiBi, soft caps, sliding windows and attention sinks.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from graft_spec.pipeline import ancestor_mask

from .tree_step import TreeRowsMixin, TreeStep

__all__ = ["TreeCPUAttentionBackend", "KVLayout", "compact", "register"]


class KVLayout:
    """Where vLLM's CPU cache writer puts each key / value element inside a block.

    Args:
        impl: the layer's attention implementation (its ``num_kv_heads``, ``head_size``).
        layer: the attention layer (``isa``, the scales).
        kv_cache: the layer's ``[num_blocks, H, block_size, 2 * D]`` cache (dtype, block size).
    Raises:
        RuntimeError: the writer is not a permutation of the block (a quantized cache).
    """

    def __init__(self, impl, layer, kv_cache: torch.Tensor):
        from vllm import _custom_ops as ops

        _, h, bs, two_d = kv_cache.shape
        d = two_d // 2
        self.block_size, self.heads, self.dim = bs, h, d
        n = bs * h * d
        digits = max(1, math.ceil(math.log(n, 64)))
        found = torch.zeros(2, h, bs, d, dtype=torch.int64)   # [key / value] -> flat element index
        for k in range(digits):
            code = (torch.arange(n, dtype=torch.int64) // 64 ** k) % 64 + 1   # exact in any float dtype
            vals = code.reshape(bs, h, d).to(kv_cache.dtype)
            probe = torch.zeros(1, h, 2 * bs, d, dtype=kv_cache.dtype)
            key_cache, value_cache = probe.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(vals, vals, key_cache, value_cache, torch.arange(bs, dtype=torch.int64),
                                           layer.isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=impl.kv_cache_dtype)
            for part, cache in enumerate((key_cache, value_cache)):
                got = cache[0].to(torch.int64) - 1                       # [h, bs, d] in the cache's indexing
                if (got < 0).any() or (got >= 64).any():
                    raise RuntimeError("graft: vLLM's CPU KV cache writer is not a permutation here "
                                       f"(dtype {kv_cache.dtype}, isa {layer.isa}); tree attention refuses it")
                found[part] += got * 64 ** k
        # found[part, h', o', d'] = flat (o, h, d) of the element stored at (h', o', d')
        self.where = torch.empty(2, n, dtype=torch.int64)
        cells = torch.arange(n, dtype=torch.int64)
        for part in range(2):
            flat = found[part].reshape(-1)
            if not torch.equal(torch.sort(flat).values, cells):
                raise RuntimeError("graft: vLLM's CPU KV cache writer is not a permutation here; "
                                   "tree attention refuses it")
            self.where[part, flat] = cells       # element (o, h, d) -> position in the [h, bs, d] block view

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[S, H, D]`` of cache slots ``int64[S]`` (block = slot // block size)."""
        nb = kv_cache.shape[0]
        view = kv_cache.view(nb, self.heads, self.block_size * 2, self.dim)
        key_cache, value_cache = view.chunk(2, dim=2)
        block, off = slots // self.block_size, slots % self.block_size
        inner = (off[:, None, None] * self.heads + torch.arange(self.heads)[None, :, None]) * self.dim \
            + torch.arange(self.dim)[None, None, :]                                    # [S, H, D] of (o, h, d)
        out = []
        for part, cache in enumerate((key_cache, value_cache)):
            pos = self.where[part][inner]
            hh, rest = pos // (self.block_size * self.dim), pos % (self.block_size * self.dim)
            out.append(cache[block[:, None, None], hh, rest // self.dim, rest % self.dim])
        return out[0], out[1]


class TreeCPUAttentionImpl(TreeRowsMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention, then tree rows recomputed (module docstring)."""

    _layout: Optional[KVLayout] = None

    def _tree_rows(self, step: TreeStep, layer, query, kv_cache, attn_metadata, output) -> None:
        if self._layout is None:
            self._layout = KVLayout(self, layer, kv_cache)
        qsl = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        bs = self._layout.block_size
        o = output.view(output.shape[0], self.num_heads, self.head_size)
        for i, parents in step.rows.items():
            start, q = qsl[i], qsl[i + 1] - qsl[i]
            if q != parents.shape[0]:
                raise RuntimeError(f"graft: request row {i} runs {q} query tokens for a tree of {parents.shape[0]}")
            if i not in step.context:
                step.slots[i] = attn_metadata.slot_mapping[start:start + q].to(torch.int64).clone()
                total = seq_lens[i]
                pos = torch.arange(total, dtype=torch.int64)
                visible = torch.ones(q, total, dtype=torch.bool)
                visible[:, total - q:] = ancestor_mask(parents[None].to(torch.int64))[0]
                step.context[i] = (attn_metadata.block_table[i].to(torch.int64)[pos // bs] * bs + pos % bs, visible)
            slots, visible = step.context[i]
            k, v = self._layout.gather(kv_cache, slots)                       # [T, Hkv, D]
            qq = query[start:start + q].transpose(0, 1).float()                # [Hq, q, D]
            rep = self.num_queries_per_kv
            kk = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)      # [Hq, T, D]
            vv = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
            att = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=visible, scale=self.scale)
            o[start:start + q] = att.transpose(0, 1).to(o.dtype)

    def _check(self) -> None:
        why = [name for name, bad in (("quantized KV cache", self.is_fp8_kv_cache),
                                      ("ALiBi", self.alibi_slopes is not None),
                                      ("logits soft cap", bool(self.logits_soft_cap)),
                                      ("sliding window", self.sliding_window not in (-1, None)),
                                      ("attention sinks", self.sinks is not None)) if bad]
        if why:
            raise RuntimeError(f"graft: tree attention on CPU does not support {', '.join(why)}")


def compact(step: TreeStep, accept_index: torch.Tensor) -> int:
    """Move each accepted path's keys and values to the chain's slots, in every layer that attended
    with the step: path node j (tree index ``accept_index[i, j]``) sits at the slot of tree index
    ``accept_index[i, j]`` and belongs at the slot of index j, where the next step (and vLLM's
    prefix cache, which hashes the committed tokens) expects position ``P + j``. All sources are
    read before anything is written (through the backend's own writer, ``do_kv_cache_update``).

    Args:
        step: the verified step (its slots and layers).
        accept_index: ``int64[B, W]`` root-first tree indices of each row's accepted path, -1 padded.
    Returns:
        the number of nodes moved per layer.
    """
    src, dst = [], []
    for i, slots in step.slots.items():
        path = [int(x) for x in accept_index[i].tolist() if x >= 0]
        for j, v in enumerate(path):
            if v != j:
                src.append(int(slots[v]))
                dst.append(int(slots[j]))
    if not src:
        return 0
    s = torch.tensor(src, dtype=torch.int64)
    d = torch.tensor(dst, dtype=torch.int64)
    for layer, impl, kv_cache in step.layers:
        k, v = impl._layout.gather(kv_cache, s)
        impl.do_kv_cache_update(layer, k.contiguous(), v.contiguous(), kv_cache, d)
    return len(src)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with `TreeCPUAttentionImpl` (module docstring)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl


def register() -> None:
    """Put `TreeCPUAttentionBackend` in place of vLLM's ``CPU_ATTN`` (registry.py:340). Layers
    built afterwards (the runner's ``load_model``) get it; idempotent."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.TreeCPUAttentionBackend")
