"""The paged tree attention kernel (graft_spec/kernels/tree_attention.py) against its torch reference,
run by Triton's interpreter: float32 to rounding (both run the same online softmax; their dot
products and ``exp`` are numpy's and torch's), bfloat16 caches and outputs within one bfloat16 step.

Collected in the main test run, these tests skip unless ``TRITON_INTERPRET=1`` was set before
Triton was imported; tests/test_kernels.py runs this file in a subprocess with it set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported (tests/test_kernels.py)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tree_attention_cases import make_case  # noqa: E402


@pytest.mark.parametrize("seed,rep,d,block_size,vllm_layout", [(0, 1, 16, 16, False), (1, 4, 64, 16, True),
                                                                (2, 2, 16, 32, False), (3, 3, 24, 16, True)])
def test_kernel_equals_reference_float32(seed, rep, d, block_size, vllm_layout):
    from graft_spec.kernels.tree_attention import paged_tree_attention_reference, paged_tree_attention_triton

    case = make_case(seed, b=3, rep=rep, d=d, block_size=block_size, vllm_layout=vllm_layout)
    got, want = case.out.clone(), case.out.clone()
    paged_tree_attention_triton(*case.args(got))
    paged_tree_attention_reference(*case.args(want))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    plain = [j for j in range(got.shape[0]) if j not in set(case.rows.tolist())]
    assert torch.equal(got[plain], case.out[plain])


def test_kernel_equals_reference_bfloat16_at_qwen3_head_shapes():
    from graft_spec.kernels.tree_attention import paged_tree_attention_reference, paged_tree_attention_triton

    # Qwen3-8B's heads (32 over 8: 4 per KV head, D 128) in vLLM 0.33's strided cache views
    case = make_case(5, b=3, hkv=1, rep=4, d=128, dtype=torch.bfloat16, vllm_layout=True)
    got, want = case.out.clone(), case.out.clone()
    paged_tree_attention_triton(*case.args(got))
    paged_tree_attention_reference(*case.args(want))
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-6).all(), float(diff.max())
