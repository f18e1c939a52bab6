"""ChainStep / RequestTracker: the proposer's per-step logic driven by a fake target on CPU.

The fake target is a bigram model; the fake EAGLE loop calls `ChainStep.record` K times
along the top-1 spine, exactly as vLLM's loop calls the proposer's `_greedy_sample`
(llm_base_proposer.py:629/650/761). Verification uses vLLM's greedy chain rule
(rejection_sampler.py:793-847: accept while draft == target argmax, then emit the target
argmax) re-implemented in `_greedy_chain_verify`; vLLM's own kernel is Triton-only.
No vLLM import: these run everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_spec.config import GraftConfig
from graft_spec.pipeline import GraftPlanner
from vllm_worker import step as step_module
from vllm_worker.requests import RequestTracker
from vllm_worker.step import ChainStep


class _Batch:
    """The InputBatch fields the proposer reads (gpu_input_batch.py:124-162)."""

    def __init__(self, max_reqs: int = 8, max_len: int = 512):
        self.req_ids: list[str] = []
        self.token_ids_cpu = np.zeros((max_reqs, max_len), dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_reqs, dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_reqs, dtype=np.int32)
        self.seqs: list[list[int]] = []

    def set(self, reqs: dict[str, tuple[list[int], list[int]]]) -> None:
        """reqs: id -> (prompt, output) in row order."""
        self.req_ids = list(reqs)
        self.seqs = []
        for i, (p, o) in enumerate(reqs.values()):
            s = p + o
            self.token_ids_cpu[i, : len(s)] = s
            self.num_prompt_tokens[i] = len(p)
            self.num_tokens_no_spec[i] = len(s)
            self.seqs.append(s)

    def finish(self, step: ChainStep, k: int) -> list[list[int]]:
        b = len(self.req_ids)
        roots = torch.tensor([s[-1] for s in self.seqs])
        return step.finish(roots, self.req_ids, self.token_ids_cpu[:b], self.num_prompt_tokens[:b],
                           self.num_tokens_no_spec[:b], k)


class _RecordingPlanner:
    """Records the planner calls the tracker makes (its whole door: catch_up / prefill / stop)."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls: list[tuple] = []

    def catch_up(self, rid, prompt, output, tenant=None, sampled=False):
        self.calls.append(("catch_up", rid, [int(t) for t in prompt], [int(t) for t in output], sampled))

    def ensure_slots(self, slots):
        pass

    def prefill(self, rids, slot_ids, contexts, first=None, extend_ids=None, extend_lens=None, tenants=None):
        self.calls.append(("prefill", rids[0], int(slot_ids[0]), list(contexts[0])))

    def stop_request(self, rid):
        self.calls.append(("stop", rid))


def _bigram(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=g) * 3.0


def _cycle_target(vocab: int, cycle: list[int], seed: int) -> torch.Tensor:
    """Bigram target whose greedy path repeats ``cycle`` (retrieval-friendly text)."""
    t = _bigram(vocab, seed)
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        t[a, b] = t[a].max() + 5.0
    return t


def _greedy_chain_verify(target: torch.Tensor, root: int, chain: list[int]) -> list[int]:
    out, last = [], root
    for t in chain:
        want = int(target[last].argmax())
        if t != want:
            break
        out.append(t)
        last = t
    return out + [int(target[last].argmax())]


def _decode(step: ChainStep, target: torch.Tensor, drafter: torch.Tensor, prompts: dict[str, list[int]],
            k: int, new_tokens: int, leave_after: dict[str, int] | None = None):
    """Run a fake vLLM decode loop; returns outputs, per-step accepted lengths, live counts."""
    batch = _Batch()
    outs = {r: [] for r in prompts}
    accepted: list[int] = []
    live_trace: list[int] = []
    active = list(prompts)
    step_i = 0
    while active:
        for r in list(active):
            if len(outs[r]) >= new_tokens or (leave_after and step_i >= leave_after.get(r, 10 ** 9)):
                active.remove(r)
        if not active:
            break
        batch.set({r: (prompts[r], outs[r]) for r in active})
        step.begin()
        cur = torch.tensor([s[-1] for s in batch.seqs])
        for _ in range(k):  # vLLM's K draft passes, top-1 continues
            cur = step.record(drafter[cur])
        chains = batch.finish(step, k)
        live_trace.append(step.planner.live_requests())
        for r, s, ch in zip(active, batch.seqs, chains):
            assert len(ch) <= k and all(0 <= t < target.shape[0] for t in ch)
            emitted = _greedy_chain_verify(target, s[-1], ch)
            accepted.append(len(emitted))
            outs[r].extend(emitted)
        step_i += 1
    batch.set({})
    step.finish(torch.zeros(0, dtype=torch.int64), [], batch.token_ids_cpu[:0], batch.num_prompt_tokens[:0],
                batch.num_tokens_no_spec[:0], k)
    return outs, accepted, live_trace


def _greedy_reference(target: torch.Tensor, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    while len(seq) < len(prompt) + n:
        seq.append(int(target[seq[-1]].argmax()))
    return seq[len(prompt):]


def test_tracker_feeds_each_committed_token_once_and_frees_departed_requests():
    rec = _RecordingPlanner()
    tr = RequestTracker(rec)
    b = _Batch()
    b.set({"a": ([1, 2, 3], []), "b": ([7, 8], [9])})           # b: resumed after preemption
    slots = tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2],
                    sampled=[False, True])
    assert rec.calls == [("catch_up", "a", [1, 2, 3], [], False), ("prefill", "a", 0, [1, 2, 3]),
                         ("catch_up", "b", [7, 8], [9], True), ("prefill", "b", 1, [7, 8, 9])]
    assert slots.tolist() == [0, 1] and tr.held("a") == 3 and tr.held("b") == 3
    assert "a" in tr and "b" in tr and len(tr) == 2
    rec.calls.clear()
    b.set({"a": ([1, 2, 3], [4, 5]), "c": ([6], [])})           # b left, c joined (takes b's slot)
    slots = tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2])
    assert rec.calls == [("stop", "b"), ("catch_up", "a", [1, 2, 3], [4, 5], False),
                         ("catch_up", "c", [6], [], False), ("prefill", "c", 1, [6])]
    assert slots.tolist() == [0, 1] and "b" not in tr and len(tr) == 2
    rec.calls.clear()
    tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2])
    assert rec.calls == []                                     # nothing new: nothing fed twice
    tr.stop_all()
    assert sorted(rec.calls) == [("stop", "a"), ("stop", "c")] and len(tr) == 0


def test_catch_up_feeds_each_committed_token_once():
    """`GraftPlanner.catch_up` (both engines' trackers): a new request is started with its prompt and
    output, a known one gets only the tokens the host has not seen, one whose prompt changed or that
    went back (recomputed after preemption) is restarted."""
    planner = GraftPlanner(GraftConfig(num_draft_tokens=7, topk=2, depth=2), 64)
    fed = []
    start, extend = planner.start_request, planner.extend
    planner.start_request = lambda rid, p, **kw: fed.append(("start", rid, list(p))) or start(rid, p, **kw)
    planner.extend = lambda rid, t: fed.append(("extend", rid, [int(x) for x in t])) or extend(rid, t)
    assert planner.catch_up("a", [1, 2, 3], [4]) is True
    assert planner.catch_up("a", [1, 2, 3], [4]) is False
    assert planner.catch_up("a", [1, 2, 3], [4, 5, 6]) is False
    assert planner.catch_up("a", [1, 2, 3], [4]) is True                 # went back: restarted
    assert planner.catch_up("a", [1, 2], [3, 4]) is True                 # another prompt: restarted
    assert fed == [("start", "a", [1, 2, 3]), ("extend", "a", [4]), ("extend", "a", [5, 6]),
                   ("start", "a", [1, 2, 3]), ("extend", "a", [4]), ("start", "a", [1, 2]), ("extend", "a", [3, 4])]
    assert planner.seen("a") == 4


def test_request_left_out_of_a_step_but_alive_keeps_its_state():
    """Issue 45 (d): vLLM removes a request the scheduler did not schedule this step from the input
    batch but keeps it in ``runner.requests`` (gpu_model_runner.py:1213-1233): it is not finished."""
    rec = _RecordingPlanner()
    tr = RequestTracker(rec)
    b = _Batch()
    b.set({"a": ([1, 2, 3], [4]), "b": ([7, 8], [9])})
    tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2])
    rec.calls.clear()
    b.set({"a": ([1, 2, 3], [4, 5])})                          # b left out, still held by the runner
    tr.sync(b.req_ids, b.token_ids_cpu[:1], b.num_prompt_tokens[:1], b.num_tokens_no_spec[:1], alive={"a", "b"})
    assert rec.calls == [("catch_up", "a", [1, 2, 3], [4, 5], False)] and "b" in tr
    rec.calls.clear()
    b.set({"a": ([1, 2, 3], [4, 5]), "b": ([7, 8], [9, 10, 11])})  # b back: only its new tokens
    slots = tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2],
                    alive={"a", "b"})
    assert rec.calls == [("catch_up", "b", [7, 8], [9, 10, 11], False)] and slots.tolist() == [0, 1]
    rec.calls.clear()
    b.set({"a": ([1, 2, 3], [4, 5])})                          # b finished: gone from the runner too
    tr.sync(b.req_ids, b.token_ids_cpu[:1], b.num_prompt_tokens[:1], b.num_tokens_no_spec[:1], alive={"a"})
    assert rec.calls == [("stop", "b")] and "b" not in tr


def test_retrieval_state_created_and_freed_per_request_id_in_real_sources():
    vocab, k = 64, 3
    step = ChainStep(GraftConfig(num_draft_tokens=10, topk=2, depth=k), vocab)
    target = _bigram(vocab, 1)
    prompts = {"r0": [1, 2, 3], "r1": [4, 5], "r2": [6, 7, 8, 9]}
    _, _, live = _decode(step, target, target, prompts, k, new_tokens=8, leave_after={"r1": 1})
    assert live[0] == 3 and live[1] == 2          # r1 freed as soon as it left the batch
    for src in step.planner.retriever.sources:
        assert src.live_requests() == 0, f"{src.name} kept state after every request left"


@pytest.mark.parametrize("k", [1, 4])
def test_perfect_drafter_chain_is_fully_accepted_and_output_is_lossless(k):
    """Draft == target: the spine is the target's greedy continuation and is the best chain; once the
    calibrator has seen a few steps (it starts from priors, so a retrieved chain may win early) at
    least 80% of the steps emit K + 1 tokens; output equals plain greedy decoding throughout."""
    vocab = 96
    target = _bigram(vocab, 3)
    cfg = GraftConfig(num_draft_tokens=1 + 2 * k, topk=2, depth=k)
    prompts = {"a": [5, 6, 7], "b": [11], "c": [40, 41, 42, 43]}
    outs, accepted, _ = _decode(ChainStep(cfg, vocab), target, target, prompts, k, new_tokens=30)
    for r, p in prompts.items():
        assert outs[r][:30] == _greedy_reference(target, p, 30)
    assert sum(a == k + 1 for a in accepted) >= 0.8 * len(accepted), accepted


def test_retrieval_rescues_a_useless_drafter_and_stays_lossless():
    """Random drafter + repetitive target text: with retrieval the chains come from the suffix
    index / successor matrix and are accepted; without it almost nothing is."""
    vocab, k = 128, 4
    cycle = [9, 33, 71, 2, 55, 18, 90]
    target = _cycle_target(vocab, cycle, 5)
    drafter = _bigram(vocab, 99)
    prompts = {"a": cycle * 2 + cycle[:3], "b": cycle[2:] + cycle}
    base = dict(num_draft_tokens=24, topk=3, depth=k)  # 12 spine nodes + 11 slots for retrieval
    means = {}
    for name, retrieval in (("on", {}), ("off", {"successor": False, "suffix": False, "lookup": False, "outputs": False})):
        outs, accepted, _ = _decode(ChainStep(GraftConfig(**base, retrieval=retrieval), vocab),
                                    target, drafter, prompts, k, new_tokens=40)
        for r, p in prompts.items():
            assert outs[r][:40] == _greedy_reference(target, p, 40)
        means[name] = float(np.mean(accepted))
    assert means["on"] > means["off"] + 1.0, means


def test_chain_is_a_deterministic_function_of_the_committed_context():
    """Lossless sampling with vLLM's one-hot q needs the draft to depend only on the committed
    context: two fresh steps fed the same history and draft logits return the same chains."""
    vocab, k = 64, 3
    target = _bigram(vocab, 7)
    res = []
    for _ in range(2):
        step = ChainStep(GraftConfig(num_draft_tokens=10, topk=3, depth=k), vocab)
        b = _Batch()
        b.set({"x": ([1, 2, 3, 1, 2], [3, 1]), "y": ([4, 4, 4], [])})
        step.begin()
        cur = torch.tensor([s[-1] for s in b.seqs])
        for _ in range(k):
            cur = step.record(target[cur])
        res.append(b.finish(step, k))
    assert res[0] == res[1]


def test_finish_refuses_missing_draft_passes():
    step = ChainStep(GraftConfig(num_draft_tokens=6, topk=2, depth=3), 32)
    b = _Batch()
    b.set({"a": ([1, 2], [])})
    step.begin()
    step.record(torch.randn(1, 32))
    with pytest.raises(RuntimeError, match="1 draft passes recorded, need 3"):
        b.finish(step, 3)


def _tree(tokens, parents):
    from graft_spec.sources import SOURCE_DRAFT
    from graft_spec.tree import DraftTree

    t = torch.tensor([tokens])
    return DraftTree(t, torch.tensor([parents]), torch.zeros(1, len(tokens)), torch.full_like(t, SOURCE_DRAFT))


def test_nodes_below_a_rejected_node_are_known_misses():
    """Issue 45 (c): a node deeper than the committed tokens is a known miss when an ancestor within
    them was rejected; it stays unknown only when its whole committed-depth path matches."""
    from graft_spec.pipeline import on_path_from_tokens

    #        root -> 5 (1) -> 6 (2) -> 7 (3);  root -> 9 (4) -> 10 (5)
    tree = _tree([0, 5, 6, 7, 9, 10], [-1, 0, 1, 2, 0, 4])
    on, known = on_path_from_tokens(tree, torch.tensor([[5, 8]]), torch.tensor([2]))
    assert on[0].tolist() == [True, True, False, False, False, False]
    assert known[0].tolist() == [True] * 6            # 7 sits below the rejected 6, 10 below the rejected 9
    on, known = on_path_from_tokens(tree, torch.tensor([[5, 6]]), torch.tensor([2]))
    assert on[0].tolist() == [True, True, True, False, False, False]
    assert known[0].tolist() == [True, True, True, False, True, True]   # 7: its path matched, fate unseen
    on, known = on_path_from_tokens(tree, torch.tensor([[0, 0]]), torch.tensor([0]))   # row not verified
    assert on[0].tolist() == [True] + [False] * 5 and known[0].tolist() == [True] + [False] * 5


def test_chains_never_hold_nodes_deeper_than_k():
    """Issue 45 (e): retrieved chains (lookup, suffix) run N - 1 deep; a chain engine verifies K."""
    from graft_spec.kernels.views import Candidates
    from graft_spec.chain import cap_depth
    from graft_spec.tree import node_depths

    vocab, k = 64, 2
    step = ChainStep(GraftConfig(num_draft_tokens=12, topk=3, depth=k), vocab)
    cyc = [3, 9, 14, 20, 27, 33]
    target = _cycle_target(vocab, cyc, 0)
    _decode(step, target, _bigram(vocab, 5), {"r": cyc * 4}, k, new_tokens=12)
    assert int(node_depths(step.last_tree.parents).max()) <= k
    # cap_depth itself: a 4-deep chain part keeps its first K nodes
    par = torch.tensor([[-1, 0, 1, 2]])
    tok, est = torch.tensor([[1, 2, 3, 4]]), torch.full((1, 4), 0.5)
    zeros = torch.zeros(1, 4, dtype=torch.int64)
    (c,) = cap_depth([Candidates(tok, par, est, torch.ones(1, 4, dtype=torch.bool), zeros, zeros)], 2)
    assert c.valid[0].tolist() == [True, True, False, False] and c.est[0].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert c.bins[0].tolist() == [0, 0, -1, -1]


def test_sampled_rows_are_built_and_started_as_sampled_and_observed_through_the_planner(monkeypatch):
    """Issue 45 (b) and (e): vLLM's sampled requests reach the core as sampled (its bins, its output
    index rule), and every step's tree goes back through `GraftPlanner.observe` (calibration and the
    per-request correction), not the calibrator alone."""
    vocab, k = 64, 2
    step = ChainStep(GraftConfig(num_draft_tokens=7, topk=2, depth=k), vocab)
    planner = step.planner
    seen = {"sampled": [], "observe": 0, "begin": []}
    build, observe, begin = step_module.build_chains, planner.observe, planner.start_request

    def build_spy(*a, **kw):
        seen["sampled"].append(a[6].tolist())
        return build(*a, **kw)

    def observe_spy(*a, **kw):
        seen["observe"] += 1
        return observe(*a, **kw)

    def begin_spy(rid, prompt, tenant=None, sampled=False):
        seen["begin"].append((rid, sampled))
        return begin(rid, prompt, tenant=tenant, sampled=sampled)

    monkeypatch.setattr(step_module, "build_chains", build_spy)
    planner.observe, planner.start_request = observe_spy, begin_spy
    target = _bigram(vocab, 3)
    b = _Batch()
    outs = {"g": [], "s": []}
    prompts = {"g": [1, 2, 3], "s": [4, 5]}
    for _ in range(3):
        b.set({r: (prompts[r], outs[r]) for r in prompts})
        step.begin()
        cur = torch.tensor([s[-1] for s in b.seqs])
        for _ in range(k):
            cur = step.record(target[cur])
        chains = step.finish(cur * 0 + torch.tensor([s[-1] for s in b.seqs]), b.req_ids, b.token_ids_cpu[:2],
                             b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2], k, sampled=[False, True])
        for r, s, ch in zip(prompts, b.seqs, chains):
            outs[r].extend(_greedy_chain_verify(target, s[-1], ch))
    assert seen["begin"] == [("g", False), ("s", True)]
    assert seen["sampled"] == [[False, True]] * 3
    assert seen["observe"] == 2                       # steps 2 and 3 observe steps 1 and 2


def test_per_source_acceptance_is_logged(caplog):
    vocab, k = 64, 2
    step = ChainStep(GraftConfig(num_draft_tokens=7, topk=2, depth=k), vocab)
    step.log_every = 3
    target = _bigram(vocab, 4)
    with caplog.at_level("INFO", logger="vllm.graft"):
        _decode(step, target, target, {"a": [1, 2, 3]}, k, new_tokens=12)
    lines = [r.getMessage() for r in caplog.records if "acceptance by source" in r.getMessage()]
    assert lines and "draft" in lines[0]
    assert step.log_sources()["calibration"]["draft"]["trials"] > 0


def _decode_trees(step: ChainStep, target: torch.Tensor, drafter: torch.Tensor, prompts: dict[str, list[int]],
                  k: int, new_tokens: int, chain_rows=None, report: bool = False, scheduled: int = 0):
    """`_decode` for tree mode: the proposed nodes verified as trees (`tree_verify.verify_trees`, vLLM's
    layout: every node's logits are the bigram target's row of its token). ``scheduled`` > 0 cuts
    each tree to its first nodes (vLLM scheduling a prefix); ``report`` hands the verdict to
    `ChainStep.verified` as tree_runner.py does."""
    from vllm_worker.tree_verify import StepTrees, verify_trees

    batch = _Batch()
    outs = {r: [] for r in prompts}
    accepted, shapes = [], []
    active = list(prompts)
    while active:
        active = [r for r in active if len(outs[r]) < new_tokens]
        if not active:
            break
        batch.set({r: (prompts[r], outs[r]) for r in active})
        step.begin()
        cur = torch.tensor([s[-1] for s in batch.seqs])
        for _ in range(k):
            cur = step.record(drafter[cur])
        b = len(active)
        roots = torch.tensor([s[-1] for s in batch.seqs])
        drafts = step.finish(roots, batch.req_ids, batch.token_ids_cpu[:b], batch.num_prompt_tokens[:b],
                             batch.num_tokens_no_spec[:b], k, chain_rows=chain_rows)
        proposed = [step.proposed_tree(r) for r in active]
        assert all(t == d for (t, _), d in zip(proposed, drafts))
        if scheduled:
            drafts = [d[:scheduled] for d in drafts]
        parents = [p[: len(d) + 1] for (_, p), d in zip(proposed, drafts)]
        shapes.append([(len(d), p) for d, p in zip(drafts, parents)])
        w = max(len(d) for d in drafts) + 1
        par = torch.full((b, w), -1, dtype=torch.int64)
        for i, p in enumerate(parents):
            par[i, : len(p)] = torch.tensor(p)
        toks = [[int(roots[i])] + d for i, d in enumerate(drafts)]
        logits = torch.cat([target[torch.tensor(t)] for t in toks])
        v = verify_trees(logits, torch.tensor(sum(drafts, [])), StepTrees(par, torch.tensor([len(t) for t in toks])),
                         temperature=None, all_greedy=True, topk=step.planner.successor_k)
        if report:
            step.verified(active, dict(enumerate(parents)), v)
        for i, r in enumerate(active):
            emitted = [x for x in v.output_token_ids[i].tolist() if x >= 0]
            accepted.append(len(emitted))
            outs[r].extend(emitted)
    return outs, accepted, shapes


def test_tree_mode_proposes_parents_first_trees_spine_first_and_stays_lossless():
    """Tree mode: N - 1 nodes per request whose parents come first and whose first nodes are a chain
    (the spine a chain verifier takes); verified as trees, greedy output equals plain decoding and
    more is accepted per step than with the best chain; a row asked for a chain gets its spine."""
    vocab, k = 128, 4
    cycle = [9, 33, 71, 2, 55, 18, 90]
    target = _cycle_target(vocab, cycle, 5)
    drafter = _bigram(vocab, 7) * 0.3 + target
    prompts = {"a": cycle * 2 + cycle[:3], "b": [3, 4, 5, 6]}
    cfg = GraftConfig(num_draft_tokens=16, topk=3, depth=k)
    outs, accepted, shapes = _decode_trees(ChainStep(cfg, vocab, trees=True), target, drafter, prompts, k, 30)
    for r, p in prompts.items():
        assert outs[r][:30] == _greedy_reference(target, p, 30)
    trees = 0
    for step_shapes in shapes:
        for n, parents in step_shapes:
            assert n == 15 and len(parents) == 16 and parents[0] == -1
            assert all(0 <= parents[j] < j for j in range(1, 16))
            assert parents[1] == 0                                   # the spine starts at the root
            trees += any(parents[j] != j - 1 for j in range(1, 16))
    assert trees > 0
    _, chain_acc, _ = _decode(ChainStep(cfg, vocab), target, drafter, prompts, k, new_tokens=30)
    assert np.mean(accepted) > np.mean(chain_acc), (np.mean(accepted), np.mean(chain_acc))
    # a row that must verify as a chain is proposed its spine, with chain parents
    outs_c, _, shapes_c = _decode_trees(ChainStep(cfg, vocab, trees=True), target, drafter, prompts, k, 12,
                                        chain_rows={0})
    assert outs_c["a"][:12] == _greedy_reference(target, prompts["a"], 12)
    for step_shapes in shapes_c:
        n, parents = step_shapes[0]
        assert parents == list(range(-1, n)) and 1 <= n <= 15


def _verified_nodes(step: ChainStep) -> int:
    """Nodes the calibration counted as verified (per-depth trials, every member source at once)."""
    return sum(d["verified"] for d in step.stats.summary()["acceptance_by_depth"].values())


def test_tree_outcome_feeds_the_calibration_and_the_successor_table_as_in_sglang():
    """With the verdict reported (`ChainStep.verified`), only verified nodes count as trials (a tree
    cut to its first 5 nodes adds at most 5 per row and step), and the successor table holds the
    target's whole top-k after verified nodes (from committed tokens alone it holds top-1 rows)."""
    vocab, k = 128, 4
    cycle = [9, 33, 71, 2, 55, 18, 90]
    target = _cycle_target(vocab, cycle, 5)
    drafter = _bigram(vocab, 7) * 0.3 + target
    prompts = {"a": cycle * 2 + cycle[:3], "b": [3, 4, 5, 6]}
    cfg = GraftConfig(num_draft_tokens=16, topk=3, depth=k)
    runs = {}
    for report in (False, True):
        step = ChainStep(cfg, vocab, trees=True)
        outs, accepted, _ = _decode_trees(step, target, drafter, prompts, k, 30, report=report, scheduled=5)
        for r, p in prompts.items():
            assert outs[r][:30] == _greedy_reference(target, p, 30)
        runs[report] = (step, len(accepted))
    step, row_steps = runs[True]
    assert 0 < _verified_nodes(step) <= 5 * row_steps
    assert _verified_nodes(runs[False][0]) > 5 * row_steps   # without it unverified nodes count as misses
    sk = step.planner.successor_k
    table = step.planner.successor.table
    assert (runs[False][0].planner.successor.table[:, 1:] == -1).all()
    full = (table >= 0).all(1).nonzero().flatten()
    assert full.numel() > 0
    rows = step.planner.successor.rows
    for r in full.tolist():
        tok = r % (rows + 2)
        assert table[r].tolist() == target[tok].topk(sk).indices.tolist()
