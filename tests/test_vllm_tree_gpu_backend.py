"""vllm_worker/tree_attention_gpu.py on CPU tensors (vLLM 0.33's FlashAttention classes import without
a GPU; the op dispatches to its torch reference here): the tree rows after vLLM's attention, the
device tree rows, the vectorised compaction and the registration. vLLM's own FlashAttention and
cache writer need CUDA; they are replaced here by their rules (causal attention over the paged
cache, a slot -1 is not written)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flash_attn")

from tree_attention_cases import dense_expectation, make_case  # noqa: E402


def _impl(case):
    from vllm_worker.tree_attention_gpu import TreeFlashAttentionImpl

    impl = object.__new__(TreeFlashAttentionImpl)
    hq, d = case.query.shape[1], case.query.shape[2]
    impl.num_heads, impl.head_size, impl.num_kv_heads = hq, d, case.key_cache.shape[2]
    impl.scale, impl.kv_cache_dtype, impl.alibi_slopes, impl.logits_soft_cap = case.scale, "auto", None, None
    impl.sliding_window, impl.sinks, impl.dcp_world_size = (-1, -1), None, 1
    return impl


def _causal(case, out):
    """vLLM's FlashAttention rule for every row: causal over the request's keys."""
    hq, hkv, bs = case.query.shape[1], case.key_cache.shape[2], case.key_cache.shape[1]
    for i in range(len(case.parents)):
        s, n = int(case.seq_lens[i]), int(case.tree_lens[i])
        pos = torch.arange(s)
        blk = case.block_table[i].to(torch.int64)[pos // bs]
        k = case.key_cache[blk, pos % bs].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        v = case.value_cache[blk, pos % bs].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        mask = torch.ones(n, s, dtype=torch.bool).tril(s - n)
        q = case.query[case.qsl[i]:case.qsl[i] + n].float().transpose(0, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)
        out[case.qsl[i]:case.qsl[i] + n] = att.transpose(0, 1).to(out.dtype)


def test_tree_rows_follow_their_ancestors_after_flash_attention(monkeypatch):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from vllm_worker.tree_step import TreeStep, set_step

    case = make_case(11, b=4, rep=4, d=32, vllm_layout=True)
    impl = _impl(case)

    def fake_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        _causal(case, output.view(output.shape[0], self.num_heads, self.head_size))
        return output

    monkeypatch.setattr(FlashAttentionImpl, "forward", fake_forward)
    rows = {i: torch.tensor(p) for i, p in enumerate(case.parents) if p is not None}
    step = TreeStep(rows, starts={i: case.qsl[i] for i in rows})
    slot_mapping = torch.arange(case.query.shape[0]) + 1000
    meta = SimpleNamespace(num_actual_tokens=case.query.shape[0], slot_mapping=slot_mapping,
                           seq_lens=case.seq_lens, block_table=case.block_table)
    out = torch.zeros_like(case.query)
    set_step(step)
    try:
        impl.forward(None, case.query, None, None, case.kv_cache, meta, out)
    finally:
        set_step(None)
    causal = torch.zeros_like(case.query)
    _causal(case, causal)
    want = dense_expectation(SimpleNamespace(**{**case.__dict__, "out": causal}))
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
    assert not torch.allclose(out[case.rows], causal[case.rows])     # the tree rows were recomputed
    assert {i: s.tolist() for i, s in step.slots.items()} == \
        {i: (slot_mapping[case.qsl[i]:case.qsl[i] + len(p)]).tolist() for i, p in rows.items()}
    assert len(step.layers) == 1 and step.device_rows is not None


def test_device_compaction_moves_exactly_the_accepted_paths():
    from vllm_worker.tree_step import TreeStep
    from vllm_worker.tree_attention_gpu import FlashLayout, compact

    g = torch.Generator().manual_seed(3)
    h, d, bs, nb = 2, 8, 16, 6
    cache = torch.randn(nb, h, bs, 2 * d, generator=g)
    layout = FlashLayout(d)
    written = []

    def update(layer, key, value, kv_cache, slot_mapping):       # reshape_and_cache_flash's rule
        written.append(int((slot_mapping >= 0).sum()))
        ok = slot_mapping >= 0
        s = slot_mapping[ok]
        kv_cache[s // bs, :, s % bs, :d] = key[ok]
        kv_cache[s // bs, :, s % bs, d:] = value[ok]

    impl = SimpleNamespace(_layout=layout, do_kv_cache_update=update)
    step = TreeStep({0: torch.tensor([-1, 0, 0, 1, 2, 4]), 2: torch.tensor([-1, 0, 1])},
                    slots={0: torch.arange(40, 46), 2: torch.tensor([70, 71, 72])}, layers=[(None, impl, cache)])
    before_k, before_v = layout.gather(cache, torch.arange(nb * bs))
    before_k, before_v = before_k.clone(), before_v.clone()
    accept = torch.tensor([[0, 2, 5, -1, -1, -1], [0, 0, 0, 0, 0, 0], [0, 1, 2, -1, -1, -1]])
    moved = compact(step, accept)
    after_k, after_v = layout.gather(cache, torch.arange(nb * bs))
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[41], want_k[42] = before_k[42], before_k[45]
    want_v[41], want_v[42] = before_v[42], before_v[45]
    assert int(moved) == 2 and written == [2]          # row 2's path is in place already
    assert torch.equal(after_k, want_k) and torch.equal(after_v, want_v)


def test_flash_backend_registration_and_the_attention_check():
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    from vllm_worker import tree_attention_gpu
    from vllm_worker.tree_runner import attention_refusal

    saved = dict(_ATTN_OVERRIDES)
    try:
        tree_attention_gpu.register()
        assert AttentionBackendEnum.FLASH_ATTN.get_path().endswith("tree_attention_gpu.TreeFlashAttentionBackend")
    finally:
        _ATTN_OVERRIDES.clear()
        _ATTN_OVERRIDES.update(saved)
    backend = tree_attention_gpu.TreeFlashAttentionBackend
    assert backend.get_impl_cls() is tree_attention_gpu.TreeFlashAttentionImpl
    assert backend.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.NEVER

    class FlashInferImpl:
        pass

    def config(*impls):
        ctx = {f"layers.{i}.attn": SimpleNamespace(impl=x) for i, x in enumerate(impls)}
        ctx["other"] = SimpleNamespace()
        return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))

    tree = object.__new__(tree_attention_gpu.TreeFlashAttentionImpl)
    assert attention_refusal(config(tree, tree)) is None
    assert attention_refusal(config(tree, FlashInferImpl())) == "the attention backend FlashInferImpl"
