"""The verify tree-mask writer (sglang_patch/tree_mask.py) against its torch reference, under Triton's
interpreter on CPU: every cell the attention reads (the requests' rows; with ``fill_prefix`` the
reference also sets the cells after them, the kernel leaves those alone). Skipped unless
``TRITON_INTERPRET=1`` was set before Triton was imported (tests/test_kernels.py runs it so)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported (tests/test_kernels.py)")


@st.composite
def cases(draw):
    b = draw(st.sampled_from([1, 3, 16]))
    n = draw(st.sampled_from([2, 5, 24, 60]))
    seq = torch.tensor([draw(st.integers(0, 2500)) for _ in range(b)], dtype=torch.int64)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    mask = torch.rand(b, n, n, generator=gen) < 0.5
    mode = draw(st.sampled_from([0, 1]))
    fill = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.bool, torch.uint8]))
    return mask, seq, mode, fill, dtype, gen


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_verify_mask_kernel_equals_reference(case):
    from sglang_patch.tree_mask import FULL_MASK, verify_mask_reference, verify_mask_triton

    mask, seq, mode, fill, dtype, gen = case
    b, n, _ = mask.shape
    used = int((seq * n + n * n).sum()) if mode == FULL_MASK else b * n * n
    start = (torch.rand(used + 37, generator=gen) < 0.5).to(dtype)   # stale cells from an earlier round
    ref, fused = start.clone(), start.clone()
    verify_mask_reference(ref, mask, seq, mode, fill)
    verify_mask_triton(fused, mask, seq, mode, fill)
    assert torch.equal(fused[:used], ref[:used])
    if not (fill and mode == FULL_MASK):
        assert torch.equal(fused, ref)                  # nothing else written
    else:
        assert torch.equal(fused[used:], start[used:])  # the kernel writes only the requests' rows
