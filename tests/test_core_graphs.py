"""`StepGraphs`: the graft step replayed from CUDA graphs equals the eager step, for padded batches,
every captured width and tables that `observe` keeps updating between rounds.

A captured build or observe runs its recorded device ops on every replay and none of the Python
around them: state assigned from Python during capture is never assigned again. On CPU,
``make_fx`` records one call the same way (`FxRecorder`: the planner's tables are referenced, not
copied), so `test_captured_round_replays_many_rounds_like_eager` checks that many replayed rounds
(build and observe) with no eager round in between leave the planner exactly as eager rounds do.
The CUDA tests run on a GPU (scripts/bench_step_cuda.py prints the same check per shape).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graft_spec.config import GraftConfig
from graft_spec.graphs import StepGraphs
from graft_spec.kernels import fused_ops_everywhere
from graft_spec.pipeline import GraftPlanner, on_path_from_accept_index
from graft_spec.retrieval.buffer import HostCandidates
from graft_spec.step import DenseDraft, StepOutput

from sglang_patch.bench.step import OpCounter
from test_core_step import dense_inputs

TOPK, STEPS, VOCAB = 4, 4, 5000
S = TOPK + (STEPS - 1) * TOPK * TOPK
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _planner(device: str) -> GraftPlanner:
    cfg = GraftConfig(num_draft_tokens=24, topk=TOPK, depth=STEPS)
    planner = GraftPlanner(cfg, VOCAB, device=device, max_batch=32, max_slots=32)
    planner.ensure_slots(32)
    return planner


def _inputs(b: int, seed: int, device: str, width: int):
    draft, roots, host, slots, seq_lens, sampled = dense_inputs(b, TOPK, STEPS, VOCAB, width, "cpu",
                                                                torch.Generator().manual_seed(seed), unconverted=True)
    mv = lambda t: t.to(device)  # noqa: E731
    draft = DenseDraft(mv(draft.scores), mv(draft.tokens), mv(draft.parent_list), TOPK, STEPS)
    host = HostCandidates(*(mv(getattr(host, f)) for f in ("tokens", "parents", "logp", "member", "match",
                                                           "anchor_len", "group", "speculate")))
    return draft, mv(roots), host, mv(slots.flip(0)), mv(seq_lens), mv(sampled)


def _same(a, b) -> bool:
    pairs = [(a.tree.tokens, b.tree.tokens), (a.tree.parents, b.tree.parents), (a.tree.source, b.tree.source),
             (a.positions, b.positions), (a.mask, b.mask), (a.first_child, b.first_child),
             (a.next_sibling, b.next_sibling), (a.member_bins, b.member_bins)]
    return all(torch.equal(x, y) for x, y in pairs) and torch.allclose(a.gain, b.gain)


def test_eager_fallback_without_a_capture():
    planner = _planner("cpu")
    graphs = StepGraphs(planner, TOPK, STEPS, buckets=[4, 16])
    args = _inputs(3, 0, "cpu", planner.buffer.width)
    assert _same(graphs.build(*args, num_nodes=12), planner.build(*args, num_nodes=12))
    assert graphs.eager == 1 and graphs.replays == 0
    with pytest.raises(RuntimeError, match="CUDA"):
        graphs.capture()
    with pytest.raises(ValueError, match="widths"):
        StepGraphs(planner, TOPK, STEPS, buckets=[4], widths=[1, 25])


def _packed(host: HostCandidates) -> HostCandidates:
    """The same proposals as one uploaded block (what `HostCandidateBuffer.upload` hands the step)."""
    block = torch.zeros(host.tokens.shape[0], 5, host.width + 1, dtype=torch.int64, device=host.tokens.device)
    host.pack_into(block)
    return HostCandidates.unpack(block)


def test_packed_host_block_round_trips_every_field():
    host = _inputs(3, 1, "cpu", 16)[2]
    packed = _packed(host)
    for name in ("tokens", "parents", "logp", "member", "match", "anchor_len", "group", "speculate"):
        x, y = getattr(host, name), getattr(packed, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    block = torch.full((4, 5, 17), 7, dtype=torch.int64)
    packed.pack_into(block)                                   # the one-copy path: rows 0..2 only
    assert torch.equal(block[:3], packed.packed) and (block[3] == 7).all()


@pytest.mark.parametrize("b,width,packed", [(3, 12, False), (4, 24, False), (3, 24, True)])
def test_static_buffers_give_the_eager_tree_on_cpu(b, width, packed):
    """What a capture records, run eagerly on CPU: the bucket's static inputs (`DenseDraft` buffers,
    the host proposals' block, roots, slots) loaded with a batch of ``b <= bucket`` rows, the captured
    call, and the first ``b`` rows of its output equal `GraftPlanner.build` of the batch (host
    proposals given field by field or, as uploaded, packed)."""
    planner = _planner("cpu")
    graphs = StepGraphs(planner, TOPK, STEPS, buckets=[4])
    st = graphs._make_static(4)
    assert st.draft.parent_list.shape == (4, 1 + TOPK * (STEPS - 1)) and st.draft.scores.shape == (4, S)
    assert st.host_block.shape == (4, 5, planner.buffer.width + 1)
    args = list(_inputs(b, 5, "cpu", planner.buffer.width))
    if packed:
        args[2] = _packed(args[2])
    with OpCounter() as load:
        st.load(*args)
    assert load.ops == 3 + (1 if packed else 8) + 4     # draft, host proposals, roots / slots / lengths / sampled
    got = graphs._call(st, width)
    want = planner.build(*args, num_nodes=width)
    rows = lambda t: t[:b]  # noqa: E731
    for x, y in [(got.tree.tokens, want.tree.tokens), (got.tree.parents, want.tree.parents),
                 (got.mask, want.mask), (got.positions, want.positions), (got.member_bins, want.member_bins)]:
        assert torch.equal(rows(x), y)



def test_a_draft_written_in_place_is_not_copied():
    """With the engine's draft buffers (``draft_buffer``), every bucket reads their first rows, and a
    round whose draft already lies there loads only the other inputs; a draft elsewhere is copied
    in. A buffer that cannot hold the largest bucket is refused."""
    planner = _planner("cpu")
    draft, roots, host, slots, seq_lens, sampled = _inputs(3, 2, "cpu", planner.buffer.width)
    buffer = DenseDraft(torch.zeros(16, S), torch.zeros(16, S, dtype=torch.int64),
                        torch.full((16, 1 + TOPK * (STEPS - 1)), -1, dtype=torch.int64), TOPK, STEPS)
    graphs = StepGraphs(planner, TOPK, STEPS, buckets=[4, 16], draft_buffer=buffer)
    st4, st16 = graphs._make_static(4), graphs._make_static(16)
    assert st4.draft.tokens.data_ptr() == st16.draft.tokens.data_ptr() == buffer.tokens.data_ptr()
    for name in ("scores", "tokens", "parent_list"):              # the engine's draft call writes in place
        getattr(buffer, name)[:3].copy_(getattr(draft, name))
    in_place = DenseDraft(buffer.scores[:3], buffer.tokens[:3], buffer.parent_list[:3], TOPK, STEPS)
    with OpCounter() as load:
        st4.load(in_place, roots, host, slots, seq_lens, sampled)
    assert load.ops == 8 + 4                                      # host proposals, roots / slots / lengths / sampled
    want = planner.build(draft, roots, host, slots, seq_lens, sampled, num_nodes=12)
    assert torch.equal(graphs._call(st4, 12).tree.tokens[:3], want.tree.tokens)
    with OpCounter() as load:
        st4.load(draft, roots, host, slots, seq_lens, sampled)
    assert load.ops == 3 + 8 + 4
    with pytest.raises(ValueError, match="draft_buffer"):
        StepGraphs(planner, TOPK, STEPS, buckets=[4, 32], draft_buffer=buffer)

def test_host_proposals_uploaded_into_the_input_block_are_not_copied():
    """After a capture the planner uploads a round's host proposals into the graphs' one input block
    (`StepGraphs.host_destination`), so a replay's load copies only roots, slots, lengths and
    sampled rows; the replayed tree equals the eager build of the same proposals."""
    planner = _planner("cpu")
    graphs = StepGraphs(planner, TOPK, STEPS, buckets=[4, 16], widths=[12])
    assert graphs.host_destination(3) is None                     # nothing captured yet: a new tensor
    graphs.capture(FxRecorder())
    planner.graphs = graphs
    draft, roots, _, slots, seq_lens, sampled = _inputs(3, 4, "cpu", planner.buffer.width)
    rids = ["a", "b", "c"]
    for rid in rids:                                              # a repeating prompt: the suffix index matches
        planner.start_request(rid, [5, 6, 7, 8] * 6)
    host = planner.host_candidates(rids)
    assert host.packed.data_ptr() == graphs.host_block.data_ptr() and host.packed.shape[0] == 3
    assert (host.member >= 0).any()                               # the rows carry proposals
    st4 = graphs._static[4]
    with OpCounter() as load:
        st4.load(draft, roots, host, slots, seq_lens, sampled)
    assert load.ops == 3 + 4                                      # draft, roots / slots / lengths / sampled
    want = planner.build_eager(draft, roots, host, slots, seq_lens, sampled, num_nodes=12)
    got = planner.build(draft, roots, host, slots, seq_lens, sampled, num_nodes=12)
    assert graphs.replays == 1 and _same(got, want)
    assert graphs.host_destination(17) is None                    # above the largest bucket: eager


def test_verify_outcome_is_loaded_by_two_ops():
    """After a replayed build, `GraftPlanner.observe_verified` loads SGLang's verify outcome into the
    observe graph by two ops (the successor table's top-k straight into the captured buffer; the
    accepted nodes, committed tokens, accept lengths, slots and batch size by ``graft::load_outcome``,
    counted as one launch inside `fused_ops_everywhere`) and replays; the planner state equals an
    eager observe of the same round."""
    eager, planner = _planner("cpu"), _planner("cpu")
    graphs = StepGraphs(planner, TOPK, STEPS, buckets=[4], widths=[24])
    graphs.capture(FxRecorder())
    planner.graphs = graphs
    args = _inputs(3, 11, "cpu", planner.buffer.width)
    out, want = planner.build(*args), eager.build(*args)
    outcome = _verify(out, VOCAB, torch.Generator().manual_seed(5))
    b, n = out.tree.tokens.shape
    ost = graphs._observes[(4, 24)][1]
    ost.load(b, *outcome, graphs._static[4].slots, args[3])       # allocates the top-k values once
    with fused_ops_everywhere(), OpCounter() as load:
        ost.load(b, *outcome, graphs._static[4].slots, args[3])
    assert load.ops == 2, load.names
    assert torch.equal(ost.on_path[:b], on_path_from_accept_index(outcome[0], n)) and int(ost.rows) == b
    replayed = planner.observe_verified(out, *outcome, args[3])
    stats = eager.observe_verified(want, *outcome, args[3])
    assert graphs.observe_replays == 1
    assert torch.equal(replayed.sources, stats.sources) and torch.equal(replayed.members, stats.members)
    for name, w in _state(eager).items():
        g = _state(planner)[name]
        assert torch.equal(w, g[:32] if name in ("request", "history", "count") else g), name


@cuda
def test_replay_equals_eager_for_padded_batches_and_updated_tables():
    planner = _planner("cuda")
    graphs = StepGraphs(planner, TOPK, STEPS, buckets=[1, 4, 16])
    graphs.capture()
    assert graphs.captured == graphs.observes_captured == 3 * 2   # widths 12 and 24 (1 is a plain round)
    for rnd, (b, width) in enumerate([(1, 24), (3, 12), (4, 24), (9, 24), (16, 12), (2, 24)]):
        args = _inputs(b, rnd, "cuda", planner.buffer.width)
        eager = planner.build(*args, num_nodes=width)
        replay = graphs.build(*args, num_nodes=width)
        assert replay.tree.tokens.shape == (b, width)
        assert _same(replay, eager), (b, width)
        # a verify outcome updates the tables the next replay reads in place
        on_path = torch.zeros(b, width, dtype=torch.bool, device="cuda")
        on_path[:, :2] = True
        accept = torch.full((b,), 1, dtype=torch.int64, device="cuda")
        planner.observe(replay, on_path, torch.randint(0, VOCAB, (b, width, planner.successor.k), device="cuda"),
                        torch.randint(0, VOCAB, (b, width), device="cuda"), accept + 1, args[3])
    assert graphs.replays == 6 and graphs.eager == 0
    args = _inputs(17, 9, "cuda", planner.buffer.width)              # above the largest bucket: eager
    assert _same(graphs.build(*args), planner.build(*args)) and graphs.eager == 1


def _verify(out: StepOutput, vocab: int, gen: torch.Generator):
    """A deterministic stand-in for the target: the accepted path ends at the first of the deepest
    nodes whose path tokens are all ``!= 0 (mod 3)``; the bonus is drawn from ``gen``. Returns
    ``observe_verified``'s ``(accept_index, target_logits, committed, accept_len)`` in SGLang's
    layout (accept index ``[B, N]`` in path order, -1 padded; logits ``[B * N, vocab]``)."""
    tree = out.tree
    b, n = tree.tokens.shape
    dev = tree.tokens.device
    ok = torch.where(torch.arange(n, device=dev) == 0, True, tree.tokens % 3 != 0)
    path_ok = (~out.mask | ok[:, None, :]).all(dim=2)                  # every ancestor (and itself) ok
    score = torch.where(path_ok, out.depth * n + (n - 1 - torch.arange(n, device=dev)), -1)
    end = score.argmax(dim=1)
    on_path = out.mask[torch.arange(b, device=dev), end]               # the end node's ancestors
    idx = torch.arange(n, device=dev)
    order = torch.where(on_path, idx, n).sort(dim=1).values.clamp(max=n - 1)
    accept_len = on_path.sum(dim=1)                                    # root included
    committed = torch.cat([tree.tokens.gather(1, order)[:, 1:],
                           torch.zeros(b, 1, dtype=torch.int64, device=dev)], 1)
    bonus = torch.randint(0, vocab, (b,), generator=gen).to(dev)
    committed.scatter_(1, (accept_len - 1)[:, None], bonus[:, None])
    logits = torch.randn(b * n, vocab, generator=gen).to(dev)
    accept_index = torch.where(torch.arange(n, device=dev) < accept_len[:, None],
                               order + torch.arange(b, device=dev)[:, None] * n, -1)
    return accept_index, logits, committed, accept_len


def _state(planner: GraftPlanner) -> dict:
    cal = planner.calibrator
    return {"hits": cal.hits, "trials": cal.trials, "recent": cal.recent, "table": cal.table,
            "request": planner.request_correction.recent, "successor": planner.successor.table,
            "history": planner.history.tokens, "count": planner.history.count}


def _run_rounds(planner: GraftPlanner, build, rounds: int, b: int, device: str, vocab: int) -> tuple:
    """``rounds`` verified rounds: inputs from a fixed seed, ``build`` (eager or replayed), the
    stand-in verify, ``observe``; returns each round's trees and the rounds' metrics summed over
    rows and rounds (`RoundStats` members, depths; CPU tensors)."""
    gen = torch.Generator().manual_seed(7)
    trees, metrics = [], 0
    roots = None
    for rnd in range(rounds):
        draft, r, host, slots, seq_lens, sampled = _inputs(b, 100 + rnd, device, planner.buffer.width)
        roots = r if roots is None else roots
        seq_lens = seq_lens + 4 * rnd
        host.anchor_len.copy_(seq_lens + 1)
        host = _packed(host) if rnd % 2 else host              # as uploaded (one block) every other round
        out = build(draft, roots, host, slots, seq_lens, sampled)
        trees.append(torch.stack([out.tree.tokens, out.tree.parents, out.tree.source]).cpu())
        accept_index, logits, committed, accept_len = _verify(out, vocab, gen)
        stats = planner.observe_verified(out, accept_index, logits, committed, accept_len, slots)
        assert stats.members.shape[0] == stats.depths.shape[0] == b          # per row, padding rows cut
        metrics = metrics + torch.cat([stats.members.sum(0).reshape(-1), stats.depths.sum(0).reshape(-1)]).cpu()
        roots = committed.gather(1, (accept_len - 1)[:, None])[:, 0]
    return trees, metrics


def _leaves(obj) -> list:
    """The tensors of a (nested) dataclass / tuple output, in field order (None skipped)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _leaves(getattr(obj, f.name))]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _leaves(x)]
    return []


def _rebuild(obj, leaves: list):
    """``obj`` with its tensors (`_leaves` order) replaced by ``leaves`` (consumed from the front)."""
    if isinstance(obj, torch.Tensor):
        return leaves.pop(0)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _rebuild(getattr(obj, f.name), leaves)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple):
        return tuple(_rebuild(x, leaves) for x in obj)
    return obj


class FxRecorder:
    """`StepGraphs.capture`'s recorder on CPU: ``make_fx`` records the call once (the static
    buffers and the planner's tables are referenced, not copied, as a CUDA graph reads them by
    address) and a replay runs the recorded ops, writing the outputs into the buffers the capture
    returned, as a CUDA graph's replay does. The warm-up and the trace run the call for real, as
    torch's CUDA capture warms up; the captured observe has every row padding then."""

    class _Graph:
        def __init__(self, gm, outs):
            self.gm, self.outs = gm, outs

        def replay(self) -> None:
            for dst, src in zip(self.outs, self.gm()):
                dst.copy_(src)

    def record(self, fn):
        from torch.fx.experimental.proxy_tensor import make_fx

        fn()
        gm = make_fx(lambda: _leaves(fn()))()
        template = fn()
        outs = [t.clone() for t in _leaves(template)]
        return self._Graph(gm, outs), _rebuild(template, list(outs))


@pytest.mark.parametrize("width,observe", [(24, True), (12, True), (24, False)])
def test_captured_round_replays_many_rounds_like_eager(width, observe):
    """`StepGraphs` captured on CPU (`FxRecorder`: the build, and the observe unless off) and
    replayed for many rounds with no eager build or observe in between, 4 rows in a bucket of 6
    (two padding rows), gives the trees and the planner state (calibration counts, source windows,
    estimate table, metrics, per-request windows, successor table, history) of eager rounds, bit
    for bit."""
    vocab, b, rounds = 50, 4, 12
    eager, captured = _planner("cpu"), _planner("cpu")
    eager_trees, eager_metrics = _run_rounds(eager, lambda *a: eager.build(*a, num_nodes=width), rounds, b, "cpu",
                                             vocab)
    graphs = StepGraphs(captured, TOPK, STEPS, buckets=[6], widths=[width], observe=observe)
    graphs.capture(FxRecorder())
    captured.graphs = graphs
    assert captured.dump_slot == 32 and captured.slot_capacity == 32
    replay_trees, replay_metrics = _run_rounds(captured, lambda *a: captured.build(*a, num_nodes=width), rounds, b,
                                               "cpu", vocab)
    assert eager_metrics[0] > 0 and torch.equal(eager_metrics, replay_metrics), "round metrics differ"
    assert graphs.replays == rounds and graphs.eager == 0
    assert (graphs.observe_replays, graphs.observe_eager) == ((rounds, 0) if observe else (0, rounds))
    for rnd, (x, y) in enumerate(zip(eager_trees, replay_trees)):
        assert torch.equal(x, y), f"round {rnd}: replayed tree differs"
    want, got = _state(eager), _state(captured)
    assert want["trials"].sum() > 0 and want["recent"][:, 0].sum() > 0     # the rounds credited something
    for name in want:
        w, g = want[name], got[name]
        if name in ("request", "history", "count"):
            g = g[:32]                                  # the captured planner's dump slot is row 32
        assert torch.equal(w, g), f"{name} differs after {rounds} replayed rounds"


def test_observe_of_another_tree_runs_eagerly():
    """Only the last replayed build's own output is observed by a replay: a second observe of it
    and the observe of an eager build run eagerly."""
    planner = _planner("cpu")
    graphs = StepGraphs(planner, TOPK, STEPS, buckets=[4], widths=[24])
    graphs.capture(FxRecorder())
    planner.graphs = graphs
    gen = torch.Generator().manual_seed(3)
    args = _inputs(3, 5, "cpu", planner.buffer.width)
    out = planner.build(*args)
    planner.observe_verified(out, *_verify(out, VOCAB, gen), args[3])
    assert (graphs.replays, graphs.observe_replays) == (1, 1)
    planner.observe_verified(out, *_verify(out, VOCAB, gen), args[3])     # the same build again: eager
    other = planner.build_eager(*args)
    planner.observe_verified(other, *_verify(other, VOCAB, gen), args[3])
    again = planner.build(*args)
    on_path = on_path_from_accept_index(_verify(again, VOCAB, gen)[0], 24)
    planner.observe(again, on_path, None, *_verify(again, VOCAB, gen)[2:], args[3])   # the on-path mask: eager
    planner.observe_verified(again, *_verify(again, VOCAB, gen), args[3])  # ... and its build is used up
    assert (graphs.replays, graphs.observe_replays, graphs.observe_eager) == (2, 1, 4)


@cuda
def test_graph_replays_many_rounds_like_eager_on_cuda():
    """`StepGraphs` replays of build and observe (4 rows in a bucket of 6), with no eager round in
    between, end in the eager rounds' planner state."""
    vocab, b, rounds = 50, 4, 12
    eager, captured = _planner("cuda"), _planner("cuda")
    graphs = StepGraphs(captured, TOPK, STEPS, buckets=[6])
    graphs.capture()
    captured.graphs = graphs
    assert graphs.observes_captured == graphs.captured == 2
    eager_trees, eager_metrics = _run_rounds(eager, lambda *a: eager.build(*a), rounds, b, "cuda", vocab)
    replay_trees, replay_metrics = _run_rounds(captured, lambda *a: captured.build(*a), rounds, b, "cuda", vocab)
    assert torch.allclose(eager_metrics, replay_metrics)
    assert graphs.replays == graphs.observe_replays == rounds and graphs.eager == graphs.observe_eager == 0
    for x, y in zip(eager_trees, replay_trees):
        assert torch.equal(x, y)
    want, got = _state(eager), _state(captured)
    for name in want:
        g = got[name][:32] if name in ("request", "history", "count") else got[name]   # row 32: the dump slot
        assert torch.allclose(want[name].double(), g.double()), name


def test_per_slot_state_is_fixed_once_graphs_capture_it():
    """A captured build reads the token history and per-request windows by address: after
    `fix_slots` (what `StepGraphs.capture` calls first, which adds the padding rows' dump slot)
    they never reallocate, growth is refused."""
    planner = _planner("cpu")
    planner.fix_slots()
    tokens, recent = planner.history.tokens, planner.request_correction.recent
    assert planner.dump_slot == 32 and tokens.shape[0] == recent.shape[0] == 33
    planner.fix_slots()                                       # idempotent
    planner.ensure_slots(32)                                  # within capacity: nothing to do
    with pytest.raises(RuntimeError, match="fixed at 32 slots"):
        planner.ensure_slots(33)
    assert planner.history.tokens is tokens and planner.request_correction.recent is recent
