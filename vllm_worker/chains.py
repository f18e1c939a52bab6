"""Graft rounds for an engine that verifies one chain per request (vLLM 0.33, which has no tree
verify): the planner's step with retrieved candidates capped at the chain's depth, and the
calibration fed from the committed tokens alone (docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from graft_spec.chain import cap_depth
from graft_spec.pipeline import (DraftCandidates, GraftPlanner, HostCandidates, RoundStats, StepOutput,
                                 on_path_from_tokens)

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
                      slot_ids: torch.Tensor) -> RoundStats:
    """`GraftPlanner.observe` for an engine that verifies one chain of the tree and reports only the
    tokens it committed (vLLM 0.33). The accepted nodes come from the tokens (`on_path_from_tokens`); nodes the
    tokens say nothing about (on a matching path below the committed depth) count in neither the
    calibration nor the per-request windows; the successor table learns every committed transition
    (root -> first token -> ...) as the target's top-1 in the row's group (such an engine gives no
    target top-k). Device only, no host read.

    Args:
        out: the round's `StepOutput` ``[B, N]``.
        committed: ``int64[B, L]`` tokens committed after the root (accepted, then the bonus).
        lens: ``int64[B]`` valid tokens per row; 0 = the row was not verified (nothing counted,
            nothing appended).
        slot_ids: ``int64[B]`` engine slots.
    Returns:
        `GraftPlanner.observe`'s `RoundStats`.
    """
    on_path, known = on_path_from_tokens(out.tree, committed, lens)
    bins = torch.where(known[:, :, None], out.member_bins, -1)
    stats = planner.observe(replace(out, member_bins=bins), on_path, None, committed, lens, slot_ids)
    if planner.successor is not None and committed.shape[1] > 0:
        # transitions t -> u along root, committed[0], ...: rows [B * L], the invalid ones masked
        prev = torch.cat([out.tree.tokens[:, :1], committed[:, :-1]], 1)                # [B, L]
        valid = torch.arange(committed.shape[1], device=committed.device)[None, :] < lens[:, None]
        groups = out.groups if out.groups is not None else torch.zeros_like(lens)
        planner.successor.update(prev.reshape(-1), committed.reshape(-1, 1), valid.reshape(-1),
                              groups[:, None].expand_as(prev).reshape(-1))
    return stats
