"""GraftStep / RequestTracker: the proposer's per-step logic driven by a fake target on CPU.

The fake target is a bigram model; the fake EAGLE loop calls `GraftStep.record` K times
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
from vllm_worker.requests import RequestTracker
from vllm_worker.step import GraftStep


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

    def finish(self, step: GraftStep, k: int) -> list[list[int]]:
        b = len(self.req_ids)
        roots = torch.tensor([s[-1] for s in self.seqs])
        return step.finish(roots, self.req_ids, self.token_ids_cpu[:b], self.num_prompt_tokens[:b],
                           self.num_tokens_no_spec[:b], k)


class _RecordingPlanner:
    def __init__(self):
        self.calls: list[tuple] = []
        self.device = torch.device("cpu")
        self.successor = self   # records successor-table updates as ("observe", [(t, u), ...])

    def start_request(self, rid, prompt):
        self.calls.append(("start", rid, list(prompt)))

    def extend(self, rid, toks):
        self.calls.append(("extend", rid, list(toks)))

    def stop_request(self, rid):
        self.calls.append(("stop", rid))

    def update(self, t, u, valid, groups=0):
        self.calls.append(("observe", list(zip(t[valid].tolist(), u[valid][:, 0].tolist()))))

    def warm_start(self, prev, nxt, valid, groups=0):
        self.calls.append(("warm", list(zip(prev[valid].tolist(), nxt[valid].tolist()))))

    def group_of(self, rid):
        return 0


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


def _decode(step: GraftStep, target: torch.Tensor, drafter: torch.Tensor, prompts: dict[str, list[int]],
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
    tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2])
    assert rec.calls == [("start", "a", [1, 2, 3]), ("start", "b", [7, 8]), ("extend", "b", [9]),
                         ("warm", [(1, 2), (2, 3)]), ("warm", [(7, 8)]), ("observe", [(8, 9)])]
    assert "a" in tr and "b" in tr and len(tr) == 2
    rec.calls.clear()
    b.set({"a": ([1, 2, 3], [4, 5]), "c": ([6], [])})           # b left, c joined
    tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2])
    assert rec.calls == [("stop", "b"), ("extend", "a", [4, 5]), ("start", "c", [6]),
                         ("observe", [(3, 4), (4, 5)])]
    assert "b" not in tr and len(tr) == 2
    rec.calls.clear()
    tr.sync(b.req_ids, b.token_ids_cpu[:2], b.num_prompt_tokens[:2], b.num_tokens_no_spec[:2])
    assert rec.calls == []                                     # nothing new: nothing fed twice
    tr.stop_all()
    assert sorted(rec.calls) == [("stop", "a"), ("stop", "c")] and len(tr) == 0


def test_retrieval_state_created_and_freed_per_request_id_in_real_sources():
    vocab, k = 64, 3
    step = GraftStep(GraftConfig(num_draft_tokens=10, topk=2, depth=k), vocab)
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
    outs, accepted, _ = _decode(GraftStep(cfg, vocab), target, target, prompts, k, new_tokens=30)
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
        outs, accepted, _ = _decode(GraftStep(GraftConfig(**base, retrieval=retrieval), vocab),
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
        step = GraftStep(GraftConfig(num_draft_tokens=10, topk=3, depth=k), vocab)
        b = _Batch()
        b.set({"x": ([1, 2, 3, 1, 2], [3, 1]), "y": ([4, 4, 4], [])})
        step.begin()
        cur = torch.tensor([s[-1] for s in b.seqs])
        for _ in range(k):
            cur = step.record(target[cur])
        res.append(b.finish(step, k))
    assert res[0] == res[1]


def test_finish_refuses_missing_draft_passes():
    step = GraftStep(GraftConfig(num_draft_tokens=6, topk=2, depth=3), 32)
    b = _Batch()
    b.set({"a": ([1, 2], [])})
    step.begin()
    step.record(torch.randn(1, 32))
    with pytest.raises(RuntimeError, match="1 draft passes recorded, need 3"):
        b.finish(step, 3)
