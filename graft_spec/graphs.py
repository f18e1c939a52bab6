"""The graft step replayed from CUDA graphs: one launch per round instead of its eager kernels.

`GraftPlanner.build_eager` is static-shape and sync-free (step.py), so it can be captured; eagerly
its many small kernels are launch-bound (ops per round: docs/benchmark.md; scripts/bench_step_cuda.py
times both on a GPU). SGLang captures its own draft forwards and tree build the same way
(``cuda_graph_runner``, ``eagle_draft_cuda_graph_runner.py``).

`StepGraphs` captures one graph per (batch bucket, verify width) over static input buffers: a
round replays the smallest bucket that holds the batch after its inputs are in the first ``B`` rows
(padding rows keep earlier valid values, their trees are dropped). The draft, SGLang's dense tree
(`DenseDraft`, which the step reads as it is), is written there by the engine in place: every
bucket reads the first rows of one draft buffer, the caller's own when it passes ``draft_buffer``
(the SGLang worker passes the buffers its draft calls write), and a round's draft that already
lies there is not copied. The host proposals are uploaded into the graphs' one input block the
same way (`host_destination`, which `GraftPlanner.host_candidates` passes to the upload); roots,
slots, lengths and sampled rows, the engine's own per-batch tensors, are copied in by one op
(`kernels.inputs.load_rows`: one launch on CUDA). The outputs are views of the first ``B`` rows of
the graph's own output buffers, not copies: they stay valid until the next `build` (graphs share
one memory pool, so a later replay may reuse them), which on a stream comes after everything the
round enqueued on them (verify, observe). The planner's tables (calibration counts,
successor table, token history, per-request correction windows) are read inside the graph at their
fixed addresses: they are updated in place by `GraftPlanner.observe` and must not be reallocated
after `capture` (size the per-slot state first, `GraftPlanner.ensure_slots`).

The round's bookkeeping is captured too, as a second graph per (bucket, width): `observe` after a
replayed build loads the engine's verify outcome into its static inputs in two ops (the target's
top-k by ``torch.topk`` into the captured buffer; the accepted nodes from SGLang's accept index, the
committed tokens, accept lengths and slots by `kernels.inputs.load_outcome`) and replays
`GraftPlanner.observe_eager` over the build graph's outputs in place; the padding rows are masked
inside the graph (no member bins, padding sources, the planner's dump slot), so they credit and
learn nothing. Its `RoundStats` row tensors are views, like the build's outputs. A tree that is not
the last replayed build's output (an eager build, a tree broadcast from another tensor-parallel
rank) is observed eagerly.

Batches larger than the largest bucket, devices other than CUDA, widths not captured and drafts
given as `DraftCandidates` run the eager `GraftPlanner.build`: same function, same result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple

import torch

from .config import GraftConfig
from .history import TokenHistory
from .kernels.inputs import load_outcome, load_rows
from .retrieval.buffer import HostCandidateBuffer, HostCandidates, copy_unless_same
from .sources import SOURCE_PADDING
from .step import DenseDraft, DraftCandidates, StepOutput
from .tree import DraftTree


class Planner(Protocol):
    """What `StepGraphs` reads of its planner (`GraftPlanner`, pipeline.py)."""

    config: GraftConfig
    device: torch.device
    buffer: HostCandidateBuffer
    history: TokenHistory
    dump_slot: Optional[int]
    successor_k: int

    def fix_slots(self) -> None: ...

    def observe_eager(self, out: StepOutput, on_path: Optional[torch.Tensor], target_topk: Optional[torch.Tensor],
                      committed: torch.Tensor, accept_len: torch.Tensor, slot_ids: torch.Tensor) -> Any: ...

    def build_eager(self, draft: "DenseDraft | DraftCandidates", roots: torch.Tensor, host: HostCandidates,
                    slot_ids: torch.Tensor, seq_lens: torch.Tensor, sampled: torch.Tensor,
                    num_nodes: Optional[int] = None) -> StepOutput: ...

__all__ = ["CudaRecorder", "Planner", "Recorder", "StepGraphs"]


@dataclass
class _Static:
    """The captured inputs of one batch bucket (``[bucket, ...]``): the host proposals as their packed
    block (`HostCandidates.unpack` runs inside the graph), which the upload writes in place."""

    draft: DenseDraft
    roots: torch.Tensor
    host_block: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    sampled: torch.Tensor

    def load(self, draft: DenseDraft, roots, host: HostCandidates, slots, seq_lens, sampled) -> None:
        """Copy a batch of ``B <= bucket`` rows into the first ``B`` rows (device copies only; a draft
        field or host block already written in place, the same memory, is not copied; roots, slots,
        lengths and sampled rows in one op, `kernels.inputs.load_rows`)."""
        b = roots.shape[0]
        for name in ("scores", "tokens", "parent_list"):
            copy_unless_same(getattr(self.draft, name)[:b], getattr(draft, name))
        host.pack_into(self.host_block)
        load_rows(self.roots, self.slots, self.seq_lens, self.sampled, roots, slots, seq_lens, sampled)


@dataclass
class _ObserveStatic:
    """The captured inputs of one (bucket, width) observe (``[bucket, ...]``) besides the build's
    outputs and slots, which it reads where the build graph left them. ``rows`` (``int64[1]``) is
    the round's batch: rows at and after it are padding, which the captured observe masks out.
    ``topk_values`` receives the values of the target's top-k, which nothing reads (allocated on
    first use, in the logits' dtype)."""

    on_path: torch.Tensor
    topk: Optional[torch.Tensor]
    committed: torch.Tensor
    accept_len: torch.Tensor
    rows: torch.Tensor
    row_ids: torch.Tensor
    topk_values: Optional[torch.Tensor] = None

    def load(self, b: int, accept_index, target_logits, committed, accept_len, slots_out, slots) -> None:
        """A verified round of ``b`` rows into the first rows: the target's top-k written by
        ``torch.topk`` into the captured buffer (one op), the accepted nodes, committed tokens,
        accept lengths, slots and the batch size in one op (`kernels.inputs.load_outcome`)."""
        if self.topk is not None:
            rows, k = b * self.on_path.shape[1], self.topk.shape[1]
            if self.topk_values is None or self.topk_values.dtype != target_logits.dtype:
                self.topk_values = torch.empty(self.topk.shape, dtype=target_logits.dtype, device=self.topk.device)
            torch.topk(target_logits[:rows], k, dim=-1, out=(self.topk_values[:rows], self.topk[:rows]))
        load_outcome(self.on_path, self.committed, self.accept_len, slots_out, self.rows, accept_index, committed,
                     accept_len, slots)


def _rows(out: StepOutput, b: int) -> StepOutput:
    """The first ``b`` rows of a replayed `StepOutput`, as views of the graph's output buffers (valid
    until the next replay; estimates: the calibrator's persistent table itself, which the build
    reads and `GraftPlanner.observe` refreshes)."""
    tree = DraftTree(*(t[:b] for t in (out.tree.tokens, out.tree.parents, out.tree.logp, out.tree.source)))
    cut = lambda t: None if t is None else t[:b]  # noqa: E731
    return StepOutput(tree, cut(out.member_bins), cut(out.depth), cut(out.positions), cut(out.mask),
                      cut(out.first_child), cut(out.next_sibling), out.estimates, cut(out.groups),
                      cut(out.gain), None if out.factors is None else tuple(cut(t) for t in out.factors))


class Replayable(Protocol):
    def replay(self) -> None: ...


class Recorder(Protocol):
    """Records a call once and replays it (`StepGraphs.capture`)."""

    def record(self, fn) -> Tuple[Replayable, Any]:
        """Warm ``fn`` up and record it; returns what replays it and its outputs, which every
        replay rewrites in place."""
        ...


class CudaRecorder:
    """CUDA graphs in one memory pool, each warmed up twice on a side stream first, as torch asks
    (``torch.cuda.graphs``)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, fn) -> Tuple["torch.cuda.CUDAGraph", Any]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class StepGraphs:
    """`GraftPlanner.build` captured per (batch bucket, verify width) and replayed (module docstring).

    Args:
        planner: the planner whose step is captured (its device must be CUDA for `capture`).
        topk, steps: the draft's dense tree (`DenseDraft`: S = topk + (steps - 1) * topk**2 candidates).
        buckets: batch sizes to capture, e.g. SGLang's ``cuda_graph_bs``; a batch is padded up to the
            smallest bucket that holds it.
        widths: verify widths to capture (>= 2; default the planner's, see `GraftConfig.verify_widths`).
        draft_buffer: the `DenseDraft` buffers (at least the largest bucket's rows, the same ``topk``
            and ``steps``) the engine's draft calls write and the graphs read in place, or None
            (the graphs' own; every round's draft is copied in).
        observe: also capture `GraftPlanner.observe_eager` per (bucket, width), replayed by
            `observe` after a replayed build.
    Raises:
        ValueError: no bucket, a bucket < 1, a width outside 2..N, or a ``draft_buffer`` of another
            shape.
    """

    def __init__(self, planner: Planner, topk: int, steps: int, buckets: Sequence[int],
                 widths: Optional[Sequence[int]] = None, draft_buffer: Optional[DenseDraft] = None,
                 observe: bool = True):
        n = planner.config.num_draft_tokens
        self.planner, self.topk, self.steps = planner, int(topk), int(steps)
        self.draft_width = self.topk + (self.steps - 1) * self.topk ** 2
        self.parent_width = 1 + (self.steps - 1) * self.topk          # the draft sink's parent_list width
        self.buckets = tuple(sorted({int(x) for x in buckets}))
        self.widths = tuple(sorted({int(w) for w in (widths or planner.config.verify_widths) if w >= 2}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"StepGraphs: buckets {list(buckets)} must be >= 1")
        if any(not 2 <= w <= n for w in self.widths):
            raise ValueError(f"StepGraphs: widths {list(self.widths)} must lie in 2..{n}")
        self.draft_buffer = draft_buffer if draft_buffer is not None else self._own_draft(self.buckets[-1])
        d = self.draft_buffer
        if ((d.topk, d.steps) != (self.topk, self.steps) or d.tokens.shape[0] < self.buckets[-1]
                or d.tokens.shape[1] != self.draft_width or d.scores.shape != d.tokens.shape
                or d.parent_list.shape != (d.tokens.shape[0], self.parent_width)):
            raise ValueError(f"StepGraphs: draft_buffer of shape {tuple(d.tokens.shape)} (topk {d.topk}, steps "
                             f"{d.steps}) does not hold {self.buckets[-1]} rows of {self.draft_width} candidates "
                             f"(topk {self.topk}, steps {self.steps})")
        # the host proposals' packed block: every bucket reads its first rows, the upload writes them
        self.host_block = torch.zeros(self.buckets[-1], 5, planner.buffer.width + 1, dtype=torch.int64,
                                      device=planner.device)
        HostCandidates.empty(self.buckets[-1], planner.buffer.width, planner.device).pack_into(self.host_block)
        self.observe_graphs = bool(observe)
        self._static: Dict[int, _Static] = {}
        self._graphs: Dict[Tuple[int, int], Tuple[Replayable, StepOutput]] = {}
        self._observes: Dict[Tuple[int, int], Tuple[Replayable, _ObserveStatic, Any]] = {}
        self._last: Optional[Tuple[Tuple[int, int], StepOutput]] = None   # the last replayed build
        self.replays = 0
        self.eager = 0
        self.observe_replays = 0
        self.observe_eager = 0

    @property
    def captured(self) -> int:
        """Build graphs captured so far."""
        return len(self._graphs)

    @property
    def observes_captured(self) -> int:
        """Observe graphs captured so far."""
        return len(self._observes)

    def _own_draft(self, rows: int) -> DenseDraft:
        dev, s = self.planner.device, self.draft_width
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        return DenseDraft(torch.zeros(rows, s, device=dev), z(rows, s),
                          z(rows, self.parent_width) - 1,
                          self.topk, self.steps)

    def _make_static(self, bucket: int) -> _Static:
        dev = self.planner.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        d = self.draft_buffer
        draft = DenseDraft(d.scores[:bucket], d.tokens[:bucket], d.parent_list[:bucket], self.topk, self.steps)
        host_block = self.host_block[:bucket]
        slots = torch.arange(bucket, device=dev).clamp(max=self.planner.history.tokens.shape[0] - 1)
        sampled = torch.zeros(bucket, dtype=torch.bool, device=dev)
        return _Static(draft, z(bucket), host_block, slots, z(bucket), sampled)

    def _call(self, st: _Static, width: int) -> StepOutput:
        return self.planner.build_eager(st.draft, st.roots, HostCandidates.unpack(st.host_block), st.slots,
                                        st.seq_lens, st.sampled, num_nodes=width)

    def _make_observe(self, bucket: int, width: int) -> _ObserveStatic:
        dev = self.planner.device
        k = self.planner.successor_k
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        on_path = torch.zeros(bucket, width, dtype=torch.bool, device=dev)
        on_path[:, 0] = True
        # rows 0: every row padding, so a warm-up credits nothing
        return _ObserveStatic(on_path, z(bucket * width, k) if k else None, z(bucket, width),
                              z(bucket) + 1, z(1), torch.arange(bucket, device=dev))

    def _observe_call(self, st: _Static, ost: _ObserveStatic, out: StepOutput) -> Any:
        """`GraftPlanner.observe_eager` of a bucket's build outputs with its padding rows (``>= rows``)
        masked out: no member bins and padding sources (nothing credited or learnt), the dump slot
        (`GraftPlanner.fix_slots`) instead of a live request's slot."""
        valid = ost.row_ids < ost.rows
        bins = torch.where(valid[:, None, None], out.member_bins, -1)
        source = torch.where(valid[:, None], out.tree.source, SOURCE_PADDING)
        slots = torch.where(valid, st.slots, self.planner.dump_slot)
        tree = DraftTree(out.tree.tokens, out.tree.parents, out.tree.logp, source)
        return self.planner.observe_eager(replace(out, tree=tree, member_bins=bins), ost.on_path, ost.topk,
                                          ost.committed, ost.accept_len, slots)

    def capture(self, recorder: "Optional[Recorder]" = None) -> None:
        """Capture every (bucket, width) build, and its observe unless ``observe`` is off (start-up:
        a device synchronise per graph). The planner's per-slot state is fixed first
        (`GraftPlanner.fix_slots`, which adds the dump slot the padding rows write to).

        Args:
            recorder: how a graph is recorded and replayed (`Recorder`); default CUDA graphs in
                one memory pool. The tests pass a ``make_fx`` recorder that replays the same
                captured calls on CPU.
        Raises:
            RuntimeError: the planner is not on a CUDA device (default recorder).
        """
        if recorder is None:
            if self.planner.device.type != "cuda":
                raise RuntimeError("StepGraphs.capture needs the planner on a CUDA device")
            recorder = CudaRecorder()
        self.planner.fix_slots()
        for bucket in self.buckets:
            st = self._static.setdefault(bucket, self._make_static(bucket))
            for width in self.widths:
                graph, out = recorder.record(lambda: self._call(st, width))
                self._graphs[(bucket, width)] = (graph, out)
                if self.observe_graphs:
                    ost = self._make_observe(bucket, width)
                    graph.replay()                       # a valid tree in the outputs for the warm-ups
                    ograph, stats = recorder.record(lambda: self._observe_call(st, ost, out))
                    self._observes[(bucket, width)] = (ograph, ost, stats)

    def host_destination(self, b: int) -> Optional[torch.Tensor]:
        """``int64[b, 5, M + 1]``: where a round of ``b`` rows uploads its host proposals so that a
        replay reads them in place (the first rows of the graphs' input block), or None when no
        graph was captured or ``b`` exceeds the largest bucket (the round builds eagerly)."""
        if not self._graphs or b > self.buckets[-1]:
            return None
        return self.host_block[:b]

    def warm_up(self) -> None:
        """Run every (bucket, width) build once eagerly on the static inputs (compiles the fused
        kernels at start-up where graphs are off; any compile error is raised here)."""
        for bucket in self.buckets:
            st = self._static.setdefault(bucket, self._make_static(bucket))
            for width in self.widths:
                self._call(st, width)

    def build(self, draft: "DenseDraft | DraftCandidates", roots: torch.Tensor, host: HostCandidates,
              slot_ids: torch.Tensor, seq_lens: torch.Tensor, sampled: torch.Tensor,
              num_nodes: Optional[int] = None) -> StepOutput:
        """`GraftPlanner.build` with the same arguments, replayed from a graph when one was captured
        for the batch's bucket and the width (else eager). Returns `StepOutput` ``[B, num_nodes]``."""
        width = num_nodes or self.planner.config.num_draft_tokens
        b = roots.shape[0]
        bucket = next((x for x in self.buckets if x >= b), None)
        entry = self._graphs.get((bucket, width)) if bucket is not None else None
        if (entry is None or not isinstance(draft, DenseDraft) or draft.tokens.shape[1] != self.draft_width
                or (draft.topk, draft.steps) != (self.topk, self.steps)):
            self.eager += 1
            self._last = None
            return self.planner.build_eager(draft, roots, host, slot_ids, seq_lens, sampled, num_nodes=num_nodes)
        graph, out = entry
        self._static[bucket].load(draft, roots, host, slot_ids, seq_lens, sampled)
        graph.replay()
        self.replays += 1
        rows = _rows(out, b)
        self._last = ((bucket, width), rows)
        return rows

    def observe(self, out: StepOutput, accept_index: torch.Tensor, target_logits: Optional[torch.Tensor],
                committed: torch.Tensor, accept_len: torch.Tensor, slot_ids: torch.Tensor) -> Optional[Any]:
        """`GraftPlanner.observe_verified`'s replay: the observe graph of the last `build`, when
        ``out`` is that build's replayed output (the same object) and the inputs have the captured
        layout (``committed`` 2-D; ``target_logits`` given when the planner has a successor table).
        Its inputs are loaded by two ops (`_ObserveStatic.load`). Returns its `RoundStats`, whose
        row tensors are views of the graph's buffers (valid until the next observe replay, which on
        a stream comes after the host copy the round enqueued), or None when nothing was replayed
        (the caller observes eagerly; counted in ``observe_eager``)."""
        last, self._last = self._last, None
        entry = self._observes.get(last[0]) if last is not None and out is last[1] else None
        if entry is None or (self.planner.successor_k > 0 and target_logits is None) or committed.dim() != 2:
            self.observe_eager += 1
            return None
        bucket, b = last[0][0], out.tree.tokens.shape[0]
        graph, ost, stats = entry
        ost.load(b, accept_index, target_logits, committed, accept_len, self._static[bucket].slots, slot_ids)
        graph.replay()
        self.observe_replays += 1
        return replace(stats, sources=stats.sources[:b], members=stats.members[:b], depths=stats.depths[:b],
                       expected=None if stats.expected is None else stats.expected[:b])

    def observed_eagerly(self) -> None:
        """A round observed without the graph (`GraftPlanner.observe`): the last replayed build is
        no longer replayable by `observe` (counted in ``observe_eager``)."""
        self._last = None
        self.observe_eager += 1
