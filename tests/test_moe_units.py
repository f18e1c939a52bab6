"""Issue 46 without servers: the moe-quick preset, the CPU expert-parallel hooks, the width-state
refusals and logging, and the memory table (``python -m sglang_patch.memory``)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def test_moe_quick_preset_is_a_qwen3_moe_sharing_quicks_tokenizer():
    from modelmaking.sizes import PRESETS
    from modelmaking.target import build_config, init_model

    moe, quick = PRESETS["moe-quick"], PRESETS["quick"]
    assert moe.shares == "quick"
    for field in ("max_train_chars", "tokenizer_chars", "vocab_size", "packages"):
        assert getattr(moe, field) == getattr(quick, field), field
    cfg = build_config(moe.target, moe.vocab_size, {"endoftext": 0, "im_end": 1})
    assert cfg.architectures == ["Qwen3MoeForCausalLM"]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.decoder_sparse_step) == (8, 2, 1)
    model = init_model(cfg, 0)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert build_config(quick.target, quick.vocab_size, {"endoftext": 0, "im_end": 1}).architectures == [
        "Qwen3ForCausalLM"]


def test_dense_fingerprints_do_not_see_the_moe_field(tmp_path):
    """Adding ``TargetSpec.moe`` must not rebuild existing dense models (their target fingerprint has no
    ``moe`` key), while the MoE preset's does."""
    import make_models
    from modelmaking.sizes import PRESETS

    dense = make_models.Builder(tmp_path / "quick", PRESETS["quick"], 0, "cpu", False)
    moe = make_models.Builder(tmp_path / "moe-quick", PRESETS["moe-quick"], 0, "cpu", False)
    # tokenizer stage: same settings, same fingerprint (so moe-quick can adopt quick's)
    assert dense.fingerprint("tokenizer") == moe.fingerprint("tokenizer")
    assert dense.fingerprint("target") != moe.fingerprint("target")
    spec = PRESETS["quick"].as_dict()["target"]
    assert spec.pop("moe") is None and "moe" not in spec


@pytest.mark.parametrize("shared,folder,preset", [("quick", "quick", "moe-quick"), ("gpu", "default", "moe")])
def test_adopt_shared_copies_the_tokenizer_stage(tmp_path, shared, folder, preset):
    """From the shared preset's folder (the gpu preset's is the shipped pair's, models/default)."""
    import make_models
    from modelmaking.sizes import PRESETS

    src = make_models.Builder(tmp_path / folder, PRESETS[shared], 0, "cpu", False)
    (tmp_path / folder / "tokenizer").mkdir()
    (tmp_path / folder / "tokenizer" / "tokenizer.json").write_text("{}")
    src.finish("tokenizer", {"seconds": 0.0})
    moe = make_models.Builder(tmp_path / preset, PRESETS[preset], 0, "cpu", False)
    marker = moe.adopt_shared("tokenizer", "tokenizer")
    assert marker is not None and (tmp_path / preset / "tokenizer" / "tokenizer.json").exists()
    assert moe.done("tokenizer", [tmp_path / preset / "tokenizer" / "tokenizer.json"]) is not None


def test_native_moe_hook_drops_other_ranks_experts():
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_patch.cpu.moe import moe_forward_native_hook

    seen = {}

    def orig(layer, x, topk_output, cfg):
        seen["out"] = topk_output
        return x

    layer = SimpleNamespace(w13_weight=torch.zeros(4, 2, 2))   # 4 local experts
    ids = torch.tensor([[0, -1], [-1, 3], [-1, -1], [1, 2]], dtype=torch.int32)
    w = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5], [0.9, 0.1]])
    moe_forward_native_hook(orig, layer, torch.zeros(4, 4), StandardTopKOutput(w, ids, None), None)
    got = seen["out"].topk_ids
    # dropped slots go to local experts the token does not use yet: no token names an expert twice
    assert got.tolist() == [[0, 1], [0, 3], [0, 1], [1, 2]]
    assert got.dtype == ids.dtype
    assert torch.allclose(seen["out"].topk_weights, torch.tensor([[0.6, 0.0], [0.0, 0.7], [0.0, 0.0], [0.9, 0.1]]))
    # no -1: the very same output object goes through
    plain = StandardTopKOutput(w, ids.clamp_min(0), None)
    moe_forward_native_hook(orig, layer, torch.zeros(4, 4), plain, None)
    assert seen["out"] is plain


def test_native_moe_hook_gives_the_local_experts_partial_sum():
    """With the hook, the torch MoE forward over a rank's local experts equals the full forward restricted
    to them (the other slots contribute exactly 0)."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_patch.cpu.moe import moe_forward_native_hook

    torch.manual_seed(0)
    E, H, I, T = 4, 8, 6, 5
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    full = SimpleNamespace(w13_weight=w13, w2_weight=w2, num_experts=E)
    x = torch.randn(T, H)
    ids = torch.tensor([[0, 3], [2, 1], [3, 2], [1, 0], [2, 3]], dtype=torch.int32)
    w = torch.rand(T, 2)
    cfg = MoeRunnerConfig(activation="silu")
    ref = moe_forward_native(full, x, StandardTopKOutput(w, ids, None), cfg)
    parts = []
    for rank in range(2):   # experts 2r, 2r+1 on rank r
        local = SimpleNamespace(w13_weight=w13[2 * rank: 2 * rank + 2], w2_weight=w2[2 * rank: 2 * rank + 2],
                                num_experts=E)
        lid = torch.where((ids // 2) == rank, ids % 2, -1).to(torch.int32)
        parts.append(moe_forward_native_hook(moe_forward_native, local, x, StandardTopKOutput(w, lid, None), cfg))
    torch.testing.assert_close(parts[0] + parts[1], ref)


def test_get_device_hook_answers_cpu_without_accelerator():
    from sglang_patch.cpu.moe import get_device_hook

    def no_accel(device_id=None):
        raise RuntimeError("No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) or platform plugin is available.")

    assert get_device_hook(no_accel) == "cpu"
    assert get_device_hook(lambda device_id=None: "cuda:0") == "cuda:0"


@pytest.mark.parametrize("flag", ["enable_two_batch_overlap", "enable_pdmux"])
def test_width_states_refuse_what_sglang_refuses_for_adaptive(flag):
    from graft_spec.config import GraftConfig

    from sglang_patch.args import GraftSettingsError, refuse_width_state_combinations

    sa = SimpleNamespace(**{flag: True})
    with pytest.raises(GraftSettingsError, match=f"--{flag.replace('_', '-')}.*drop the flag"):
        refuse_width_state_combinations(sa, GraftConfig())
    # the budget off still has a plain width beside N: refused too
    with pytest.raises(GraftSettingsError, match=f"--{flag.replace('_', '-')}"):
        refuse_width_state_combinations(sa, GraftConfig(batch_budget={"enabled": False}))


def test_state_switches_are_debug_lines():
    from sglang_patch.verify_widths import QuietSwitches

    log = logging.getLogger("test_moe_units.switch")
    log.setLevel(logging.INFO)
    f = QuietSwitches()
    rec = log.makeRecord(log.name, logging.INFO, __file__, 1, "Switch adaptive runtime state: steps 4 -> 0", (), None)
    assert f.filter(rec) is False and rec.levelno == logging.DEBUG
    other = log.makeRecord(log.name, logging.INFO, __file__, 1, "Built adaptive runtime state", (), None)
    assert f.filter(other) is True and other.levelno == logging.INFO


def test_tensor_bytes_counts_shared_storage_once():
    from sglang_patch.verify_widths import tensor_bytes

    buf = torch.zeros(100, dtype=torch.float32)
    a = SimpleNamespace(x=buf, y=buf[:10], z=[torch.zeros(5, dtype=torch.int64)])
    assert tensor_bytes([a]) == 400 + 40
    seen: set = set()
    tensor_bytes([a], seen)
    assert tensor_bytes([SimpleNamespace(x=buf, w=torch.zeros(2))], seen) == 8


def test_memory_table_from_the_shipped_shapes():
    from sglang_patch import memory

    shapes = ROOT / "configs" / "shapes"
    for name, tp, lo, hi in (("qwen3-8b", 1, 14.5, 16.0), ("qwen3-235b-a22b", 8, 53.0, 57.0)):
        m = memory.ModelShape.from_config(json.loads((shapes / f"{name}.json").read_text()))
        d = memory.DraftShape.from_config(json.loads((shapes / f"{name}-eagle3.json").read_text()), m)
        s = memory.serving_from_graft_config(ROOT / "configs" / ("qwen3-8b.yaml" if tp == 1 else "qwen3-235b-a22b.yaml"),
                                             tp=tp, batch=64, max_running_requests=64, context=40960)
        t = memory.table(m, d, s)
        assert lo < t["weights_target"] / memory.GIB < hi, (name, t["weights_target"] / memory.GIB)
        rows = {r["width"]: r for r in t["widths"]}
        assert sorted(rows) == [1, 30, 60]
        assert rows[60]["state_graft"] == 0 and rows[30]["state_graft"] > memory.FLASHINFER_WORKSPACE_BYTES
        # width 30 drafts the full depth: it shares N's draft decode buffers (depth 7 x 64 x top-10 x 40960 int32)
        assert rows[30]["draft_decode_shared"] == 7 * 64 * 10 * 40960 * 4
        assert rows[1]["draft_decode_shared"] == rows[60]["draft_decode_shared"] == 0
        for w, r in rows.items():
            probs = 64 * w * m.vocab * 4
            assert r["round_sampled_eagle3"] - r["round_sampled_graft"] == probs
            assert r["round_greedy_graft"] == r["round_greedy_eagle3"]
        assert t["graft_beyond_eagle3"] == t["graft_width_states"] + sum(t["graft_persistent"].values())
    assert "| 60 |" in memory.render("x", t)


def test_memory_cli_runs(capsys):
    from sglang_patch import memory

    memory.main(["--model-config", str(ROOT / "configs" / "shapes" / "qwen3-235b-a22b.json"), "--tp", "8",
                 "--graft-config", str(ROOT / "configs" / "qwen3-235b-a22b.yaml"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["tp"] == 8 and out["num_draft_tokens"] == 60


def test_moe_preset_is_the_shipped_pairs_shape_with_routed_experts(tmp_path):
    """``--preset moe`` (trained on a GPU): the gpu preset's tokenizer, corpus, attention, schedule and
    head, so its tokenizer and data stages are the shipped pair's (adopted from ``models/default``);
    32 experts, top-4, whose active MLP width equals the dense pair's."""
    import make_models
    from modelmaking.sizes import PRESETS, folder
    from modelmaking.target import build_config

    moe, gpu = PRESETS["moe"], PRESETS["gpu"]
    assert moe.shares == "gpu" and folder("gpu") == "default" and folder("moe") == "moe"
    for field in ("max_train_chars", "tokenizer_chars", "vocab_size", "packages", "eval_tokens", "eval_seq_len",
                  "draft"):
        assert getattr(moe, field) == getattr(gpu, field), field
    t, d = moe.target, gpu.target
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "seq_len", "batch_size", "steps", "lr"):
        assert getattr(t, field) == getattr(d, field), field
    assert t.moe.num_experts_per_tok * t.moe.moe_intermediate_size == d.intermediate_size
    cfg = build_config(t, moe.vocab_size, {"endoftext": 0, "im_end": 1})
    assert cfg.architectures == ["Qwen3MoeForCausalLM"] and (cfg.num_experts, cfg.num_experts_per_tok) == (32, 4)
    a = make_models.Builder(tmp_path / "default", gpu, 0, "cpu", False)
    b = make_models.Builder(tmp_path / "moe", moe, 0, "cpu", False)
    assert a.fingerprint("tokenizer") == b.fingerprint("tokenizer") and a.fingerprint("data") == b.fingerprint("data")
    assert a.fingerprint("target") != b.fingerprint("target")

