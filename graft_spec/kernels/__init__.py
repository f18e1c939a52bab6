"""Fused device kernels of the graft step, each beside the torch reference it must equal (bit for bit,
or within float rounding for the outputs an op declares approximate).

One file per op: its torch reference, its Triton kernel, its launcher and one registration
(`registry.fused_op`: a torch custom op whose schema is derived from the reference, the named views
of `views` flattened there), so one launch is one op to the dispatcher (and to
``sglang_patch.bench.step``'s counter), it can be captured in a CUDA graph and traced by
``torch.compile``. The op's CPU implementation is the torch reference; on a CUDA device the Triton
kernel runs (`dispatch`: which runs where).

A round's build (step.py), in order: `draft_part` (the draft's rerank), `request_factors` (the rows'
per-request correction), `successor_part`, `chain_part` (lookup and output index) and `host_part`
(the host proposals, re-anchored), `stack_candidates`, `merge_select_op` (select.py), `tree_layout`
(layout.py). After verify (`GraftPlanner.observe`): `observe_rows`, `successor_update`,
`refresh_table`. Verify of sampled requests: `tree_sample` (target-only tree rejection sampling).
Engines without tree attention (vLLM): `paged_tree_attention` (tree_attention.py), the tree rows'
attention over a paged KV cache.

Tests: every kernel against its reference under ``TRITON_INTERPRET=1`` on CPU tensors
(tests/interpret/, run by tests/test_kernels.py in a subprocess), op by op and inside the planner's
rounds (`shadow.shadow_references`, which the GPU check also runs on a device). Switch:
``GRAFT_REFERENCE_KERNELS=1`` makes every call take the torch reference on every device.
"""

from .dispatch import fused_enabled, fused_kernels_for, fused_ops_everywhere, kernel_path, use_reference_kernels
from .layout import tree_layout

__all__ = ["fused_enabled", "fused_kernels_for", "fused_ops_everywhere", "kernel_path", "tree_layout",
           "use_reference_kernels"]
