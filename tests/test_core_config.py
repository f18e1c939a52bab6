"""GraftConfig validation and the three loading paths (file, env, load_config)."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from graft_spec.config import GraftConfig, env_overrides, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_valid():
    c = GraftConfig()
    assert c.num_draft_tokens >= 2 and c.topk >= 2


@pytest.mark.parametrize("kwargs, field, words", [
    ({"num_draft_tokens": 1}, "num_draft_tokens", "greater than or equal to 2"),
    ({"topk": 1}, "topk", "greater than or equal to 2"),
    ({"depth": 0}, "depth", "greater than or equal to 1"),
    ({"checkpoints": [{"depth": 1, "threshold": 0.0, "keep": 2}]}, "threshold", "greater than 0"),
    ({"checkpoints": [{"depth": 1, "threshold": 1.0, "keep": 2}]}, "threshold", "less than 1"),
    ({"checkpoints": [{"depth": 1, "threshold": 0.5, "keep": 4}, {"depth": 2, "threshold": 0.5, "keep": 4}]},
     "checkpoints[1].keep", "strictly increasing"),
    ({"checkpoints": [{"depth": 2, "threshold": 0.5, "keep": 4}, {"depth": 1, "threshold": 0.5, "keep": 8}]},
     "checkpoints[1].depth", "strictly increasing"),
    ({"checkpoints": [{"depth": 1, "threshold": 0.5, "keep": 24}]}, "checkpoints[0].keep", "< num_draft_tokens"),
    ({"checkpoints": [{"depth": 9, "threshold": 0.5, "keep": 4}]}, "checkpoints[0].depth", "<= depth"),
    ({"num_draft_tokens": 60, "topk": 2, "depth": 3}, "num_draft_tokens", "topk + (depth-1)*topk^2"),
    ({"retrieval": {"suffix_max_match": 16, "suffix_max_depth": 16}}, "suffix_max_match", "must be <"),
    ({"retrieval": {"corpus": True}}, "corpus_path", "required"),
    ({"retrieval": {"suffix_max_nodes": 100, "suffix_max_depth": 32}}, "suffix_max_nodes", ">= 4 * "),
    ({"retrieval": {"successor_k": 0}}, "successor_k", "greater than or equal to 1"),
    ({"graft": {"min_score": 1.0}}, "min_score", "less than 1"),
    ({"bogus": 1}, "bogus", "Extra inputs are not permitted"),
    ({"retrieval": {"bogus": 1}}, "bogus", "Extra inputs are not permitted"),
])
def test_validation_names_field_and_range(kwargs, field, words):
    with pytest.raises(ValidationError) as e:
        GraftConfig.model_validate(kwargs)
    msg = str(e.value)
    assert field in msg and words in msg, msg


def test_presets_load_and_match_paper_shape():
    for p in sorted(CONFIGS.glob("*.yaml")):
        GraftConfig.from_file(p)
    q = GraftConfig.from_file(CONFIGS / "qwen3-8b.yaml")
    assert (q.num_draft_tokens, q.depth, q.topk) == (60, 7, 10)
    assert q.checkpoints == ()  # out of the box: calibrated expected-gain selection
    paper = GraftConfig.from_file(CONFIGS / "qwen3-8b-paper.yaml")
    assert (paper.num_draft_tokens, paper.depth, paper.topk) == (60, 7, 10)
    assert [s.keep for s in paper.checkpoints] == [8, 24, 40]
    quick = GraftConfig.from_file(CONFIGS / "quick.yaml")
    assert quick.num_draft_tokens <= 32


def test_from_file_json_yaml_and_errors(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"num_draft_tokens": 16, "topk": 4, "depth": 3}))
    (tmp_path / "a.yaml").write_text("num_draft_tokens: 16\ntopk: 4\ndepth: 3\n")
    assert GraftConfig.from_file(tmp_path / "a.json") == GraftConfig.from_file(tmp_path / "a.yaml")
    (tmp_path / "a.toml").write_text("x = 1")
    with pytest.raises(ValueError, match="unknown suffix"):
        GraftConfig.from_file(tmp_path / "a.toml")
    (tmp_path / "b.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        GraftConfig.from_file(tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("num_draft_tokens: 1\n")
    with pytest.raises(ValidationError, match="num_draft_tokens"):
        GraftConfig.from_file(tmp_path / "c.yaml")


def test_env_and_precedence(tmp_path):
    env = {"GRAFTCFG_NUM_DRAFT_TOKENS": "32", "GRAFTCFG_RETRIEVAL__SUFFIX_MAX_DEPTH": "12",
           "GRAFTCFG_CHECKPOINTS": "[{depth: 1, threshold: 0.3, keep: 8}]", "GRAFTCFG_RETRIEVAL__CORPUS": "false",
           "OTHER": "1"}
    assert env_overrides(environ=env)["retrieval"] == {"suffix_max_depth": 12, "corpus": False}
    c = GraftConfig.from_env(environ=env)
    assert c.num_draft_tokens == 32 and c.retrieval.suffix_max_depth == 12 and c.checkpoints[0].keep == 8
    with pytest.raises(ValidationError, match="Extra inputs"):
        GraftConfig.from_env(environ={"GRAFTCFG_NOPE": "1"})
    with pytest.raises(ValidationError, match="num_draft_tokens"):
        GraftConfig.from_env(environ={"GRAFTCFG_NUM_DRAFT_TOKENS": "1"})

    f = tmp_path / "base.yaml"
    f.write_text("num_draft_tokens: 20\ntopk: 4\ndepth: 4\nretrieval: {suffix_max_depth: 10, successor_k: 4}\n")
    # file < env < overrides; None overrides are ignored; dotted keys reach nested fields
    c = load_config(f, overrides={"topk": 5, "depth": None, "retrieval.successor_k": 6},
                    environ={"GRAFTCFG_TOPK": "3", "GRAFTCFG_NUM_DRAFT_TOKENS": "22"})
    assert (c.num_draft_tokens, c.topk, c.depth) == (22, 5, 4)
    assert (c.retrieval.suffix_max_depth, c.retrieval.successor_k) == (10, 6)
    # GRAFT_CONFIG names the file when none is given; env=False ignores the environment
    c = load_config(environ={"GRAFT_CONFIG": str(f), "GRAFTCFG_TOPK": "3"})
    assert (c.num_draft_tokens, c.topk) == (20, 3)
    assert load_config(env=False, environ={"GRAFTCFG_TOPK": "3"}).topk == GraftConfig().topk
    with pytest.raises(ValidationError, match="topk"):
        load_config(f, overrides={"topk": 1}, env=False)


def test_config_is_frozen():
    c = GraftConfig()
    with pytest.raises(ValidationError):
        c.topk = 3
