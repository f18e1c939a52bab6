"""The named views fused ops read: typed bundles of the tensors (and static ints) a state object
hands out whole, so call sites pass ``table.view`` rather than positional lists of its fields.

Each view is flattened to the op's schema in one place (`kernels.registry`). Who hands them out:

| view | from |
|---|---|
| `Candidates` | every source's block, `Candidates.stack`, `merge.merge_select` |
| `Windows` | `TokenHistory.windows` (all slots) and `TokenHistory.gather` (the rows of a batch) |
| `Prices` | the round's `Calibrator.table` and `RequestCorrection.factors` |
| `RetrievalBins` | `Calibrator.retrieval_view` |
| `DraftBins` | `Calibrator.draft_view` |
| `CalibrationState` | `Calibrator.state_view` |
| `RingView` | `OutputRing.view` |
| `SuccessorView` | `SuccessorTable.view` |
| `HostBlock` | `HostCandidates.block` |
| `DraftCandidates` | the draft's candidate tree (`step.tree_draft_candidates`, `dense_draft_candidates`) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from .stack import stack_candidates

__all__ = ["Candidates", "DraftCandidates", "Windows", "Prices", "RetrievalBins", "DraftBins", "CalibrationState",
           "RingView", "SuccessorView", "HostBlock", "ChainOptions", "DraftOptions", "SelectOptions", "Agreement",
           "RefreshIndex", "RefreshOptions", "RoundOutcome", "Commit", "ObserveOptions"]


class Windows(NamedTuple):
    """Right-aligned token windows (history.py): ``hist int64[R, L]`` ending with the newest token,
    ``count int64[R]`` valid tokens at the right end. R = all slots or the rows of a batch."""

    hist: torch.Tensor
    count: torch.Tensor


class Prices(NamedTuple):
    """What a round prices nodes with: ``table float32[S + 1]`` the bins' estimates
    (`Calibrator.table`), and the rows' per-request correction ``scale float32[B, NUM_MEMBERS]`` /
    ``under bool[B, NUM_MEMBERS]`` (`RequestCorrection.factors`; the identity is ``(1, False)``)."""

    table: torch.Tensor
    scale: torch.Tensor
    under: torch.Tensor


class RetrievalBins(NamedTuple):
    """The retrieval bins' layout (`numerics.bins.retrieval_bin_ids`): ``base int64[NUM_MEMBERS]`` the
    first bin of each member, the ascending edges ``logp_edges float32``, ``depth_edges int64``,
    ``match_edges int64``, and ``per_mode`` bins of one mode (the sampled rows' offset)."""

    base: torch.Tensor
    logp_edges: torch.Tensor
    depth_edges: torch.Tensor
    match_edges: torch.Tensor
    per_mode: int


class DraftBins(NamedTuple):
    """The draft bins' layout (`numerics.bins.draft_bin_ids`) with the table they price from:
    ``table float32[S + 1]``, ``logp_edges float32`` ascending, ``draft_depth`` depth rows, ``num_q``
    probability bins, ``per_mode`` bins of one mode."""

    table: torch.Tensor
    logp_edges: torch.Tensor
    draft_depth: int
    num_q: int
    per_mode: int


class CalibrationState(NamedTuple):
    """The calibrator's tables (calibration.py), all over ``S + 1`` bins (the last: dump):
    ``hits``, ``trials`` float32 counts; ``prior`` float32; ``src_recent int64[2M + 1, 3]`` the source
    window in fixed point; ``group int64[S + 1]`` each bin's row of it; ``base`` the bin estimates;
    ``table`` the source-corrected estimates every build prices with."""

    hits: torch.Tensor
    trials: torch.Tensor
    prior: torch.Tensor
    src_recent: torch.Tensor
    group: torch.Tensor
    base: torch.Tensor
    table: torch.Tensor


class RingView(NamedTuple):
    """The output index's device tensors (retrieval/output_ring.py): ``ring``, ``tag`` ``int64[C]``,
    ``table int64[K, H]``, ``total int64[]`` the write position, ``lengths int64[K]`` the match
    lengths, ``pow_r int64[max_match]`` / ``pow_m int64[K]`` hash powers, and the match lengths as
    ints (``match_lengths``)."""

    ring: torch.Tensor
    tag: torch.Tensor
    table: torch.Tensor
    total: torch.Tensor
    lengths: torch.Tensor
    pow_r: torch.Tensor
    pow_m: torch.Tensor
    match_lengths: list[int]


class SuccessorView(NamedTuple):
    """The successor table (retrieval/successor.py): ``table int32[G * (rows + 2), k]``, the
    template's ``t_parent``, ``t_rank``, ``t_depth`` ``int64[T]``, ``rows`` per group, ``vocab_size``
    and ``levels`` (the template's deepest level)."""

    table: torch.Tensor
    t_parent: torch.Tensor
    t_rank: torch.Tensor
    t_depth: torch.Tensor
    rows: int
    vocab_size: int
    levels: int


class HostBlock(NamedTuple):
    """The host proposals' fields ``[B, M]`` (`HostCandidates`, retrieval/buffer.py): ``tokens``,
    ``parents`` (-1 = child of the anchor), ``logp`` float32, ``match``, ``member`` int64, and
    ``anchor_len int64[B]``."""

    tokens: torch.Tensor
    parents: torch.Tensor
    logp: torch.Tensor
    match: torch.Tensor
    member: torch.Tensor
    anchor_len: torch.Tensor


@dataclass
class DraftCandidates:
    """The draft model's candidate tree of a round, root excluded.

    Attributes:
        tokens: ``int64[B, S]``.
        parents: ``int64[B, S]``; -1 = child of the root, else the parent's index (< own index).
        logq: ``float32[B, S]`` cumulative draft log-probability of the path (-inf = not drafted).
        depth: ``int64[B, S]`` node depth (root = 0).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    logq: torch.Tensor
    depth: torch.Tensor


class ChainOptions(NamedTuple):
    """Static options of the device chains (kernels/chain_part.py): ``depth`` chain length,
    ``lookup_max_match`` (0 = lookup off), the rows the output index serves (``outputs_greedy``,
    ``outputs_sampled``)."""

    depth: int
    lookup_max_match: int
    outputs_greedy: bool
    outputs_sampled: bool


class DraftOptions(NamedTuple):
    """Static options of the draft's rerank (kernels/draft_part.py): ``pool`` N, the block's width
    bound; ``draft_nodes`` False = no candidate is valid; ``by_logq`` rank by the draft's
    probability instead of the estimate."""

    pool: int
    draft_nodes: bool
    by_logq: bool


class SelectOptions(NamedTuple):
    """Static options of the selection (`merge.merge_select`): ``num_nodes`` N, ``gain_nodes`` the
    gain curve's length + 1, the policy's ``min_score``, ``root_width`` (None = no cap) and
    ``exclusive_siblings`` (``"never"``, ``"greedy"``, ``"always"``)."""

    num_nodes: int
    gain_nodes: int
    min_score: float
    root_width: Optional[int]
    exclusive_siblings: str


class Agreement(NamedTuple):
    """Agreement pricing (`merge.merge_select`): a node's agreement bin is its draft bin +
    ``offset``, priced from ``table float32[S + 1]``, on the rows where ``rows bool[B]`` is not
    ``invert`` (``rows`` None: every row; ``invert`` lets a step pass its sampled rows as they are
    for the greedy rows, with no op)."""

    offset: int
    table: torch.Tensor
    rows: Optional[torch.Tensor]
    invert: bool = False


class RefreshIndex(NamedTuple):
    """The calibrator's bin groups for a refresh (calibration.py): ``agree_idx int64[2, A]``
    agreement bins per mode, ``retr_idx int64[2, R, D, P]`` retrieval bins per mode, member, depth
    bin and (probability, match) bin, ``chain_weight float32[D, 1]`` the chained prior's weight,
    ``plain_idx int64[K]`` every other bin (the three partition the table), ``arrivals int32[1]`` the
    fused refresh's count of programs that have read the source windows (0 between launches)."""

    agree_idx: torch.Tensor
    retr_idx: torch.Tensor
    chain_weight: torch.Tensor
    plain_idx: torch.Tensor
    arrivals: torch.Tensor


class RefreshOptions(NamedTuple):
    """``w`` the prior's pseudo-trials, ``halve_at`` trials, ``source_window`` trials (0 = no source
    correction) and the source correction's ``pseudo_trials``."""

    w: float
    halve_at: float
    source_window: float
    pseudo_trials: float


class RoundOutcome(NamedTuple):
    """A verified round's tree: ``bins int64[B, N, M]`` every member's bin of every node (-1: none),
    ``on_path bool[B, N]`` accepted nodes, ``depth int64[B, N]``, ``source int64[B, N]``."""

    bins: torch.Tensor
    on_path: torch.Tensor
    depth: torch.Tensor
    source: torch.Tensor


class Commit(NamedTuple):
    """A round's committed tokens: ``slot_ids int64[B]`` distinct engine slots, ``committed
    int64[B, W]``, ``accept_len int64[B]`` how many of them."""

    slot_ids: torch.Tensor
    committed: torch.Tensor
    accept_len: torch.Tensor


class ObserveOptions(NamedTuple):
    """``source_window`` (the source window is updated), ``rc_window`` the request windows' trials
    (0 = off), ``max_depth`` the last row of the depth metrics."""

    source_window: bool
    rc_window: float
    max_depth: int


@dataclass
class Candidates:
    """Candidate nodes, ``[B, C]`` per field.

    Attributes:
        tokens: ``int64[B, C]``.
        parents: ``int64[B, C]``: the parent's index within the same block; -1 = a child of the
            round's root (a retrieved block), or the root itself (a rooted block: the root at index
            0, its children point to 0).
        est: ``float32[B, C]`` estimated probability of lying on the accepted path (0 where not
            valid).
        valid: ``bool[B, C]`` candidates that may be selected.
        bins: ``int64[B, C]`` calibration bin of each candidate (-1: none).
        member: ``int64[B, C]`` member source (``calibration.MEMBER_*``).
        key: ``float32[B, C]`` selection priority when it differs from ``est`` (the paper's
            checkpoints keep pruned-in draft nodes at +inf), else None.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    est: torch.Tensor
    valid: torch.Tensor
    bins: torch.Tensor
    member: torch.Tensor
    key: Optional[torch.Tensor] = None

    @property
    def width(self) -> int:
        """C, candidates per row."""
        return self.tokens.shape[1]

    @property
    def priority(self) -> torch.Tensor:
        """``float32[B, C]`` the selection key (``key``, else ``est``)."""
        return self.est if self.key is None else self.key

    def where(self, keep: torch.Tensor) -> "Candidates":
        """The block with the candidates outside ``keep`` (``bool``, broadcastable to ``[B, C]``)
        made invalid: ``valid`` False, ``est`` 0, ``bins`` -1 (a key of +inf stays: it is the
        paper mode's always-keep, not a price)."""
        zero = torch.zeros((), dtype=self.est.dtype, device=self.est.device)
        return Candidates(self.tokens, self.parents, torch.where(keep, self.est, zero), self.valid & keep,
                          torch.where(keep, self.bins, -1), self.member, self.key)

    def fields(self) -> list[torch.Tensor]:
        """The block as `kernels.stack.FIELDS` tensors: tokens, parents, est, valid, bins, member,
        priority."""
        return [self.tokens, self.parents, self.est, self.valid, self.bins, self.member, self.priority]

    @staticmethod
    def stack(rooted: "Candidates", parts: Sequence["Candidates"], speculate: Optional[torch.Tensor] = None
              ) -> "Candidates":
        """One block ``[B, C0 + sum C_i]``: ``rooted`` (root at index 0) first, then every part with
        its parents re-pointed into the stack (-1, a child of the root, becomes 0); the rows where
        ``speculate`` ``bool[B]`` is False (default: none) lose every candidate. One fused op
        (kernels/stack.py)."""
        if speculate is None:
            speculate = torch.ones(rooted.tokens.shape[0], dtype=torch.bool,
                                   device=rooted.tokens.device)
        blocks = [x for block in (rooted, *parts) for x in block.fields()]
        return Candidates(*stack_candidates(blocks, speculate))
