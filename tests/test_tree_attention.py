"""`paged_tree_attention_reference` (graft_spec/kernels/tree_attention.py) against plain SDPA over the
gathered keys with the ancestor mask; the kernel against the reference runs under the interpreter
(tests/interpret/test_tree_attention_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from graft_spec.kernels.tree_attention import paged_tree_attention, paged_tree_attention_reference
from tree_attention_cases import dense_expectation, make_case


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rep", [1, 4])
@pytest.mark.parametrize("vllm_layout", [False, True], ids=["contiguous", "vllm-0.33-views"])
def test_reference_equals_masked_sdpa_over_the_paged_context(seed, rep, vllm_layout):
    case = make_case(seed, b=4, rep=rep, vllm_layout=vllm_layout)
    out = case.out.clone()
    paged_tree_attention_reference(*case.args(out))
    want = dense_expectation(case)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
    plain = [j for j in range(out.shape[0]) if j not in set(case.rows.tolist())]
    assert torch.equal(out[plain], case.out[plain])          # rows outside the trees untouched


def test_mask_matters_and_cpu_dispatch_is_the_reference():
    """Dropping the ancestor mask (every tree node visible) changes the tree rows; on CPU the op runs
    the reference."""
    case = make_case(7, b=3, max_nodes=9)
    out = case.out.clone()
    paged_tree_attention(*case.args(out))
    ref = case.out.clone()
    paged_tree_attention_reference(*case.args(ref))
    assert torch.equal(out, ref)
    causal = case.out.clone()
    paged_tree_attention_reference(*case.args(causal, visible=torch.ones_like(case.visible)))
    assert not torch.allclose(causal[case.rows], out[case.rows])


def test_bad_shapes_are_refused():
    case = make_case(1)
    out, query, cache, trees, scale = case.args()
    with pytest.raises(ValueError, match="do not describe the same tree nodes"):
        paged_tree_attention_reference(out, query, cache, trees._replace(req=case.req[:-1]), scale)
    d_major = case.value_cache.transpose(-1, -2).contiguous().transpose(-1, -2)      # same shape, D strided
    with pytest.raises(ValueError, match="must agree and be 1 along D"):
        paged_tree_attention_reference(out, query, cache._replace(value_cache=d_major), trees, scale)
    with pytest.raises(ValueError, match="query heads"):
        paged_tree_attention_reference(out[:, :3].clone(), query[:, :3].contiguous(), cache, trees, scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/device_check.sh)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_equals_the_reference_on_random_trees(dtype):
    """On a GPU: the Triton kernel (one launch) against the torch reference on the same device, random
    trees of up to 60 nodes over contexts of up to 1,000 tokens, Qwen3-8B's heads (32 over 8, D 128)."""
    for seed in range(3):
        case = make_case(seed, b=6, max_nodes=60, hkv=8, rep=4, d=128, dtype=dtype, max_ctx=1000,
                         vllm_layout=seed > 0)
        out, query, cache, trees, scale = case.args()
        cache = type(cache)(*(x.cuda() for x in cache))
        trees = type(trees)(*(x.cuda() for x in trees))
        got, want = out.cuda(), out.cuda()
        paged_tree_attention(got, query.cuda(), cache, trees, scale)
        paged_tree_attention_reference(want, query.cuda(), cache, trees, scale)
        tol = 2e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
