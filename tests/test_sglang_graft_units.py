"""Graft-in-SGLang pieces that need no server: registration, settings, tensor translation.

The layout test compares our verify tensors with SGLang's own Triton tree builder
(``spec_tree.py:52``, run by the Triton interpreter on CPU in a subprocess) for EAGLE trees.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

ROOT = Path(__file__).resolve().parents[1]
MODEL_ARGS = ["--model-path", "/nonexistent-model", "--speculative-draft-model-path", "/nonexistent-draft"]


@pytest.fixture(scope="module")
def sglang_plugins():
    """SGLang with our plugin loaded and its hooks applied (as every SGLang process does)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args


# ------------------------------------------------------------------ registration
def test_graft_is_registered_with_eagle3_behaviour(sglang_plugins):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_patch.registration import register_graft
    from sglang_patch.spec_algo import GraftSpec

    register_graft()  # idempotent: a second call in the same process must not raise
    algo = SpeculativeAlgorithm.from_string("graft")
    assert isinstance(algo, GraftSpec)
    assert algo is SpeculativeAlgorithm.from_string("GRAFT")
    assert algo.is_eagle() and algo.is_eagle3() and algo.need_topk()
    assert algo.carries_draft_hidden_states() and algo.has_draft_kv()
    assert not algo.is_ngram() and not algo.supports_mixed_chunk()
    # The scheduler calls these unconditionally (scheduler.py:1540,1681).
    for name in ("create_future_map", "carries_draft_hidden_states", "need_topk"):
        assert callable(getattr(algo, name))


def test_create_worker_accepts_the_overlap_scheduler(sglang_plugins):
    """Graft registers with supports_overlap=True and builds its worker with overlap on or off."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    assert get_spec("GRAFT").supports_overlap is True
    for extra in ([], ["--disable-overlap-schedule"]):
        sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", *extra])
        assert SpeculativeAlgorithm.from_string("graft").create_worker(sa).__name__ == "GraftWorker"


# ------------------------------------------------------------------ settings
def test_cli_flags_reach_the_record_and_survive_pickling(sglang_plugins):
    sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--graft-budget", "12",
                         "--graft-retrieval", "suffix", "--graft-retrieval-suffix-max-depth", "12",
                         "--graft-checkpoints", "[{depth: 1, threshold: 0.4, keep: 4}]"])
    assert sa._graft_cli["num_draft_tokens"] == 12
    assert sa._graft_cli["retrieval.successor"] is False and sa._graft_cli["retrieval.suffix"] is True
    clone = pickle.loads(pickle.dumps(sa))
    assert clone._graft_cli == sa._graft_cli

    from sglang_patch.args import build_graft_config

    cfg = build_graft_config(clone._graft_cli, environ={})
    assert cfg.num_draft_tokens == 12 and cfg.retrieval.suffix_max_depth == 12
    assert not cfg.retrieval.successor and cfg.checkpoints[0].keep == 4


@pytest.mark.parametrize("argv, field", [
    (["--graft-budget", "1"], "num_draft_tokens"),
    (["--graft-topk", "1"], "topk"),
    (["--graft-checkpoints", "[{depth: 1, threshold: 1.5, keep: 4}]"], "checkpoints.0.threshold"),
    (["--graft-checkpoints", "[{depth: 1, threshold: 0.0, keep: 4}]"], "checkpoints.0.threshold"),
    (["--graft-retrieval-successor-prior", "1.0"], "retrieval.successor_prior"),
])
def test_bad_cli_value_fails_launch_naming_the_field(sglang_plugins, argv, field):
    from sglang_patch.args import GraftSettingsError

    with pytest.raises(GraftSettingsError) as err:
        sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", *argv])
    assert field in str(err.value) and argv[0] in str(err.value)


def test_unknown_field_in_file_and_env(tmp_path):
    from sglang_patch.args import GraftSettingsError, build_graft_config

    bad = tmp_path / "graft.yaml"
    bad.write_text("num_draft_tokens: 16\nbudgett: 3\n")
    with pytest.raises(GraftSettingsError, match="budgett.*config file"):
        build_graft_config({"config": str(bad)}, environ={})
    with pytest.raises(GraftSettingsError, match="retrieval.sufix.*GRAFTCFG_RETRIEVAL__SUFIX"):
        build_graft_config({}, environ={"GRAFTCFG_RETRIEVAL__SUFIX": "true"})
    # Tooling variables sharing the prefix are not config fields and must not break the launch.
    cfg = build_graft_config({}, environ={"GRAFT_VENV": "/x", "GRAFT_SGLANG_CPU_LAYER": "1"})
    assert cfg.num_draft_tokens >= 2


def test_precedence_file_env_cli(tmp_path):
    from sglang_patch.args import build_graft_config

    f = tmp_path / "graft.json"
    f.write_text(json.dumps({"num_draft_tokens": 20, "topk": 3, "depth": 5}))
    env = {"GRAFT_CONFIG": str(f), "GRAFTCFG_TOPK": "5"}
    cfg = build_graft_config({"depth": 4}, environ=env)
    assert (cfg.num_draft_tokens, cfg.topk, cfg.depth) == (20, 5, 4)


def _declared(sa, environ):
    """Run GraftSpec.handle_server_args the way SGLang does (record_foreign_defaults stand-in)."""
    from sglang.srt.arg_groups.overrides import record_foreign_defaults, resolving_view

    from sglang_patch.args import apply_graft_server_defaults

    record_foreign_defaults(sa, "test", lambda s: apply_graft_server_defaults(s, environ=environ))
    return resolving_view(sa)


def test_server_defaults_are_declared(sglang_plugins):
    sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--graft-budget", "10",
                         "--enable-mixed-chunk"])
    view = _declared(sa, environ={"GRAFTCFG_TOPK": "3", "GRAFTCFG_DEPTH": "3"})
    assert view.speculative_num_draft_tokens == 10
    assert view.speculative_eagle_topk == 3 and view.speculative_num_steps == 3
    assert view.max_running_requests == 48
    assert view.enable_mixed_chunk is False
    # the overlap scheduler stays SGLang's default (on)
    assert view.disable_overlap_schedule is False


@pytest.mark.parametrize("opt_in", ["", "1"])
@pytest.mark.parametrize("flag, disabled", [([], False), (["--disable-overlap-schedule"], True)])
def test_overlap_on_cpu_is_sglang_default_for_graft(sglang_plugins, monkeypatch, opt_in, flag, disabled):
    """On CPU graft keeps the overlap scheduler (the GPU path) whatever the EAGLE / NGRAM opt-in says;
    ``--disable-overlap-schedule`` still turns it off."""
    monkeypatch.setenv("GRAFT_SGLANG_CPU_OVERLAP", opt_in)
    sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--device", "cpu", *flag])
    assert _declared(sa, environ={}).disable_overlap_schedule is disabled


def test_sglang_shape_flags_win_and_conflicts_are_errors(sglang_plugins):
    from sglang_patch.args import GraftSettingsError

    sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--speculative-num-steps", "3",
                         "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "7"])
    view = _declared(sa, environ={})
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (3, 2, 7)
    with pytest.raises(GraftSettingsError, match="num_draft_tokens = 9.*speculative-num-draft-tokens = 7"):
        # raised while the CLI is parsed (ServerArgs.from_cli_args hook), before any resolution
        sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--speculative-num-draft-tokens", "7",
                        "--graft-budget", "9"])


def test_checkpoints_validated_against_the_sglang_shape(sglang_plugins):
    """A config deeper than GraftConfig's default depth is valid when SGLang's --speculative-num-steps allows it."""
    sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--speculative-num-steps", "7",
                         "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "24",
                         "--graft-checkpoints", "[{depth: 6, threshold: 0.2, keep: 8}]"])
    from sglang_patch.args import effective_graft_config

    cfg = effective_graft_config(sa, environ={})
    assert (cfg.depth, cfg.topk, cfg.num_draft_tokens) == (7, 4, 24) and cfg.checkpoints[0].depth == 6


def test_topk1_missing_draft_and_unfillable_budget_are_errors(sglang_plugins):
    from sglang_patch.args import GraftSettingsError

    # Shape errors surface while the CLI is parsed, the others when the server args are resolved.
    with pytest.raises(GraftSettingsError, match="topk = 1"):
        _declared(sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--speculative-eagle-topk", "1"]),
                  environ={})
    with pytest.raises(GraftSettingsError, match="--speculative-draft-model-path"):
        _declared(sglang_plugins(["--model-path", "/nonexistent-model", "--speculative-algorithm", "graft"]),
                  environ={})
    with pytest.raises(GraftSettingsError, match="num_draft_tokens"):
        _declared(sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--speculative-num-steps", "2",
                                  "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "9"]),
                  environ={})


# ------------------------------------------------------------------ tensor translation
def test_verify_layout_matches_sglang_triton_tree_builder():
    """For pure EAGLE trees our verify tensors equal SGLang's (both mask layouts)."""
    script = textwrap.dedent(
        """
        import os, torch
        os.environ["TRITON_INTERPRET"] = "1"
        from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, TreeMaskMode
        from sglang.srt.speculative.eagle_utils import organize_draft_results
        from graft_spec.step import StepOutput
        from graft_spec.tree import eagle_rerank
        from sglang_patch.graft_info import build_graft_verify_input
        for seed, (topk, steps, n) in enumerate([(3, 3, 8), (2, 4, 10), (4, 2, 6)]):
            torch.manual_seed(seed)
            bs = 3
            p0 = torch.rand(bs, topk).sort(descending=True).values
            sl, tl, pl = [p0.unsqueeze(1)], [torch.randint(0, 50, (bs, topk))], [torch.arange(-1, topk).expand(bs, -1)]
            scores = p0
            for i in range(1, steps):
                pt = torch.rand(bs, topk, topk).sort(dim=-1, descending=True).values * 0.9
                ex = scores.unsqueeze(2) * pt
                bp, bi = torch.topk(ex.flatten(1), topk)
                sl.append(ex); tl.append(torch.randint(0, 50, (bs, topk * topk))); pl.append(bi + topk * topk * (i - 1) + topk)
                scores = bp
            parent_list, tsi, dt = organize_draft_results(sl, tl, pl, n)
            seq = torch.tensor([5, 9, 1])
            roots = torch.tensor([7, 11, 3])
            tree = eagle_rerank(sl, tl, pl, root_tokens=roots, num_nodes=n)
            out = StepOutput.from_tree(tree, seq)
            for mode in (TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK):
                numel = bs * n * n if mode == TreeMaskMode.QLEN_ONLY else int((n * (seq + n)).sum())
                mask = torch.ones(numel, dtype=torch.bool)
                pos = torch.empty(bs * n, dtype=torch.long)
                rb = torch.full((3, bs, n), -1, dtype=torch.long)
                sgl_build_tree_kernel_triton(parent_list, tsi, seq, mask, pos, rb[0], rb[1], rb[2], topk, steps, n, mode)
                vi = build_graft_verify_input(out, seq, mode=mode, topk=topk, steps=steps, full_mask_numel=numel)
                assert torch.equal(vi.custom_mask, mask), (seed, mode)
                assert torch.equal(vi.positions, pos), (seed, mode)
                assert torch.equal(vi.retrieve_index, rb[0]) and torch.equal(vi.retrieve_next_token, rb[1])
                assert torch.equal(vi.retrieve_next_sibling, rb[2])
                assert torch.equal(vi.draft_token.view(bs, n)[:, 1:], dt) and torch.equal(vi.draft_token.view(bs, n)[:, 0], roots)
                assert vi.max_tree_depth == n and vi.tree_topk == -1
        print("LAYOUT-OK")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert "LAYOUT-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_full_mask_into_preallocated_buffer_keeps_prefix_true():
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    from graft_spec.step import StepOutput
    from graft_spec.tree import DraftTree, ancestor_mask
    from sglang_patch.graft_info import build_graft_verify_input

    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 0]])
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    tree = DraftTree(tokens, parents, torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long))
    seq = torch.tensor([3, 2])
    buf = torch.zeros(200, dtype=torch.bool)
    vi = build_graft_verify_input(StepOutput.from_tree(tree, seq), seq, mode=TreeMaskMode.FULL_MASK, topk=2,
                                  steps=3, mask_buffer=buf)
    assert vi.custom_mask is buf
    anc = ancestor_mask(parents)
    off = 0
    for b, s in enumerate([3, 2]):
        rows = buf[off: off + 5 * (s + 5)].view(5, s + 5)
        assert rows[:, :s].all()
        assert torch.equal(rows[:, s:], anc[b])
        off += 5 * (s + 5)
    assert vi.positions.tolist() == [3, 4, 4, 5, 6, 2, 3, 4, 5, 3]


# ------------------------------------------------------------------ per-request state
def _req(rid, prompt, outputs):
    return SimpleNamespace(rid=rid, origin_input_ids=list(prompt), output_ids=list(outputs), customized_info=None)


def _planner(**retrieval):
    from graft_spec.config import GraftConfig
    from graft_spec.pipeline import GraftPlanner

    cfg = GraftConfig(num_draft_tokens=8, topk=2, depth=3, retrieval=retrieval or {})
    return GraftPlanner(cfg, vocab_size=64)


def _commit(index, tokens):
    from sglang.srt.managers.auxiliary_output import CommittedTokens

    return CommittedTokens(output_index=index, token_ids=tuple(tokens))


def test_tracker_lifecycle_meta_and_no_leak():
    from graft_spec.sources import NUM_SOURCES, SOURCE_DRAFT, SOURCE_SUFFIX
    from sglang_patch.graft_requests import META_KEY, GraftRequestTracker

    planner = _planner()
    tr = GraftRequestTracker(planner, return_sources=True)
    a, b = _req("a", [1, 2, 3, 4], [5]), _req("b", [9, 8], [7])
    assert tr.prepare([a, b]) == ["a", "b"]
    assert tr.live() == 2 and planner.live_requests() == 2 and planner.seen("a") == 5
    # round 1: a accepted a draft and a retrieved node, then the bonus; b only the bonus
    tr.record([a, b], [_commit(1, [6, 7, 8]), _commit(1, [1])],
              [[SOURCE_DRAFT, SOURCE_SUFFIX, -1], [-1, -1, -1]])
    assert a.customized_info[META_KEY] == ["t", "d", "x", "t"]   # the prefill token, then the round
    assert b.customized_info[META_KEY] == ["t", "t"]
    assert tr.states["a"].accepted == [1, 0, 1] + [0] * (NUM_SOURCES - 3)
    # the next round syncs only the new output tokens (host view), no restart
    a.output_ids += [6, 7, 8]
    tr.prepare([a])
    assert planner.seen("a") == 8 and tr.states["a"].rounds == 1
    # a request that finished mid-round: only its visible tokens get letters
    tr.record([a], [_commit(4, [9])], [[SOURCE_DRAFT, SOURCE_DRAFT, -1]])
    assert a.customized_info[META_KEY] == ["t", "d", "x", "t", "d"]
    tr.finish("a")
    tr.finish("b")
    tr.finish("never-started")
    assert tr.live() == 0 and planner.live_requests() == 0


def test_tracker_writes_no_sources_unless_enabled():
    """`GraftConfig.return_sources` off (the default): rounds are counted, no ``graft_src`` is written."""
    from graft_spec.sources import SOURCE_DRAFT
    from sglang_patch.graft_requests import META_KEY, GraftRequestTracker

    tr = GraftRequestTracker(_planner())
    a = _req("a", [1, 2, 3, 4], [5])
    tr.prepare([a])
    tr.record([a], [_commit(1, [6, 7])], [[SOURCE_DRAFT, -1]])
    assert tr.states["a"].rounds == 1 and META_KEY not in (getattr(a, "customized_info", None) or {})


def test_tracker_frees_requests_it_never_prepared():
    """A request that finished in its prefill, or decoded in plain rounds only, was never prepared:
    its finish still frees what its prefill gave it in the planner (its isolation group)."""
    import torch

    from sglang_patch.graft_requests import GraftRequestTracker

    planner = _planner()
    tr = GraftRequestTracker(planner)
    planner.ensure_slots(4)
    planner.prefill(["p"], torch.tensor([1]), [[1, 2, 3]], torch.tensor([4]), tenants=[("k", None)])
    assert planner.state_counts()["grouped"] == 1 and planner.state_counts()["keys_held"] == 1
    tr.finish("p")
    assert planner.state_counts() == {"grouped": 0, "host_sources": 0, "output_index": 0, "keys_held": 0}


def test_tracker_hands_the_final_output_to_the_output_index_at_finish():
    """Tokens committed after the last prepare (the last round; two under the overlap scheduler)
    reach the output index before the request's output is inserted."""
    from sglang_patch.graft_requests import GraftRequestTracker

    planner = _planner(outputs=True)
    tr = GraftRequestTracker(planner)
    a = _req("a", [1, 2, 3], [4])
    tr.prepare([a])
    a.output_ids += [5, 6, 7, 8]                 # committed by the last rounds, never prepared
    tr.finish("a")
    import torch

    hist = torch.tensor([[50, 60, 1, 2, 3, 4, 5]])             # a later request's context, on the device
    tokens, valid, _ = planner.outputs.propose(hist, torch.tensor([7]), torch.zeros(1, dtype=torch.int64))
    assert tokens[0, 0, :3].tolist() == [6, 7, 8] and valid[0].sum() == 3, (tokens, valid)


def test_tracker_frees_requests_that_finish_without_a_finish_notification():
    """SGLang notifies the worker of a finish only from decode-result processing; a request that
    finishes in its prefill is, under the overlap scheduler, already in the next decode batch and
    skipped by its result processing. The round's `record` frees it; `prepare` starts no state for a
    request that is already finished (CI saw one such entry left after a mixed batch)."""
    from sglang_patch.graft_requests import GraftRequestTracker

    planner = _planner(outputs=True)
    freed = []
    tr = GraftRequestTracker(planner, on_free=freed.append)
    done = {"a": False}
    a, b = _req("a", [1, 2, 3], [4]), _req("b", [5, 6], [7])
    a.finished, b.finished = (lambda: done["a"]), (lambda: False)
    assert tr.prepare([a, b]) == ["a", "b"] and tr.live() == 2   # a's prefill result not processed yet
    done["a"] = True                                             # ... now it is: a finished there
    tr.record([a, b], [None, _commit(1, [8])], [[-1], [-1]])
    assert "a" not in tr.states and tr.live() == 1 and planner.live_requests() == 1
    assert tr.finished_total == 1
    # the scheduler processed the prefill's result before launching the batch built with it
    assert tr.prepare([a, b]) == ["a", "b"] and "a" not in tr.states and planner.seen("a") == 0
    # a request that leaves the batches (retracted) and finishes there (aborted while waiting): no
    # notification, no round of its own; the next round's sweep frees it
    c, gone = _req("c", [3, 4], [5]), {"c": False}
    c.finished = lambda: gone["c"]
    tr.prepare([b, c])
    tr.prepare([b])
    assert "c" in tr.states                                      # retracted, not finished: kept
    gone["c"] = True
    tr.prepare([b])
    assert "c" not in tr.states and tr.live() == 1 and planner.live_requests() == 1
    assert freed == ["a", "c"]               # the worker's budget forgets each freed request with it


def test_tracker_resyncs_after_retraction_and_sweeps_stale_entries():
    from sglang_patch.graft_requests import GraftRequestTracker

    planner = _planner()
    tr = GraftRequestTracker(planner, stale_rounds=2)
    a = _req("a", [1, 2, 3], [4, 5])
    tr.prepare([a])
    assert "a" in tr.states and planner.seen("a") == 5
    # retracted: SGLang kept fewer outputs than the planner saw -> rebuilt from the request's tokens
    a.output_ids = [4]
    tr.prepare([a])
    assert planner.seen("a") == 4
    other = _req("b", [1], [2])
    for _ in range(4):
        tr.prepare([other])
    assert "a" not in tr.states and tr.live() == 1 and planner.live_requests() == 1


def test_after_verify_is_device_bookkeeping_and_host_output_records_sources():
    """SGLang-shaped verify outputs -> successor table, commit log and calibration on the device;
    the accepted sources travel as an auxiliary output that SGLang copies and consumes."""
    from graft_spec.sources import NUM_SOURCES, SOURCE_DRAFT, SOURCE_LOOKUP, SOURCE_PADDING, SOURCE_SUCCESSOR
    from graft_spec.tree import DraftTree
    from graft_spec.step import StepOutput
    from sglang_patch.graft_info import GraftVerifyInput
    from sglang_patch.graft_requests import META_KEY, GraftRequestTracker
    from sglang_patch.graft_worker import GraftWorker
    from graft_spec.stats import GraftStats

    bs, n, vocab = 2, 4, 64
    planner = _planner(successor_k=3)
    planner.ensure_slots(8)
    from graft_spec.budget import BatchBudget

    worker = object.__new__(GraftWorker)
    worker.budget = BatchBudget(planner.config.verify_widths)
    from sglang_patch.containment import RoundGuard

    worker.planner, worker.stats, worker.guard = planner, GraftStats(), RoundGuard()
    # as GraftWorker wires it
    worker.requests = GraftRequestTracker(planner, on_free=worker.budget.forget, return_sources=True)
    reqs = [_req("x", [1, 2], [10]), _req("y", [3], [20])]
    worker.requests.prepare(reqs)
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 0, 22]])
    parents = torch.tensor([[-1, 0, 0, 2], [-1, 0, 0, 1]])
    source = torch.tensor([[SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_SUCCESSOR, SOURCE_LOOKUP],
                           [SOURCE_DRAFT, SOURCE_SUCCESSOR, SOURCE_PADDING, SOURCE_DRAFT]])
    out = StepOutput.from_tree(DraftTree(tokens, parents, torch.zeros(bs, n), source), torch.tensor([2, 1]))
    out.member_bins[:, 1:, 0] = 5                                  # every real node: one draft bin
    out.member_bins[1, 2] = -1                                     # (not the padding)
    out.estimates = planner.calibrator.table
    out.gain = torch.tensor([[0.9, 1.5, 1.8], [0.2, 0.3, 0.3]])    # expected accepted nodes at widths 2..4
    vi = SimpleNamespace(graft_out=out)
    # Request x accepted nodes 0 -> 2 -> 3 (global 0, 2, 3) + bonus 44; y accepted nothing, bonus 55.
    accept_index = torch.tensor([[0, 2, 3, -1], [4, -1, -1, -1]], dtype=torch.int32)
    accept_lens = torch.tensor([3, 1], dtype=torch.int32)
    predict = torch.tensor([12, 13, 44, 0, 55, 0, 0, 0], dtype=torch.int32)  # compacted to the front
    logits = torch.zeros(bs * n, vocab)
    logits[torch.arange(bs * n), torch.arange(bs * n) + 30] = 5.0  # top-1 after node i is 30 + i
    result = SimpleNamespace(accept_index=accept_index, accept_lens=accept_lens, next_token_ids=predict,
                             logits_output=SimpleNamespace(next_token_logits=logits, auxiliary_device_output=None))
    batch = SimpleNamespace(reqs=reqs, req_pool_indices=torch.tensor([3, 5]))
    worker._after_verify(batch, vi, result)
    table = planner.successor.table
    assert table[11, 0].item() == 31 and table[22, 0].item() == 37  # non-padding rows updated
    assert table[0, 0].item() != 36  # the padding node's row (token 0) was not overwritten
    assert planner.history.tokens[3, -3:].tolist() == [12, 13, 44] and planner.history.count[[3, 5]].tolist() == [3, 1]
    assert planner.calibrator.trials[5].item() == 5 and planner.calibrator.hits[5].item() == 2
    host = result.logits_output.auxiliary_device_output.copy_to_host(lambda t: t.clone())
    host.consume(batch, [_commit(1, [12, 13, 44]), _commit(1, [55])])
    assert reqs[0].customized_info[META_KEY] == ["t", "s", "l", "t"]
    assert reqs[1].customized_info[META_KEY] == ["t", "t"]
    want = [0] * NUM_SOURCES
    want[SOURCE_SUCCESSOR] = want[SOURCE_LOOKUP] = 1
    assert worker.requests.states["x"].accepted == want
    summary = worker.stats.summary()
    assert summary["accepted_tokens"] == {"draft": 0, "successor": 1, "suffix": 0, "corpus": 0, "lookup": 1,
                                          "outputs": 0, "agree": 0, "padding": 0, "bonus": 2}
    assert summary["accept_length_hist"] == {3: 1, 1: 1}
    assert summary["calibration"]["draft"]["trials"] == 5
    assert summary["calibration"]["draft"]["observed"] == pytest.approx(2 / 5)
    assert summary["acceptance_by_depth"][1] == {"verified": 3, "observed": pytest.approx(1 / 3)}
    # the batch budget got each request's expected accept length per width (from the gain curve)
    widths = planner.config.verify_widths
    curve = dict(zip(widths, worker.budget._curve["x"]))
    assert curve[1] == 1.0 and curve[max(widths)] == pytest.approx(1.0 + 1.8)
    assert worker.budget._observed > 0 and worker.budget._predicted > 0
    # a request finished by this round (its finish notification came first, or never came): the
    # tracker and the batch budget hold nothing for it after the round's host output is consumed
    reqs[0].finished = lambda: True
    host.consume(batch, [None, None])
    assert "x" not in worker.requests.states and "x" not in worker.budget._curve
    assert "y" in worker.requests.states and "y" in worker.budget._curve


def test_graft_stats_mirror_to_prometheus(tmp_path, monkeypatch):
    """With metrics on, the same figures land in prometheus_client's multiprocess files that
    SGLang's /metrics endpoint aggregates."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    code = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        from graft_spec.stats import GraftStats
        s = GraftStats(prometheus=True)
        s.record_round([[0, 1, -1], [-1, -1, -1]], [[[3, 1.5, 1], [0, 0, 0], [2, 1.2, 1], [0, 0, 0]],
                                                    [[0, 0, 0]] * 4], [[[0, 0], [4, 2], [1, 0]], [[0, 0]] * 3])
        s.count_draft_forward(True); s.count_draft_forward(False)
        s.record_width(12, 3); s.record_width(1, 5)
        reg = CollectorRegistry(); multiprocess.MultiProcessCollector(reg)
        print(generate_latest(reg).decode())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path)))
    text = out.stdout
    assert 'graft:accepted_tokens_total{source="successor"} 1.0' in text, out.stderr[-2000:]
    assert 'graft:accepted_tokens_total{source="bonus"} 2.0' in text
    assert 'graft:accept_length_bucket{le="3.0"} 2.0' in text
    assert 'graft:calibration_hits_total{member="suffix"} 1.0' in text
    assert 'graft:accepted_nodes_total{depth="1"} 2.0' in text
    assert 'graft:draft_forwards_total{outcome="skipped"} 1.0' in text
    assert 'graft:verify_rounds_total{width="12"} 1.0' in text
    assert "graft:batch_verify_tokens 5.0" in text and "graft:verify_width 1.0" in text


# ------------------------------------------------------------------ ranks: one config, refusals
def test_config_is_snapshotted_at_launch_and_shipped_to_every_rank(sglang_plugins, tmp_path, monkeypatch):
    """The launcher reads the config file and GRAFTCFG_* once; a scheduler (any rank, any node)
    rebuilds the same config from the pickled record even when its own file and environment differ."""
    from sglang_patch.args import SNAPSHOT, effective_graft_config

    f = tmp_path / "g.yaml"
    f.write_text("retrieval: {suffix_max_depth: 40}\n")
    monkeypatch.setenv("GRAFTCFG_RETRIEVAL__SUCCESSOR_K", "5")
    sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", "--graft-config", str(f)])
    assert sa._graft_cli[SNAPSHOT]["file_data"] == {"retrieval": {"suffix_max_depth": 40}}
    clone = pickle.loads(pickle.dumps(sa))
    f.write_text("retrieval: {suffix_max_depth: 8}\n")                 # another node's file
    monkeypatch.setenv("GRAFTCFG_RETRIEVAL__SUCCESSOR_K", "2")         # another node's environment
    cfg = effective_graft_config(clone)
    assert cfg.retrieval.suffix_max_depth == 40 and cfg.retrieval.successor_k == 5


@pytest.mark.parametrize("argv, message", [
    (["--speculative-accept-threshold-single", "0.9"], "speculative-accept-threshold-single"),
    (["--speculative-accept-threshold-acc", "0.5"], "speculative-accept-threshold-acc"),
    (["--attention-backend", "trtllm_mha"], "trtllm_mha"),
    (["--page-size", "4", "--attention-backend", "torch_native"], "page-size 4"),
])
def test_combinations_that_cannot_verify_trees_losslessly_are_refused(sglang_plugins, argv, message):
    from sglang_patch.args import GraftSettingsError

    sa = sglang_plugins([*MODEL_ARGS, "--speculative-algorithm", "graft", *argv])
    with pytest.raises(GraftSettingsError, match=message):
        _declared(sa, environ={})


def test_dp_attention_is_refused_naming_the_flag():
    from sglang_patch.args import GraftSettingsError, refuse_unsafe_combinations

    with pytest.raises(GraftSettingsError, match="--enable-dp-attention"):
        refuse_unsafe_combinations(SimpleNamespace(enable_dp_attention=True))
    refuse_unsafe_combinations(SimpleNamespace(attention_backend="fa3", page_size=16))   # allowed


_BIND_ERROR = ("import sys, time; print('ERROR: [Errno 98] error while attempting to bind on address "
               "(127.0.0.1, %s): address already in use' % sys.argv[1], flush=True); time.sleep(120)")
_HEALTHY = ("import http.server, sys\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers()\n"
            "    def log_message(self, *a):\n"
            "        pass\n"
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def test_server_start_retries_a_taken_port(tmp_path):
    """uvicorn's "address already in use" (the process then hangs) makes the launcher pick another
    port instead of waiting out the startup timeout; an explicit port is never changed."""
    from sglang_patch.launcher import SGLangServer, ServerStartError, free_port

    class Fake(SGLangServer):
        def __init__(self, fail_times: int, **kw):
            super().__init__(model_path="unused", startup_timeout_s=30, **kw)
            self.fail_times, self.ports = fail_times, []

        def command(self):
            self.ports.append(self.port)
            script = _BIND_ERROR if len(self.ports) <= self.fail_times else _HEALTHY
            return [sys.executable, "-c", script, str(self.port)]

    srv = Fake(1, log_path=str(tmp_path / "a.log"))
    try:
        assert srv.start() is srv and len(set(srv.ports)) == 2
    finally:
        srv.stop()
    srv = Fake(5, log_path=str(tmp_path / "b.log"))
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="already in use"):
        srv.start()
    assert len(srv.ports) == 3 and time.monotonic() - t0 < 25
    srv = Fake(5, log_path=str(tmp_path / "c.log"), port=free_port())
    with pytest.raises(ServerStartError, match=r"\(1 tries\)"):
        srv.start()
    assert len(set(srv.ports)) == 1


def test_deferred_draft_extend_plans_catch_ups_on_the_host():
    from sglang_patch.deferred_draft import DeferredDraftExtend

    d = DeferredDraftExtend(width=3, device="cpu")
    assert d.plan(["a", "b"], 1) is None                    # plain rounds: nothing waits yet
    assert d.plan(["a", "b"], 1) is None and d.pending == {"a": 2, "b": 2}
    assert d.plan(["a", "b", "c"], 12) == [2, 2, 0]          # a drafting round catches up first
    assert d.pending == {}
    for _ in range(3):
        assert d.plan(["a"], 1) is None
    assert d.plan(["a"], 1) == [3] and d.pending == {"a": 1}  # a full window catches up in plain rounds too
    d.forget(["a"])
    assert d.plan(["a"], 24) is None                          # a re-prefilled request waits for nothing


def test_deferred_draft_extend_catch_up_window():
    """The catch-up runs SGLang's draft extend with the window moved back to the first waiting
    position, the waiting tokens and hidden states in row order, padding written to slot 0, and
    gives the waiting rows the extend's next-step top-k; the batch is restored."""
    from sglang_patch.deferred_draft import DeferredDraftExtend

    n, hid, topk = 4, 3, 2
    d = DeferredDraftExtend(width=n, device="cpu")
    req_to_token = torch.arange(4 * 32).reshape(4, 32) + 1000           # slot of (pool row, position)
    slots = torch.tensor([2, 0])
    # row 0 (pool row 2) waits with 3 tokens, row 1 (pool row 0) with none
    for step in range(3):   # plain rounds at roots 18, 19, 20: ring columns 2, 3, then 0 (it wraps)
        d.record(slots[:1], torch.tensor([18 + step]), torch.tensor([10 + step]), torch.full((1, hid), float(step)),
                 pool=4)
    seen = {}

    def extend(batch, result, *, kv_loc_plan=None):
        seen.update(seq_lens=batch.seq_lens.clone(), loc=batch.out_cache_loc.clone(),
                    accept=result.accept_lens.clone(), ids=result.prepared_draft_extend_inputs[2].clone(),
                    select=result.prepared_draft_extend_inputs[1].clone(),
                    hidden=result.logits_output.hidden_states.clone(), cpu=batch.seq_lens_cpu.clone())
        batch.forward_mode = "DRAFT_EXTEND_V2"
        result.next_draft_input.topk_p = torch.ones(2, topk)
        result.next_draft_input.topk_index = torch.full((2, topk), 7)
        result.next_draft_input.hidden_states = torch.full((2, 5), 9.0)

    spec = SimpleNamespace(topk_p=torch.zeros(2, topk), topk_index=torch.zeros(2, topk, dtype=torch.int64),
                           hidden_states=torch.zeros(2, 5))
    batch = SimpleNamespace(req_pool_indices=slots, seq_lens=torch.tensor([21, 9]), seq_lens_cpu=torch.tensor([21, 9]),
                            seq_lens_sum=30, out_cache_loc=torch.tensor([5, 6], dtype=torch.int64), spec_info=spec,
                            forward_mode="DECODE", input_ids=None, prefix_lens=None, extend_lens=None,
                            extend_num_tokens=None)
    tokens, waiting = d.catch_up(SimpleNamespace(_draft_extend_for_decode=extend), batch, [3, 0], req_to_token)
    assert tokens[0, :3].tolist() == [10, 11, 12] and waiting.tolist() == [3, 0]   # in position order
    assert seen["seq_lens"].tolist() == [18, 9] and seen["cpu"].tolist() == [18, 9]
    assert seen["accept"].tolist() == [3, 0]
    assert seen["loc"].tolist() == [1000 + 2 * 32 + 18, 1000 + 2 * 32 + 19, 1000 + 2 * 32 + 20, 0, 0, 0, 0, 0]
    assert seen["ids"][:3].tolist() == [10, 11, 12] and seen["select"].tolist() == [2, 4]
    assert seen["hidden"][:3, 0].tolist() == [0.0, 1.0, 2.0]
    assert batch.forward_mode == "DECODE" and batch.seq_lens.tolist() == [21, 9] and batch.seq_lens_sum == 30
    assert batch.out_cache_loc.tolist() == [5, 6] and batch.spec_info is spec
    assert spec.topk_index.tolist() == [[7, 7], [0, 0]] and spec.hidden_states[:, 0].tolist() == [9.0, 0.0]
    assert d.catch_ups == 1


def test_is_sampled_follows_sglangs_normalised_sampling_params():
    """The output index keeps a request's output by its mode (`GraftPlanner.start_request`): greedy is
    SGLang's temperature 0, which its normalisation turns into ``top_k = 1``."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_patch.graft_requests import is_sampled

    def req(**kw):
        params = SamplingParams(**kw)
        params.normalize(None)
        return SimpleNamespace(sampling_params=params)

    assert not is_sampled(req(temperature=0.0))
    assert is_sampled(req(temperature=0.8, top_p=0.95))
    assert not is_sampled(req(temperature=0.8, top_k=1))      # top-k 1 verifies greedily too
    assert not is_sampled(SimpleNamespace())                  # no parameters: the greedy default
