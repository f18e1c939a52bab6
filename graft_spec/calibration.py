"""Online calibration: every candidate node, draft or retrieved, priced in one currency.

The currency is the estimated probability that a node lies on the accepted path. Because sibling
tokens are distinct, the events "node i is accepted" are disjoint per depth and the expected
accepted length of a tree is ``1 + sum_i P(i on the accepted path)`` (bonus included), for greedy
verification and for target-only tree rejection sampling alike (reference landscape §4: a child is
accepted with probability p_target(child) given its parent, whatever its siblings). Choosing the
ancestor-closed N-1 nodes with the largest estimates therefore maximises the expected accepted
length; pruning becomes an outcome of that choice instead of a threshold (paper Sec. 3.1 prunes
by thresholds; ECHO, arXiv 2604.09603, uses the same gain currency for its budget).

Each candidate carries a *calibration bin*: a small integer computed from its features.

| member source | features (bin axes) | prior |
|---|---|---|
| draft | node depth, cumulative draft probability q | q |
| successor | template slot (= its rank path and depth) | product of rank priors |
| suffix, corpus | depth, count-ratio path probability p, match length | p x 0.85**depth |
| lookup, outputs | depth, match length (p = 1) | 0.85**depth |
| agree | node depth, cumulative draft probability q | q**0.5, scaled (`Calibrator.refresh`) |

and a mode axis (greedy / sampled rows), so ``2 x (2 x draft + successor + 4 x retrieval)`` bins in all
(a few thousand floats). The estimate of a bin is the posterior mean
``(hits + w * prior) / (trials + w)``. It is not forced to be monotone in the probability axis (a
cumulative max would let the prior of a bin never tried override the data of its neighbour); a bin
whose prior is too high gets selected, tried and corrected, which is the exploration the online
calibration needs. After every verify, each member of each verified
non-root node adds one trial to its bin and one hit if the node lies on the accepted path (a node
proposed by several retrieval sources credits every one of them).

With ``calibration.agreement`` (on for the rows that get the output index), a node the draft *and*
a retrieval source proposed (an agreement node) is its own member, ``agree``: its bins have the
draft bins' axes (depth, draft probability), it is priced by its own estimate (`merge.merge_select`)
and credited instead of the draft bin, so the draft bins learn the acceptance of draft-only nodes,
which is what they price when the draft proposes alone. When a bin reaches `HALVE_AT` trials its
counts are halved, so the estimate tracks drift with a memory of a few thousand trials.

**Source correction.** A bin learns slowly where it is sparse or its history is long, and a whole
source can change its acceptance at once (the output index starts to hold earlier answers to the
prompts now served, and every outputs / successor node becomes likelier than its bin remembers).
So each (mode, member) keeps a short window (``source_window`` trials, halved beyond) of its
verified nodes' trials ``T``, sum of bin estimates ``E`` and hits ``H``, and its bins' estimates
``b`` are corrected linearly so that the window's mean estimate equals its observed rate:
``b * (H + a e) / (E + a e)`` where the source is over-estimated (scales hits, never above ``b``),
``1 - (1 - b) * (T - H + a (1 - e)) / (T - E + a (1 - e))`` where it is under-estimated (scales
misses, never above 1), with ``e = E / T``; both are the identity when ``H = E`` and monotone in
``b``, so the ranking within a source is the bins'. The ``a`` (`Calibrator.SOURCE_PSEUDO_TRIALS`)
pseudo-trials of calibrated data keep a source with few trials at its bins' estimates. This is a
one-parameter recalibration per source on top of the bins (Platt-style, but linear so that the mean
is exact). On top of it each request corrects the retrieval sources by its own window
(request_correction.py, ``calibration.request_window``), with the same map (`linear_correction`).

**The estimate table** lives in a persistent buffer (`Calibrator.table`): `GraftPlanner.observe`
refreshes it in place after every verified round (`Calibrator.refresh`) and every build reads it.
Nothing a build reads is assigned from Python, so a build captured in a CUDA graph keeps reading
the current table on replay.

Everything here is a static-shape torch function of device tensors: no host reads, no
data-dependent control flow; the tables live on the engine's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.refresh import refresh_table
from .kernels.views import CalibrationState, DraftBins, RefreshIndex, RefreshOptions, RetrievalBins
from .numerics.bins import DEPTH_EDGES, LOGP_EDGES, MATCH_EDGES, draft_bin_ids, q_bins, retrieval_bin_ids
from .numerics.correction import apply_correction, linear_correction
from .numerics.credit import credit_counts, round_metrics
from .numerics.fixed import FIXED_ONE, from_fixed, to_fixed
from .sources import NUM_MEMBERS, RETRIEVAL_SOURCES, SOURCE_AGREE, SOURCE_DRAFT, SOURCE_SUCCESSOR

__all__ = [
    "PRIOR_WEIGHT", "HALVE_AT", "LOGP_EDGES", "DEPTH_EDGES", "MATCH_EDGES", "FIXED_ONE", "BinLayout", "Calibrator",
    "linear_correction", "apply_correction", "to_fixed", "from_fixed", "q_bins", "draft_bin_ids",
    "retrieval_bin_ids", "credit_counts", "round_metrics",
]

_RETRIEVAL_DECAY = 0.85
#: Per-depth decay from a retrieval bin to the next deeper depth bin's prior (see `Calibrator.refresh`).
CHAIN_DECAY = 0.95
#: Pseudo-trials of every bin's prior (small: the data takes over fast).
PRIOR_WEIGHT = 2.0
#: A bin's counts are halved once its trials exceed this (memory for drift).
HALVE_AT = 4096.0
#: Middle depth of each depth bin (for the chained prior's decay over the bin's width).
_DEPTH_MID = (1.0, 2.0, 3.0, 4.0, 5.5, 7.5, 10.5, 14.5, 20.5, 28.5, 40.5, 56.0)




@dataclass(frozen=True)
class BinLayout:
    """Offsets of the calibration bins (per mode: draft, successor, one block per retrieval member,
    then the agreement block, laid out as the draft block).

    Args:
        draft_depth: deepest draft node depth (the draft steps).
        template_size: successor template slots T.
    """

    draft_depth: int
    template_size: int

    @property
    def num_q(self) -> int:
        return len(LOGP_EDGES) + 1

    @property
    def num_depth(self) -> int:
        return len(DEPTH_EDGES) + 1

    @property
    def num_match(self) -> int:
        return len(MATCH_EDGES) + 1

    @property
    def draft_bins(self) -> int:
        return self.draft_depth * self.num_q

    @property
    def retrieval_bins(self) -> int:
        return self.num_depth * self.num_q * self.num_match

    @property
    def per_mode(self) -> int:
        return 2 * self.draft_bins + self.template_size + len(RETRIEVAL_SOURCES) * self.retrieval_bins

    @property
    def size(self) -> int:
        """Bins in all (two modes); index ``size`` is the dump bin of invalid candidates."""
        return 2 * self.per_mode

    def offset(self, member: int) -> int:
        """First bin of a member source's block within one mode."""
        if member == SOURCE_DRAFT:
            return 0
        if member == SOURCE_SUCCESSOR:
            return self.draft_bins
        if member == SOURCE_AGREE:
            return self.draft_bins + self.template_size + len(RETRIEVAL_SOURCES) * self.retrieval_bins
        return self.draft_bins + self.template_size + RETRIEVAL_SOURCES.index(member) * self.retrieval_bins




class Calibrator:
    """Device tables of hits / trials per bin and their estimates. The round metrics (estimated vs
    observed acceptance per member source and depth) are returned per round (`update`,
    `GraftPlanner.observe`'s `RoundStats`) and accumulated on the host (`graft_spec.stats.GraftStats`).

    Args:
        layout: the `BinLayout`.
        successor_prior: ``float[T]`` prior path-acceptance of every successor template slot.
        prior_weight: pseudo-trials w of the prior (> 0).
        halve_at: a bin's counts are halved once its trials exceed this.
        source_window: trials per (mode, member source) over which the source correction is
            measured (halved beyond); 0 turns the correction off.
        device: where the tables live.
    Attributes:
        hits, trials: ``float32[size + 1]`` (last entry: dump bin).
        prior: ``float32[size + 1]``.
        recent: ``int64[2 * NUM_MEMBERS + 1, 3]`` the source correction's window (trials, sum of
            bin estimates, hits) per (mode, member), fixed point (`FIXED_ONE`); last row: dump.
        table: ``float32[size + 1]`` the estimate table every build prices with (`refresh`).
    Raises:
        ValueError: ``prior_weight <= 0`` or ``source_window < 0``.
    """

    #: Pseudo-trials of the source correction (module docstring).
    SOURCE_PSEUDO_TRIALS = 8.0

    def __init__(self, layout: BinLayout, successor_prior: torch.Tensor, prior_weight: float = PRIOR_WEIGHT,
                 halve_at: float = HALVE_AT, max_depth: int = 64, device: torch.device | str = "cpu",
                 source_window: float = 256.0):
        if prior_weight <= 0:
            raise ValueError("Calibrator: prior_weight must be > 0")
        if source_window < 0:
            raise ValueError("Calibrator: source_window must be >= 0")
        self.source_window = float(source_window)
        self.layout, self.w, self.halve_at = layout, float(prior_weight), float(halve_at)
        self.device = torch.device(device)
        self.max_depth = max_depth
        self.logp_edges = torch.tensor(LOGP_EDGES[::-1], device=self.device)         # ascending
        self.depth_edges = torch.tensor(DEPTH_EDGES, device=self.device)
        self.match_edges = torch.tensor(MATCH_EDGES, device=self.device)
        self.prior = self._prior(successor_prior.to(self.device)).contiguous()
        self._retrieval_base = torch.tensor([layout.offset(m) if m in RETRIEVAL_SOURCES else 0
                                             for m in range(NUM_MEMBERS)], device=self.device)
        # [2 modes, retrieval members, depth bins, q bins * match bins] indices of the retrieval bins
        per = layout.num_q * layout.num_match
        first = torch.tensor([[mode * layout.per_mode + layout.offset(m) for m in RETRIEVAL_SOURCES]
                              for mode in (0, 1)])
        retr_idx = first[:, :, None, None] + torch.arange(layout.num_depth)[:, None] * per + torch.arange(per)
        # the chain's prior weight per depth bin, ``[D, 1]``: 0 at the shallowest (its prior is fixed)
        self._chain_weight = torch.tensor([0.0, *(self.w * CHAIN_DECAY ** (b - a)
                                                  for a, b in zip(_DEPTH_MID[:-1], _DEPTH_MID[1:]))],
                                          device=self.device)[:, None]
        agree = layout.offset(SOURCE_AGREE)
        agree_idx = torch.stack([mode * layout.per_mode + agree + torch.arange(layout.draft_bins)
                                 for mode in (0, 1)])                             # [2 modes, agreement bins]
        # the bins in neither block (built on the host: the layout alone decides them)
        blocks = torch.cat([agree_idx.reshape(-1), retr_idx.reshape(-1)])
        if blocks.unique().numel() != blocks.numel():
            raise ValueError("Calibrator: the agreement and retrieval bin blocks overlap")
        plain_idx = (~torch.zeros(layout.size + 1, dtype=torch.bool).index_fill_(0, blocks, True)).nonzero()
        self._retr_idx = retr_idx.contiguous().to(self.device)
        self._agree_idx = agree_idx.to(self.device)
        self._plain_idx = plain_idx.reshape(-1).to(self.device)
        #: the fused refresh's count of programs that have read the source windows (its kernel resets it)
        self._arrivals = torch.zeros(1, dtype=torch.int32, device=self.device)
        n = layout.size + 1
        self.hits = torch.zeros(n, device=self.device)
        self.trials = torch.zeros(n, device=self.device)
        self._group = self._source_groups()
        self.recent = torch.zeros(2 * NUM_MEMBERS + 1, 3, dtype=torch.int64, device=self.device)
        # persistent tables, written in place by `refresh` (a captured build reads them at fixed
        # addresses, and no Python assignment has to run again under replay)
        self.table = torch.zeros(n, device=self.device)   # the estimates every build prices with
        self._base = torch.zeros(n, device=self.device)   # bin estimates behind `table` (before correction)
        self.refresh()

    def _source_groups(self) -> torch.Tensor:
        """``int64[size + 1]``: the (mode, member) row of `recent` every bin belongs to."""
        lay = self.layout
        sizes = {SOURCE_DRAFT: lay.draft_bins, SOURCE_SUCCESSOR: lay.template_size, SOURCE_AGREE: lay.draft_bins,
                 **{m: lay.retrieval_bins for m in RETRIEVAL_SOURCES}}
        group = torch.full((lay.size + 1,), 2 * NUM_MEMBERS, dtype=torch.int64)
        for mode in (0, 1):
            for m, n in sizes.items():
                first = mode * lay.per_mode + lay.offset(m)
                group[first:first + n] = mode * NUM_MEMBERS + m
        return group.to(self.device)

    # ------------------------------------------------------------------ bins
    def q_bin(self, logp: torch.Tensor) -> torch.Tensor:
        """``int64``: probability bin of a log-probability (0 = highest); NaN and -inf go last."""
        return q_bins(logp, self.logp_edges)

    def draft_bins(self, depth: torch.Tensor, logq: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """Bins of draft nodes (`draft_bin_ids`). ``depth`` int64 (1-based) and ``logq``
        broadcastable to ``[B, S]``, ``sampled`` ``bool[B]``. Returns ``int64[B, S]``."""
        lay = self.layout
        return draft_bin_ids(depth, logq, sampled, self.logp_edges, lay.draft_depth, lay.num_q, lay.per_mode)

    def successor_bins(self, slots: int, sampled: torch.Tensor) -> torch.Tensor:
        """Bins of successor template slots 0..slots-1: ``int64[B, slots]``."""
        ar = torch.arange(slots, device=self.device) + self.layout.offset(SOURCE_SUCCESSOR)
        return ar[None, :] + (sampled.to(torch.int64) * self.layout.per_mode)[:, None]

    def retrieval_bins(self, member: torch.Tensor, depth: torch.Tensor, logp: torch.Tensor,
                       match: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """Bins of suffix / corpus / lookup / outputs nodes (`retrieval_bin_ids`; ``member`` one of
        `RETRIEVAL_SOURCES` per node). All broadcastable to ``[B, M]`` except ``sampled`` ``bool[B]``.
        Returns ``int64[B, M]``."""
        return retrieval_bin_ids(member, depth, logp, match, sampled, *self.retrieval_view)

    @property
    def retrieval_view(self) -> RetrievalBins:
        """The retrieval bins' layout as the fused ops read it (`RetrievalBins`)."""
        return RetrievalBins(self._retrieval_base, self.logp_edges, self.depth_edges, self.match_edges,
                             self.layout.per_mode)

    def draft_view(self, table: torch.Tensor) -> DraftBins:
        """The draft bins' layout with the estimates ``table`` ``float32[S + 1]`` a round prices
        from (`DraftBins`)."""
        lay = self.layout
        return DraftBins(table, self.logp_edges, lay.draft_depth, lay.num_q, lay.per_mode)

    @property
    def state_view(self) -> CalibrationState:
        """The counts and estimates as the fused ops read and write them (`CalibrationState`)."""
        return CalibrationState(self.hits, self.trials, self.prior, self.recent, self._group, self._base, self.table)

    @property
    def refresh_index(self) -> RefreshIndex:
        """The bin groups the refresh reads (`RefreshIndex`)."""
        return RefreshIndex(self._agree_idx, self._retr_idx, self._chain_weight, self._plain_idx, self._arrivals)

    # ------------------------------------------------------------------ priors / estimates
    def _prior(self, successor_prior: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        centers = torch.tensor([0.0, *LOGP_EDGES], device=self.device)
        centers = torch.cat([(centers[:-1] + centers[1:]) / 2, centers[-1:] - 4.0]).exp()   # [Q]
        draft = centers.repeat(lay.draft_depth)
        dmid = torch.tensor(_DEPTH_MID, device=self.device)
        retr = (centers[None, :, None] * (_RETRIEVAL_DECAY ** dmid)[:, None, None]
                ).expand(lay.num_depth, lay.num_q, lay.num_match).reshape(-1)
        succ = torch.zeros(lay.template_size, device=self.device)
        succ[: successor_prior.numel()] = successor_prior.float()[: lay.template_size]
        mode = torch.cat([draft, succ, *[retr] * len(RETRIEVAL_SOURCES), draft.sqrt()])
        return torch.cat([mode, mode, torch.zeros(1, device=self.device)]).clamp(0.0, 1.0)

    def refresh(self) -> torch.Tensor:
        """Halve the counts past their memory (bins past `halve_at` trials, the source window past
        ``source_window``), recompute the estimate table from them, in place, and return it: `table`
        ``float32[size + 1]``, the posterior means ``(hits + w * prior) / (trials + w)`` through the
        source correction; the dump bin is 0. `GraftPlanner.observe` calls it once per verified round,
        after the counts changed; a build reads `table` and computes nothing. The table and the bin
        estimates behind it (which `update` credits the source window with) are persistent buffers
        written with ``copy_``, so a captured build or observe keeps reading and writing the same memory under
        CUDA-graph replay.

        Retrieval bins (suffix, corpus, lookup, outputs) chain their prior along depth: the prior of depth bin
        d is the *estimate* of bin d-1 (same member, mode, probability and match bins) times
        ``CHAIN_DECAY`` per depth step, and only the shallowest bin uses the fixed prior. A fixed
        prior that falls with depth is never explored where it is too low: on repetitive text a
        depth-20 lookup node is accepted almost surely, but a 0.85**20 prior keeps it below every
        draft node, it is never selected, never tried and never corrected. Chained, each deeper bin starts just below its
        tried neighbour, gets selected when its neighbour is good, and is corrected by its own trials.

        Agreement bins (a draft node a retrieval source also proposed) scale their prior by their
        block's observed over expected hits so far (per mode, ``(hits + 1) / (sum trials * prior +
        1)``): they are sparse (depth x draft probability) and their ``sqrt(q)`` prior is far below
        what agreement is worth, so a bin seen a few times would lag its rate.
        """
        refresh_table(self.state_view, self.refresh_index,
                      RefreshOptions(self.w, self.halve_at, self.source_window, self.SOURCE_PSEUDO_TRIALS))
        return self.table

    # ------------------------------------------------------------------ updates
    def update(self, bins: torch.Tensor, on_path: torch.Tensor, depth: torch.Tensor,
               estimates: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Credit one verify round (`credit_counts`, `round_metrics`); `refresh` halves and
        re-estimates after it. `GraftPlanner.observe` does both in its fused bookkeeping.

        Args:
            bins: ``int64[B, N, NUM_MEMBERS]`` bin of each member of each tree node, -1 where that
                source did not propose the node (and for the root and padding).
            on_path: ``bool[B, N]`` nodes on the accepted path.
            depth: ``int64[B, N]`` node depths.
            estimates: the estimate table the round was built with (`table`).
            factors: the per-request correction the round was priced with
                (`RequestCorrection.factors`: ``(float32[B, NUM_MEMBERS], bool[B, NUM_MEMBERS])``),
                or None; only the metrics use it (the bins learn from their own counts).
        Returns:
            This round's metrics (device tensors, `round_metrics` summed over the rows):
            ``float64[NUM_MEMBERS, 3]`` (trials, sum of estimates, hits) and
            ``float64[max_depth + 1, 2]`` (verified, accepted nodes per depth; row 0 unused).
        """
        credit_counts(self.trials, self.hits, self.recent if self.source_window > 0 else None, self._group,
                      self._base, bins, on_path)
        scale, under = factors if factors is not None else self.identity(bins.shape[0])
        members, depths = round_metrics(bins, on_path, depth, estimates, scale, under, self.max_depth)
        return members.sum(0), depths.sum(0)

    def identity(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The identity per-request correction of ``rows`` rows: ``(ones float32[rows, NUM_MEMBERS],
        zeros bool[rows, NUM_MEMBERS])``."""
        return (torch.ones(rows, NUM_MEMBERS, device=self.device),
                torch.zeros(rows, NUM_MEMBERS, dtype=torch.bool, device=self.device))
