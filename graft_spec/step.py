"""The per-round graft step: one pure function of device tensors with static shapes.

`GraftStep.__call__` turns one decode round's inputs into the verify input of the hybrid tree:

    draft candidates [B, S]  --calibrated rerank-->  N draft nodes  --+
    root tokens [B] --successor table--> T template nodes ------------+
    slot history [B, L] --lookup--> N - 1 chain nodes ----------------+--merge_select--> tree [B, N]
    host buffer [B, M] --re-anchor--> M host nodes -------------------+        |
                                                                      layout: positions, mask, links

The retrieved parts come from the step's sources (device_sources.py: one `DeviceSource` each, one
fused op each on a CUDA device). Every candidate is priced in one currency, its calibrated estimate
of lying on the accepted path (calibration.py); `merge_select` keeps the ancestor-closed N - 1 best (merge.py). With
``checkpoints`` in the config the draft part follows the paper's confidence gating instead (kept
draft nodes always in, pruned ones refill what retrieval leaves).

Host proposals are anchored at the context the host knew (``anchor_len`` tokens). The device knows
``seq_len + 1`` tokens (committed + root). Under the overlap scheduler the host lags one round, so
the step *re-anchors* each proposal on the tokens committed since (`reanchor`, read from the slot's
device history): a proposed path whose first ``gap`` tokens equal them continues under the new root,
shortened by ``gap``; every other path is dropped. Without overlap ``gap`` is 0 and nothing
changes. The lookup source (numerics/lookup.py) reads the same history and has no lag at all.

No ``.item()``, ``.tolist()``, host copies, data-dependent Python control flow or data-dependent
shapes: the same code runs eagerly on CPU and accelerators, on ``meta`` tensors and under
``torch.compile(fullgraph=True, dynamic=False)`` (tests/test_core_step.py proves all three).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .calibration import Calibrator
from .device_sources import RoundInputs, device_sources
from .gate import kth_best
from .config import GraftConfig
from .merge import merge_select
from .kernels import tree_layout as fused_tree_layout
from .kernels.draft_part import dense_draft_part, dense_links, draft_part
from .kernels.views import Candidates, DraftCandidates, DraftOptions
from .kernels.host_part import reanchor_arrays
from .kernels.observe import expected_lengths, gain_columns
from .prune import PruneStages, prune
from .retrieval.buffer import HostCandidates
from .retrieval.output_ring import OutputRing
from .retrieval.successor import SuccessorTable
from .kernels.successor import PRIVATE_GROUP
from .numerics.rows import mode_selector
from .sources import NUM_MEMBERS, SOURCE_AGREE, SOURCE_DRAFT, SOURCE_OUTPUTS, SOURCE_PADDING, SOURCE_SUCCESSOR
from .tree import DraftTree, node_depths

__all__ = ["DraftCandidates", "DenseDraft", "dense_draft_candidates", "dense_logq", "tree_draft_candidates",
           "StepOutput", "GraftStep", "reanchor", "tree_layout"]


def dense_draft_candidates(scores: torch.Tensor, tokens: torch.Tensor, parent_list: torch.Tensor,
                           topk: int, steps: int) -> DraftCandidates:
    """The dense EAGLE tree in SGLang's ``select_top_k_tokens`` layout as `DraftCandidates`.

    Source: SGLang 0.5.23 ``spec_utils.py:474`` (layout) and ``eagle_utils.py:100`` /
    ``eagle.cuh`` (parent rule: index g has tb = g // topk; tb == 0 -> the root, else the node
    whose index is ``parent_list[tb]``).

    Args:
        scores: ``float[B, S]`` cumulative draft probabilities, S = topk + (steps - 1) * topk**2.
        tokens: ``int64[B, S]``.
        parent_list: ``int64[B, 1 + topk * (steps - 1)]`` (``organize_draft_results``' output).
        topk, steps: the draft shape.
    Returns:
        `DraftCandidates` ``[B, S]``.
    Raises:
        ValueError: ``parent_list`` narrower than the layout needs (``(S - 1) // topk + 1`` columns).
    """
    parents, depth = dense_links(parent_list, topk, scores.shape[1])
    return DraftCandidates(tokens.to(torch.int64), parents, dense_logq(scores), depth)


#: 0 as a CPU scalar tensor: an operand of device ops without a device copy (TensorIterator's CPU scalars)
_ZERO = torch.zeros(())


def dense_logq(scores: torch.Tensor) -> torch.Tensor:
    """``float32[B, S]`` log of the dense tree's cumulative draft probabilities (``float[B, S]``;
    zero, negative and NaN scores give -inf: not drafted). Two ops (``fmax`` drops NaN)."""
    return torch.fmax(scores.float(), _ZERO).log()


@dataclass
class DenseDraft:
    """The draft's dense EAGLE tree as SGLang's draft loop leaves it (the layout of
    `dense_draft_candidates`), handed to the step unconverted: `GraftStep` reranks it with the
    dense draft op (its links derived inside the kernel, kernels/draft_part.py), so a captured step
    (graphs.py) reads these buffers itself.

    Attributes:
        scores: ``float32[B, S]`` cumulative draft probabilities, S = topk + (steps - 1) * topk**2.
        tokens: ``int64[B, S]``.
        parent_list: ``int64[B, 1 + topk * (steps - 1)]`` (with steps = 1 its one column is unused; 0
            columns are accepted too).
        topk, steps: the draft shape (Python ints: static).
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parent_list: torch.Tensor
    topk: int
    steps: int


def tree_draft_candidates(tree: DraftTree) -> DraftCandidates:
    """A `DraftTree` (root at 0, ``logp`` = cumulative draft log-prob) as `DraftCandidates`."""
    par = tree.parents[:, 1:]
    return DraftCandidates(tree.tokens[:, 1:], torch.where(par <= 0, -1, par - 1), tree.logp[:, 1:].float(),
                           node_depths(tree.parents)[:, 1:])


def reanchor(host: HostCandidates, hist: torch.Tensor, count: torch.Tensor, seq_lens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move host proposals from the host's anchor to the device's root.

    ``gap = seq_len + 1 - anchor_len`` tokens were committed after the host's context; they are
    the last ``gap`` tokens of the slot's device history (the last one is the root). A candidate at
    depth d (below the anchor) survives when d > gap and its first ``gap`` path tokens equal them; it
    then sits at depth d - gap under the root, its path probability divided by that of its consumed
    prefix and its match length grown by ``gap``. Rows with ``gap < 0`` (the host is ahead) or a gap
    longer than the history holds lose every candidate.

    Args:
        host: `HostCandidates` ``[B, M]``.
        hist, count: ``int64[B, L]`` / ``int64[B]`` the slots' right-aligned token windows
            (history.py), ending with the root.
        seq_lens: ``int64[B]`` committed tokens before the root.
    Returns:
        ``(parents, depth, logp, match, valid)`` all ``[B, M]``: parents -1 = child of the root.
    """
    return reanchor_arrays(host.tokens, host.parents, host.logp, host.match, host.member, host.anchor_len, hist,
                           count, seq_lens)


def tree_layout(tree: DraftTree, seq_lens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verify-side arrays of a tree (SGLang ``build_tree_kernel_efficient``'s outputs,
    ``eagle_utils.py:138``): ``(depth, positions, ancestor mask bool[B, N, N], first_child,
    next_sibling)``, positions = ``seq_len + depth``; one fused kernel on a CUDA device
    (`graft_spec.kernels.tree_layout`)."""
    return fused_tree_layout(tree.parents, seq_lens)


@dataclass
class StepOutput:
    """Everything one round's verify and its bookkeeping need.

    Attributes:
        tree: hybrid `DraftTree` ``[B, N]`` (``logp`` = log estimated path acceptance).
        member_bins: ``int64[B, N, NUM_MEMBERS]`` calibration bin of every member of every node.
        depth, positions: ``int64[B, N]``.
        mask: ``bool[B, N, N]`` ancestor mask.
        first_child, next_sibling: ``int64[B, N]`` SGLang's retrieve_next_token / _sibling.
        estimates: the calibration estimates the round was priced with (for the update).
        groups: ``int64[B]`` successor-table isolation group of each row (for the update).
        gain: ``float32[B, P - 1]`` expected accepted nodes of a tree of every width 2..P from the
            same candidates (P = the config's ``num_draft_tokens``; `merge_select`), or None.
        factors: the rows' per-request correction the round was priced with
            (`request_correction.RequestCorrection.factors`: ``(scale float32[B, NUM_MEMBERS], under
            bool[B, NUM_MEMBERS])``),
            or None (off, or a tree built another way); the update's metrics read it.
    """

    tree: DraftTree
    member_bins: torch.Tensor
    depth: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    estimates: torch.Tensor
    groups: Optional[torch.Tensor] = None
    gain: Optional[torch.Tensor] = None
    factors: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @staticmethod
    def from_tree(tree: DraftTree, seq_lens: torch.Tensor, estimates: Optional[torch.Tensor] = None
                  ) -> "StepOutput":
        """The verify layout of a given tree, without calibration data (member bins -1; ``estimates``
        default: an empty table): for engines or tests that build trees another way."""
        depth, positions, mask, first, nxt = tree_layout(tree, seq_lens)
        b, n = tree.tokens.shape
        bins = torch.full((b, n, NUM_MEMBERS), -1, dtype=torch.int64, device=tree.device)
        est = estimates if estimates is not None else torch.zeros(1, device=tree.device)
        return StepOutput(tree, bins, depth, positions, mask, first, nxt, est)

    @staticmethod
    def padding(roots: torch.Tensor, seq_lens: torch.Tensor, num_nodes: int, estimates: torch.Tensor
                ) -> "StepOutput":
        """A tree that proposes nothing: the root and ``num_nodes - 1`` padding children of it (token
        0, as SGLang's NGRAM pads), laid out by hand (no selection, no layout code). An engine verifies
        it in place of a round whose graft step failed: the same shapes, the root's bonus token
        committed, nothing credited or learnt (member bins -1, `PRIVATE_GROUP`).

        Args:
            roots: ``int[B]``; seq_lens: ``int[B]`` committed tokens before the root;
            num_nodes: N >= 1; estimates: the calibrator's table (carried, not updated).
        """
        b, n, dev = roots.shape[0], int(num_nodes), roots.device
        col = torch.arange(n, device=dev)
        tokens = torch.where(col == 0, roots.reshape(b, 1).to(torch.int64), 0)
        parents = torch.where(col == 0, -1, 0).expand(b, n).contiguous()
        source = torch.where(col == 0, SOURCE_DRAFT, SOURCE_PADDING).expand(b, n).contiguous()
        tree = DraftTree(tokens, parents, torch.zeros(b, n, device=dev), source)
        depth = (col > 0).to(torch.int64).expand(b, n).contiguous()
        eye = torch.eye(n, dtype=torch.bool, device=dev)
        mask = (eye | (col[None, :] == 0)).expand(b, n, n).contiguous()
        first = torch.where(col == 0, 1 if n > 1 else -1, -1).expand(b, n).contiguous()
        nxt = torch.where((col > 0) & (col < n - 1), col + 1, -1).expand(b, n).contiguous()
        bins = torch.full((b, n, NUM_MEMBERS), -1, dtype=torch.int64, device=dev)
        groups = torch.full((b,), PRIVATE_GROUP, dtype=torch.int64, device=dev)
        return StepOutput(tree, bins, depth, seq_lens.reshape(b, 1).to(torch.int64) + depth, mask, first, nxt,
                          estimates, groups)

    def pack(self) -> torch.Tensor:
        """``int64[B, N, 4 + NUM_MEMBERS]``: tokens, parents, source, log-estimate bits and member bins,
        one tensor to broadcast so that every rank verifies the same tree (`unpack` rebuilds the
        rest)."""
        t = self.tree
        bits = t.logp.float().contiguous().view(torch.int32).to(torch.int64)
        return torch.cat([t.tokens[..., None], t.parents[..., None], t.source[..., None], bits[..., None],
                          self.member_bins], dim=2)

    @staticmethod
    def unpack(packed: torch.Tensor, seq_lens: torch.Tensor, estimates: torch.Tensor,
               groups: Optional[torch.Tensor] = None,
               factors: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> "StepOutput":
        """The `StepOutput` of a `pack`ed tree (layout recomputed from its parents and ``seq_lens``;
        ``estimates``, ``groups`` and ``factors`` are this rank's own)."""
        logp = packed[..., 3].to(torch.int32).view(torch.float32)
        tree = DraftTree(packed[..., 0].contiguous(), packed[..., 1].contiguous(), logp,
                         packed[..., 2].contiguous())
        depth, positions, mask, first, nxt = tree_layout(tree, seq_lens)
        return StepOutput(tree, packed[..., 4:].contiguous(), depth, positions, mask, first, nxt, estimates, groups,
                          factors=factors)

    def expected_accept_at(self, widths: "tuple[int, ...]") -> torch.Tensor:
        """``float32[B, len(widths)]``: expected accept length (bonus included) of a tree of each
        width from this round's candidates: ``1 + gain[:, w - 2]`` (1 for width 1; widths beyond
        the gain curve take its last value)."""
        gain = self.gain if self.gain is not None else self.tree.logp[:, 1:].exp().cumsum(dim=1)
        return expected_lengths(gain, gain_columns(widths, gain.shape[1], gain.device))

    @property
    def expected_accept_length(self) -> torch.Tensor:
        """``float32[B]``: 1 (bonus) + sum of the nodes' estimates."""
        return 1.0 + self.tree.logp[:, 1:].exp().sum(dim=1)



class GraftStep:
    """The static part of the step (shapes, template, stages) and the step itself.

    Args:
        config: validated `GraftConfig` (N, retrieval, checkpoints, policy).
        calibrator: the engine's `Calibrator` (bins; its estimates are an input of every call).
        successor: the engine's `SuccessorTable`, or None when disabled.
        device: where the step runs.
        num_nodes: the tree width this step builds, root included (>= 2, default N =
            ``config.num_draft_tokens``; the batch budget builds narrower trees). The candidate pool
            and the gain curve always span N, so every width is priced from the same candidates.
    """

    def __init__(self, config: GraftConfig, calibrator: Calibrator, successor: Optional[SuccessorTable],
                 device: torch.device | str = "cpu", num_nodes: Optional[int] = None,
                 outputs: Optional[OutputRing] = None):
        self.config, self.calibrator, self.successor, self.outputs = config, calibrator, successor, outputs
        self.pool = config.num_draft_tokens
        self.n = num_nodes or self.pool
        if not 2 <= self.n <= self.pool:
            raise ValueError(f"GraftStep: num_nodes={self.n} must lie in 2..num_draft_tokens={self.pool}")
        self.device = torch.device(device)
        self.stages = PruneStages.build(config.checkpoints, self.device) if config.checkpoints else None
        #: the retrieval sources, in tree order (device_sources.py)
        self.sources = device_sources(config, calibrator, successor, outputs)
        #: the rooted block's member row (`SOURCE_DRAFT`, at most N columns), broadcast over the batch
        #: (no op per round)
        self.draft_member = torch.full((1, self.pool), SOURCE_DRAFT, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ parts
    def _draft_part(self, draft: "DraftCandidates | DenseDraft", roots: torch.Tensor, sampled: torch.Tensor,
                    est_table: torch.Tensor) -> Candidates:
        """The rooted block: the root + the N - 1 best draft candidates (N = the pool), ``[B, N]``."""
        rest = (roots, sampled, self.calibrator.draft_view(est_table),
                DraftOptions(self.pool, self.config.draft_nodes, self.stages is not None))
        if isinstance(draft, DenseDraft):
            out = dense_draft_part(draft.tokens, draft.parent_list, dense_logq(draft.scores), draft.topk, *rest)
        else:
            out = draft_part(draft, *rest)
        tokens, parents, est_n, valid_n, bins_n, logq_n = out
        member = self.draft_member[:, : tokens.shape[1]].expand_as(tokens)   # 1 + min(N - 1, S) columns
        if self.stages is None:
            return Candidates(tokens, parents, est_n, valid_n, bins_n, member)
        # paper mode: kept draft nodes always in, pruned ones refill after retrieval
        tree = DraftTree(tokens, parents, torch.where(valid_n, logq_n, -math.inf), member)
        keep = prune(tree, self.stages, self.pool).keep
        refill = est_n - 2.0 if self.config.graft.refill_with_draft else torch.full_like(est_n, -math.inf)
        return Candidates(tokens, parents, est_n, valid_n, bins_n, member, torch.where(keep, math.inf, refill))

    def retrieve(self, roots: torch.Tensor, host: HostCandidates, hist: torch.Tensor, count: torch.Tensor,
                 seq_lens: torch.Tensor, sampled: torch.Tensor, est_table: torch.Tensor,
                 factors=None) -> list[Candidates]:
        """The round's retrieved candidates, priced: one `Candidates` block ``[B, C_i]`` per source
        of `sources` that proposes (device_sources.py), in tree order.

        They do not depend on the step's width (every width prices the same N-wide pool), so the
        eager stop gate and the build of a round compute them once (`GraftPlanner.stop_gate`,
        ``retrieved`` of `__call__`). Arguments as for `__call__`."""
        if factors is None:                     # uncorrected: the identity, made once for every source
            factors = self.calibrator.identity(roots.shape[0])
        r = RoundInputs(roots, host, hist, count, seq_lens, sampled, est_table, factors)
        return [c for c in (s.propose(r) for s in self.sources) if c is not None]

    def retrieval_floor(self, roots: torch.Tensor, parts: list[Candidates]) -> torch.Tensor:
        """``float32[B]``: a lower bound of the round's selection threshold at this step's width from
        the retrieved candidates alone (`retrieve`'s ``parts`` for ``roots`` ``int64[B]``): the max
        over sources of their (n-1)-th best estimate (gate.py; 0 without candidates). +inf when
        draft nodes are disabled (nothing to draft for). Groups are the retrieval members, numbered
        from the successor (the draft member has none)."""
        b, dev = roots.shape[0], roots.device
        est = [torch.zeros(b, 0, device=dev)] + [p.est for p in parts]
        valid = [torch.zeros(b, 0, dtype=torch.bool, device=dev)] + [p.valid for p in parts]
        member = [torch.zeros(b, 0, dtype=torch.int64, device=dev)] + [p.member for p in parts]
        group = (torch.cat(member, 1) - SOURCE_SUCCESSOR).clamp(min=0)
        floor = kth_best(torch.cat(est, 1), torch.cat(valid, 1), group, SOURCE_OUTPUTS - SOURCE_SUCCESSOR + 1,
                         self.n - 1)
        if not self.config.draft_nodes:
            floor = torch.full_like(floor, math.inf)
        return floor

    # ------------------------------------------------------------------ the step
    def __call__(self, draft: "DraftCandidates | DenseDraft", roots: torch.Tensor, host: HostCandidates,
                 hist: torch.Tensor, count: torch.Tensor, seq_lens: torch.Tensor,
                 sampled: torch.Tensor, est_table: torch.Tensor, factors=None,
                 retrieved: Optional[list] = None) -> StepOutput:
        """Build one round's hybrid tree and its verify layout.

        Args:
            draft: `DraftCandidates` ``[B, S]``, or a `DenseDraft` (reranked by the dense draft op).
            roots: ``int64[B]`` root tokens (the previous round's bonus tokens).
            host: `HostCandidates` ``[B, M]`` (M may be 0; its ``group`` picks each row's
                successor-table isolation group; rows whose ``speculate`` is False get a tree of
                padding only: the request opted out of speculation).
            hist, count: ``int64[B, L]`` / ``int64[B]`` the slots' token windows (history.py),
                ending with the root.
            seq_lens: ``int64[B]`` committed tokens before the root.
            sampled: ``bool[B]`` rows verified by sampling (their own calibration bins).
            est_table: the calibrator's estimate table (`Calibrator.table`).
            factors: the rows' per-request correction of the retrieval sources
                (`RequestCorrection.factors`), or None.
            retrieved: `retrieve`'s blocks of these same inputs when already computed (the eager
                stop gate's), else None (computed here).
        Returns:
            `StepOutput` of width ``num_nodes`` (default ``config.num_draft_tokens``), with the gain
            curve over the full pool.
        """
        if retrieved is None:
            retrieved = self.retrieve(roots, host, hist, count, seq_lens, sampled, est_table, factors)
        cands = Candidates.stack(self._draft_part(draft, roots, sampled, est_table), retrieved,
                                 host.speculate)                                  # per-request opt-out
        tree, member_bins, gain = merge_select(
            cands, self.n, self.config.graft, gain_nodes=self.pool, sampled=sampled,
            agreement=((self.calibrator.layout.offset(SOURCE_AGREE), est_table,
                        *mode_selector(self.config.agreement_modes, sampled)) if self.config.agreement_bins else None))
        depth, positions, mask, first, nxt = tree_layout(tree, seq_lens)
        return StepOutput(tree, member_bins, depth, positions, mask, first, nxt, est_table, host.group, gain,
                          factors)
