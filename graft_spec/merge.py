"""Merge draft and retrieved candidates into exactly N nodes (paper Sec. 3.3, Algorithm 2).

`merge_select` works on one stacked candidate list per request (draft nodes first, root at index 0,
then the successor template, then the host proposals), batched, with fixed iteration counts:

1. **Dedupe by path.** Every node gets a 64-bit hash of its root path (pointer jumping,
   ceil(log2 U) gathers); nodes with equal hashes are the same path (groups found by bucket
   scatter, `canonical_nodes`, no sort), so a retrieved path "hangs under the deepest existing node
   whose path is its prefix" automatically: its prefix merges into the existing nodes and only the
   new suffix is added. The lowest index of a group is kept (draft nodes come first), children are
   re-pointed to it, so sibling tokens are distinct. A (2**-64-unlikely) hash collision can only
   merge two paths, never duplicate one: the tree stays a tree of deterministic candidates with
   distinct siblings, so verification stays lossless; only efficiency would suffer.
2. **Priority.** A merged group takes its members' best key (and, for reporting, the source and
   estimate of that member); every member's calibration bin is kept per member source, so each
   source that proposed a verified node is credited (calibration.py). A group with a draft member
   and a retrieval member is an *agreement* node: with ``agreement`` given, its estimate and key are
   raised to its agreement bin's estimate (the draft bin's axes, member ``agree``), which is
   credited instead of the draft bin. Keys are made non-increasing along paths (`path_min`).
3. **Fill.** Keep the N - 1 best non-root nodes (ties: lower index). With keys = estimated path
   acceptance this maximises the expected accepted length (calibration.py); monotone keys plus the
   index tie-break keep the selection ancestor-closed.
4. **Compact** in stacked order (topological: every parent, after re-pointing, has a smaller
   index) and **pad** the rest: padding nodes are children of the root with the smallest token ids
   not used by the root's real children (0, 1, ...), so even padding keeps siblings distinct;
   ``source = SOURCE_PADDING``, ``logp = -inf``. A real node's source is its best member's, or
   ``SOURCE_AGREE`` for an agreement node (graft_spec/sources.py).

No host reads and no data-dependent shapes: the same code runs eagerly on CPU, on an accelerator,
on ``meta`` tensors and under ``torch.compile(fullgraph=True)`` (tests/test_core_step.py).
On a CUDA device (and inside `kernels.fused_ops_everywhere`) `merge_select` is one fused op,
``graft::merge_select`` (graft_spec/kernels/select.py); this torch code, `merge_select_reference`,
is its CPU implementation and the reference it equals bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import GraftPolicy
from .kernels.select import canonical_nodes, merge_select_op, merge_select_reference, path_hashes, sibling_caps
from .kernels.views import Agreement, Candidates, SelectOptions
from .tree import DraftTree

__all__ = ["path_hashes", "canonical_nodes", "sibling_caps", "merge_select", "merge_select_reference"]




def merge_select(cands: Candidates, num_nodes: int, policy: Optional[GraftPolicy] = None,
                 gain_nodes: Optional[int] = None, sampled: Optional[torch.Tensor] = None,
                 agreement: Optional[tuple] = None) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
    """Build the hybrid tree from a stacked candidate list (see module docstring).

    Args:
        cands: the stacked `Candidates` ``[B, U]`` (`Candidates.stack`): index 0 is the root (the
            last verified token, parent -1), every other parent is an index below the node's own;
            ``priority`` (``key`` or ``est``) is the selection key (+inf = always keep), ``est`` the
            estimated path acceptance reported as the node's ``logp``; a node whose parent is not
            ``valid`` is dropped with it (the root is always valid); ``member`` and ``bins`` are
            each candidate's member source and calibration bin (the root's are ignored).
        num_nodes: N >= 2, root included.
        policy: ``min_score`` (drop nodes whose estimate is below it, unless their key is +inf) and
            ``root_width`` (at most this many new retrieved children of the root).
        gain_nodes: length + 1 of the gain curve (default ``num_nodes``): the curve prices trees of
            every width up to ``gain_nodes`` from the same candidates (the batch budget, budget.py).
        sampled: ``bool[B]`` rows verified by sampling (None: all greedy); with
            ``policy.exclusive_siblings == "greedy"`` only the other rows get `sibling_caps`.
        agreement: ``(offset, estimates[, rows[, invert]])``: the agreement bin of a node is its draft
            bin + ``offset`` (``BinLayout.offset(SOURCE_AGREE)``), priced from the ``float32`` table
            ``estimates`` (`Calibrator.table`), on the rows where ``bool[B]`` ``rows`` is not
            ``invert`` (default False; ``rows`` None or absent: every row); None and the other rows:
            agreement nodes are priced by their best
            member and credit the draft bin (calibration.py).
    Returns:
        ``(tree, member_bins, gain)``: ``gain`` ``float32[B, gain_nodes - 1]``, ``gain[:, k]`` = sum
        of the estimates of the k + 1 best non-root nodes (the selection order; every prefix of it is
        ancestor-closed), so a tree of w nodes is expected to accept ``1 + gain[:, w - 2]`` tokens; `DraftTree` ``[B, N]`` (topological, distinct siblings, padding only
        after the real nodes, ``logp`` = log of the estimate, source: the best member's, ``SOURCE_AGREE`` for an
        agreement node, ``SOURCE_PADDING`` for padding) and ``int64[B, N, NUM_MEMBERS]`` the bin of every member of every node (-1 none;
        the root and padding have none).
    Raises:
        ValueError: ``num_nodes < 2``.
    """
    if num_nodes < 2:
        raise ValueError(f"merge_select: num_nodes={num_nodes} must be >= 2")
    policy = policy if policy is not None else GraftPolicy()
    agree = None
    if agreement is not None:
        offset, table, *rest = agreement
        agree = Agreement(int(offset), table, rest[0] if rest else None, bool(rest[1]) if len(rest) > 1 else False)
    opts = SelectOptions(num_nodes, gain_nodes or num_nodes, float(policy.min_score), policy.root_width,
                         policy.exclusive_siblings)
    tokens, parents, logp, source, member_bins, gain = merge_select_op(cands, opts, sampled, agree)
    return DraftTree(tokens, parents, logp, source), member_bins, gain


