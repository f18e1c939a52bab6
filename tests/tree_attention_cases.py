"""Random paged-cache tree attention cases, shared by the reference test (tests/test_tree_attention.py)
and the interpreted kernel test (tests/interpret/test_tree_attention_interpreted.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

from graft_spec.kernels.tree_attention import PagedCache, TreeRows
from graft_spec.pipeline import ancestor_mask


@dataclass
class Case:
    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    tree_lens: torch.Tensor
    rows: torch.Tensor
    req: torch.Tensor
    visible: torch.Tensor
    scale: float
    parents: list          # per request: its tree's parents (None for a request without a tree)
    qsl: list              # query start of each request in the step's rows
    kv_cache: Optional[torch.Tensor] = None   # vllm_layout: the [num_blocks, H_kv, block_size, 2 D] tensor

    def args(self, out=None, visible=None):
        """``(out, query, PagedCache, TreeRows, scale)`` for the op (``out`` a copy unless given)."""
        return (self.out.clone() if out is None else out, self.query,
                PagedCache(self.key_cache, self.value_cache, self.block_table, self.seq_lens),
                TreeRows(self.rows, self.req, self.visible if visible is None else visible, self.tree_lens),
                self.scale)


def make_case(seed: int, b: int = 3, max_nodes: int = 9, hkv: int = 2, rep: int = 2, d: int = 16,
              block_size: int = 16, dtype=torch.float32, max_ctx: int = 70, vllm_layout: bool = False) -> Case:
    """``b`` requests, each with a context of 0..max_ctx tokens and a random tree of 1..max_nodes
    nodes (one request a plain prefill row without a tree when b > 2), blocks shuffled over a
    cache with spare blocks, a wider ``visible`` than the largest tree. ``vllm_layout``: the caches
    are vLLM 0.33's FlashAttention views of one ``[num_blocks, H_kv, block_size, 2 * D]`` tensor
    (``kv_cache.transpose(1, 2).split(D, dim=-1)``, flash_attn.py:1244), strided."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    hq = hkv * rep
    parents, ctx, q_lens = [], [], []
    for i in range(b):
        n = rng.randint(1, max_nodes)
        plain = b > 2 and i == 1
        parents.append(None if plain else [-1] + [rng.randrange(j) for j in range(1, n)])
        ctx.append(rng.randint(0, max_ctx))
        q_lens.append(n)
    seq = [c + n for c, n in zip(ctx, q_lens)]
    blocks = [-(-s // block_size) for s in seq]
    total = sum(blocks) + 3
    order = torch.randperm(total, generator=g).tolist()
    table = torch.zeros(b, max(blocks) + 1, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.tensor(order[at:at + nb], dtype=torch.int32)
        at += nb
    kv_cache = None
    if vllm_layout:
        kv_cache = torch.randn(total, hkv, block_size, 2 * d, generator=g).to(dtype)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    else:
        key_cache = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
        value_cache = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    t = sum(q_lens)
    query = torch.randn(t, hq, d, generator=g).to(dtype)
    out = torch.randn(t, hq, d, generator=g).to(dtype)
    width = max_nodes + 2
    rows, req, vis, qsl = [], [], [], [0]
    for i, p in enumerate(parents):
        if p is not None:
            mask = ancestor_mask(torch.tensor([p], dtype=torch.int64))[0]
            for j in range(len(p)):
                rows.append(qsl[-1] + j)
                req.append(i)
                row = torch.zeros(width, dtype=torch.bool)
                row[: len(p)] = mask[j]
                vis.append(row)
        qsl.append(qsl[-1] + q_lens[i])
    return Case(out, query, key_cache, value_cache, table, torch.tensor(seq, dtype=torch.int32),
                torch.tensor(q_lens, dtype=torch.int32), torch.tensor(rows, dtype=torch.int64),
                torch.tensor(req, dtype=torch.int64), torch.stack(vis), d ** -0.5, parents, qsl, kv_cache)


def dense_expectation(case: Case) -> torch.Tensor:
    """The tree rows' attention by plain SDPA over each request's gathered keys (float32): the
    context visible, the tree's keys where the ancestor mask says; every other row left as given."""
    out = case.out.float().clone()
    hq, hkv = case.query.shape[1], case.key_cache.shape[2]
    bs = case.key_cache.shape[1]
    for i, p in enumerate(case.parents):
        if p is None:
            continue
        s, n = int(case.seq_lens[i]), len(p)
        pos = torch.arange(s)
        blk = case.block_table[i].to(torch.int64)[pos // bs]
        k = case.key_cache[blk, pos % bs].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        v = case.value_cache[blk, pos % bs].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        mask = torch.ones(n, s, dtype=torch.bool)
        mask[:, s - n:] = ancestor_mask(torch.tensor([p], dtype=torch.int64))[0]
        q = case.query[case.qsl[i]:case.qsl[i] + n].float().transpose(0, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)
        out[case.qsl[i]:case.qsl[i] + n] = att.transpose(0, 1)
    return out
