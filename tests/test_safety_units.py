"""No server: the pieces that keep a graft server safe for many users (issue "safe to serve many
users"): containment of graft's round code, which request features need a plain round, the
requests a graft server refuses, config and corpus errors that name their place, the suffix
index's bound per call, and the padding tree a failed round verifies. The servers' side is
tests/serving/test_serving_safety.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from graft_spec.config import GraftConfig, read_config_file
from graft_spec.retrieval.corpus import CorpusIndex, check_corpus_file
from graft_spec.retrieval.suffix import SuffixIndex
from graft_spec.step import StepOutput
from graft_spec.tree import DraftTree
from graft_spec.sources import SOURCE_DRAFT, SOURCE_PADDING


# ---------------------------------------------------------------------------------- containment
def test_round_guard_contains_counts_and_turns_off(caplog, monkeypatch):
    from sglang_patch.containment import FAILING_ROUNDS_ENV, InjectedFault, RoundGuard

    seen = []
    guard = RoundGuard(on_failure=seen.append, max_failures=2)

    def boom():
        raise RuntimeError("broken source")

    with caplog.at_level(logging.ERROR, logger="sglang_patch.containment"):
        assert guard.call("the graft step", boom, fallback=lambda: "fallback") == "fallback"
        assert not guard.off and seen == ["the graft step"]
        assert guard.call("the graft step", lambda x: x + 1, 1) == 2          # a call that works: no count
        guard.call("the host proposals", boom)
    assert guard.off and guard.total == 2
    assert guard.summary() == {"total": 2, "by_stage": {"the graft step": 1, "the host proposals": 1},
                               "speculation_off": True}
    assert "broken source" in caplog.text and "speculation is off" in caplog.text
    assert caplog.text.count("speculation is off") == 1

    monkeypatch.setenv(FAILING_ROUNDS_ENV, "2,3")
    guard = RoundGuard()
    guard.next_round()
    guard.inject()                                  # round 1: no fault
    guard.next_round()
    with pytest.raises(InjectedFault):
        guard.inject()


def test_following_gate_takes_the_first_ranks_decision():
    from sglang_patch.containment import FollowingGate

    decisions = iter([False, True])
    gate = FollowingGate(lambda local: torch.tensor(next(decisions)))
    assert gate.observe(1, torch.zeros(2)) is False and gate.stop_depth is None
    assert gate.observe(2, torch.zeros(2)) is True and gate.stop_depth == 2
    assert gate.observe(3, torch.zeros(2)) is True     # stopped: no further broadcast


def test_padding_tree_layout_equals_the_general_layout():
    """`StepOutput.padding` writes its layout out by hand: the same tensors as `StepOutput.from_tree`
    of that tree, member bins -1 and no group (nothing credited or learnt)."""
    from graft_spec.pipeline import PRIVATE_GROUP

    roots, seq = torch.tensor([5, 9, 2]), torch.tensor([3, 0, 17])
    for n in (1, 2, 6):
        fast = StepOutput.padding(roots, seq, n, torch.zeros(4))
        col = torch.arange(n)
        tree = DraftTree(torch.where(col == 0, roots[:, None], 0), torch.where(col == 0, -1, 0).expand(3, n),
                         torch.zeros(3, n), torch.where(col == 0, SOURCE_DRAFT, SOURCE_PADDING).expand(3, n))
        ref = StepOutput.from_tree(tree, seq, torch.zeros(4))
        for f in ("depth", "positions", "mask", "first_child", "next_sibling", "member_bins"):
            a, b = getattr(fast, f), getattr(ref, f)
            assert a.dtype == b.dtype and torch.equal(a, b), (n, f)
        assert torch.equal(fast.tree.tokens, ref.tree.tokens) and torch.equal(fast.tree.parents, ref.tree.parents)
        assert fast.groups.tolist() == [PRIVATE_GROUP] * 3


# ---------------------------------------------------------------------------------- request features
def _req(**sampling):
    base = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0, min_p=0.0,
                watermark=None, custom_params=None)
    base.update(sampling)
    return SimpleNamespace(sampling_params=SimpleNamespace(**base), return_logprob=False,
                           custom_logit_processor=None)


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.5), ("presence_penalty", -0.2),
                                          ("repetition_penalty", 1.1), ("min_new_tokens", 4), ("min_p", 0.05)])
def test_plain_round_reason_names_the_parameter(field, value):
    from sglang_patch.request_features import plain_round_reason

    assert plain_round_reason(_req()) is None
    assert plain_round_reason(_req(**{field: value})) == field
    logprob = _req()
    logprob.return_logprob = True
    assert plain_round_reason(logprob) == "return_logprob"


def test_speculates_reads_the_opt_out():
    from sglang_patch.request_features import speculates

    assert speculates(_req()) and speculates(_req(custom_params={"other": 1}))
    assert not speculates(_req(custom_params={"graft_speculate": False}))


def test_graft_requests_refused_with_the_field_named():
    from sglang_patch.request_guard import check_prompt_tokens, graft_request_problem

    graft = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100),
                            server_args=SimpleNamespace(speculative_algorithm="graft"))
    plain = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100),
                            server_args=SimpleNamespace(speculative_algorithm=None))

    def obj(**kw):
        base = dict(input_embeds=None, image_data=None, video_data=None, audio_data=None, return_hidden_states=False,
                    sampling_params={"max_new_tokens": 4})
        base.update(kw)
        return SimpleNamespace(**base)

    for bad in ("false", 0, 1, None, "no"):
        o = obj(sampling_params={"custom_params": {"graft_speculate": bad}})
        assert "graft_speculate" in graft_request_problem(o)
        with pytest.raises(ValueError, match="custom_params.graft_speculate"):
            check_prompt_tokens(graft, o, [1, 2])
        assert check_prompt_tokens(plain, o, [1, 2]) is None         # not a graft server: not its field
    for good in (True, False):
        assert check_prompt_tokens(graft, obj(sampling_params={"custom_params": {"graft_speculate": good}}),
                                   [1, 2]) is None
    with pytest.raises(ValueError, match="return_hidden_states"):
        check_prompt_tokens(graft, obj(return_hidden_states=True), [1, 2])


# ---------------------------------------------------------------------------------- config and corpus
def test_config_syntax_errors_name_the_file_and_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("num_draft_tokens: 24\nretrieval:\n  successor: [true\n  suffix: false\n")
    with pytest.raises(ValueError, match=r"bad\.yaml, line \d+, column \d+: YAML syntax error"):
        read_config_file(bad_yaml)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"num_draft_tokens": 24,\n "topk": }\n')
    with pytest.raises(ValueError, match=r"bad\.json, line 2, column \d+"):
        read_config_file(bad_json)


def test_corpus_entries_are_checked_where_they_enter(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text("[1, 2, 3]\n{\"tokens\": [4, 5]}\n\n")
    assert check_corpus_file(good, vocab_size=10) == 2
    assert CorpusIndex.from_file(good, vocab_size=10).num_tokens == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2, 3]\n[4, 99]\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: token id 99 outside \[0, 10\)"):
        CorpusIndex.from_file(bad, vocab_size=10)
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps([[1, 2], [3, -1]]))
    with pytest.raises(ValueError, match=r"neg\.json, entry 1: token id -1"):
        check_corpus_file(neg)
    typed = tmp_path / "typed.json"
    typed.write_text(json.dumps([[1, "x"]]))
    with pytest.raises(ValueError, match=r"entry 0: expected a list of token ids"):
        check_corpus_file(typed)
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_corpus_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown suffix"):
        check_corpus_file(tmp_path / "c.csv")


def test_a_bad_corpus_stops_the_server_before_the_model_loads(tmp_path):
    """`apply_graft_server_defaults` (SGLang's server-argument resolution, before any model loads)
    checks ``retrieval.corpus_path``."""
    from sglang_patch.args import CLI_ATTR, GraftSettingsError, apply_graft_server_defaults

    bad = tmp_path / "corpus.jsonl"
    bad.write_text("[1, 2]\nnot json\n")
    sa = SimpleNamespace(speculative_draft_model_path="/draft", speculative_eagle_topk=None,
                         speculative_use_rejection_sampling=False, pp_size=1, speculative_num_steps=None,
                         speculative_num_draft_tokens=None, max_running_requests=None, enable_mixed_chunk=False,
                         attention_backend=None, page_size=1)
    setattr(sa, CLI_ATTR, {"retrieval.corpus": True, "retrieval.corpus_path": str(bad)})
    with pytest.raises(GraftSettingsError, match=r"retrieval\.corpus_path: corpus .*corpus\.jsonl, line 2"):
        apply_graft_server_defaults(sa, environ={})


def test_lora_is_refused_at_startup():
    from sglang_patch.args import GraftSettingsError, apply_graft_server_defaults

    sa = SimpleNamespace(speculative_draft_model_path="/draft", speculative_eagle_topk=None,
                         speculative_use_rejection_sampling=False, pp_size=1, enable_lora=True)
    with pytest.raises(GraftSettingsError, match="--enable-lora"):
        apply_graft_server_defaults(sa, environ={})


def test_private_by_default_and_sources_off():
    cfg = GraftConfig()
    assert cfg.retrieval.isolation == "tenant" and cfg.return_sources is False
    assert 1 in cfg.verify_widths and GraftConfig(batch_budget={"enabled": False}).verify_widths == (1, 24)


def test_tenant_key_is_sglangs_radix_key():
    from sglang_patch.graft_requests import tenant_of

    assert tenant_of(SimpleNamespace(extra_key=None, cache_salt=None)) is None
    assert tenant_of(SimpleNamespace(extra_key="", cache_salt=None)) is None
    assert tenant_of(SimpleNamespace(extra_key="a", cache_salt=None)) == ("a", None)
    assert tenant_of(SimpleNamespace(extra_key=None, cache_salt="s")) == (None, "s")
    assert tenant_of(SimpleNamespace(extra_key="a", cache_salt="s")) != tenant_of(SimpleNamespace(extra_key="a",
                                                                                                cache_salt="t"))


# ---------------------------------------------------------------------------------- bounds
def test_a_long_prompt_inserts_at_most_max_insert_tokens():
    """One call never inserts more than `SuffixIndex.max_insert` tokens (``max_nodes // max_depth``):
    a long prompt keeps its newest ones, so a call's cost is bounded by the cap, not by the prompt."""
    idx = SuffixIndex(max_depth=8, max_match=3, max_nodes=256)
    assert (idx.window, idx.max_insert) == (16, 32)
    prompt = list(range(100)) * 50                                   # 5,000 tokens
    idx.start("a", prompt)
    trie = idx._tries["a"]
    assert trie.hist[-idx.max_insert:] == prompt[-idx.max_insert:] and len(trie.hist) <= idx.max_insert + 1
    assert trie.num_nodes <= idx.max_nodes and idx.rebuilds >= 1
    idx.extend("a", [7, 8])                                          # short extends insert as before
    assert idx._tries["a"].hist[-2:] == [7, 8]
    short = SuffixIndex(max_depth=8, max_match=3, max_nodes=256)
    short.start("b", prompt[:30])                                    # under the bound: all of it
    assert short._tries["b"].hist == prompt[:30] and short.rebuilds == 0


def test_planner_state_bytes_count_every_isolation_group():
    from graft_spec.pipeline import GraftPlanner

    cfg = GraftConfig(retrieval={"isolation": "tenant", "max_tenants": 8, "outputs": "off"})
    one = GraftConfig(retrieval={"isolation": "shared", "outputs": "off"})
    a = GraftPlanner.state_bytes(cfg, 1000, 4, 5)
    b = GraftPlanner.state_bytes(one, 1000, 4, 5)
    assert a["successor_table"] == 8 * b["successor_table"] == 8 * 1002 * 8 * 4
    assert a["output_index"] == 0
    planner = GraftPlanner(cfg, 1000, max_batch=4, max_slots=5)
    assert planner.successor.memory_bytes() == a["successor_table"]
    on = GraftConfig(retrieval={"outputs": "greedy", "outputs_max_tokens": 4096})
    assert GraftPlanner.state_bytes(on, 1000, 4, 5)["output_index"] == GraftPlanner(on, 1000).outputs.index_bytes()


def test_requests_finished_in_prefill_are_reported_to_the_worker():
    """SGLang reports a finished request to a speculative worker only from the decode path: the
    prefill hook hands every finished request of a prefill batch to the graft worker, and a failing
    worker never breaks result processing."""
    from types import SimpleNamespace

    from sglang_patch.prefill_finish import free_finished_in_prefill

    freed = []
    req = lambda rid, done: SimpleNamespace(rid=rid, finished=lambda: done)  # noqa: E731
    batch = SimpleNamespace(reqs=[req("a", True), req("b", False), req("c", True)])
    worker = SimpleNamespace(note_prefill_finished=freed.append)
    assert free_finished_in_prefill("out", SimpleNamespace(draft_worker=worker), batch) == "out"
    assert freed == ["a", "c"]

    def boom(rid):
        raise RuntimeError("boom")
    broken = SimpleNamespace(draft_worker=SimpleNamespace(note_prefill_finished=boom))
    assert free_finished_in_prefill("out", broken, batch) == "out"
    assert free_finished_in_prefill("out", SimpleNamespace(draft_worker=None), batch) == "out"   # no graft
