"""Graft rounds for vLLM: the planner's step with retrieved candidates capped at the verified depth,
and the round's bookkeeping from what the engine reports: the committed tokens alone for a chain
(vLLM 0.33 has no tree verify), the whole tree's outcome where the plugin verified a tree
(tree_runner.py; docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from graft_spec.chain import cap_depth
from graft_spec.pipeline import (SOURCE_PADDING, DraftCandidates, GraftPlanner, HostCandidates, RoundStats,
                                 StepOutput, on_path_from_tokens)

__all__ = ["build_chains", "observe_committed"]


def build_chains(planner: GraftPlanner, draft: DraftCandidates, roots: torch.Tensor, host: HostCandidates,
                 slot_ids: torch.Tensor, seq_lens: torch.Tensor, sampled: torch.Tensor, max_depth: int) -> StepOutput:
    """`GraftPlanner.build` for an engine that verifies one chain of at most ``max_depth`` tokens
    per request (vLLM 0.33's K): retrieved candidates deeper than ``max_depth`` are dropped before
    the N - 1 nodes are chosen (`chain.cap_depth`), so the budget goes to nodes a chain can use.
    Arguments and result as for `GraftPlanner.build` (full width N)."""
    hist, count = planner.history.gather(slot_ids)
    est, factors = planner.calibrator.table, planner.factors(slot_ids)
    parts = cap_depth(planner.step.retrieve(roots, host, hist, count, seq_lens, sampled, est, factors), max_depth)
    return planner.step(draft, roots, host, hist, count, seq_lens, sampled, est, factors, parts)

def observe_committed(planner: GraftPlanner, out: StepOutput, committed: torch.Tensor, lens: torch.Tensor,
                      slot_ids: torch.Tensor, verified: Optional[torch.Tensor] = None,
                      target_topk: Optional[torch.Tensor] = None) -> RoundStats:
    """`GraftPlanner.observe` from the tokens the engine committed, and the tree's outcome where the
    engine verified a tree. Device only, no host read.

    The accepted nodes come from the tokens (`on_path_from_tokens`). A row verified as a chain (or
    without ``verified``): nodes the tokens say nothing about (on a matching path below the committed
    depth) count in neither the calibration nor the per-request windows, and the successor table
    learns every committed transition (root -> first token -> ...) as the target's top-1 in the
    row's group. A row verified as a tree (``verified`` has a node in it): only its verified nodes
    count, and the successor table learns the target's top-k after every verified node, as SGLang's
    worker does (sglang_patch/graft_worker.py ``_after_verify``).

    Args:
        out: the round's `StepOutput` ``[B, N]``.
        committed: ``int64[B, L]`` tokens committed after the root (accepted, then the bonus).
        lens: ``int64[B]`` valid tokens per row; 0 = the row was not verified (nothing counted,
            nothing appended).
        slot_ids: ``int64[B]`` engine slots.
        verified: ``bool[B, N]`` nodes of ``out.tree`` the target verified as a tree (all False in a
            row verified as a chain), or None.
        target_topk: ``int64[B, N, k]`` the target's top-k after every verified node, best first
            (read where ``verified``); required with ``verified`` when the planner has a successor table.
    Returns:
        `GraftPlanner.observe`'s `RoundStats`.
    Raises:
        ValueError: ``verified`` without ``target_topk`` on a planner with a successor table.
    """
    on_path, known = on_path_from_tokens(out.tree, committed, lens)
    tree_rows = verified.any(1) if verified is not None else torch.zeros_like(lens, dtype=torch.bool)
    if verified is not None:
        known = torch.where(tree_rows[:, None], known & verified, known)
    bins = torch.where(known[:, :, None], out.member_bins, -1)
    stats = planner.observe(replace(out, member_bins=bins), on_path, None, committed, lens, slot_ids)
    if planner.successor is None:
        return stats
    groups = out.groups if out.groups is not None else torch.zeros_like(lens)
    if verified is not None:
        if target_topk is None:
            raise ValueError("observe_committed: verified trees need the target's top-k for the successor table")
        learn = verified & (out.tree.source != SOURCE_PADDING) & (lens > 0)[:, None]
        planner.successor.update(out.tree.tokens, target_topk.reshape(learn.numel(), -1), learn, groups)
    if committed.shape[1] > 0:
        # transitions t -> u along root, committed[0], ...: rows [B * L], the invalid ones masked
        prev = torch.cat([out.tree.tokens[:, :1], committed[:, :-1]], 1)                # [B, L]
        valid = torch.arange(committed.shape[1], device=committed.device)[None, :] < lens[:, None]
        valid &= ~tree_rows[:, None]
        planner.successor.update(prev.reshape(-1), committed.reshape(-1, 1), valid.reshape(-1),
                                 groups[:, None].expand_as(prev).reshape(-1))
    return stats
