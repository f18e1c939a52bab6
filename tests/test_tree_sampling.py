"""Graft's sampled verify inside SGLang's ``eagle_sample`` (sglang_patch/tree_sampling.py): the tree
sampling op gets SGLang's coins and target probabilities, writes SGLang's outputs, and the draft
probabilities it is handed are a stride-0 view, not a ``[B, N, V]`` allocation."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from graft_spec.kernels.tree_sample import tree_sample_reference
from graft_spec.tree import sibling_links


@pytest.fixture
def eagle_utils(monkeypatch):
    """``eagle_utils`` with the server-wide context ``eagle_sample`` reads outside a server."""
    import sglang.srt.layers.dp_attention as dp_attention
    import sglang.srt.runtime_context as runtime_context
    import sglang.srt.speculative.eagle_utils as eu

    monkeypatch.setattr(eu, "get_spec", lambda: NS(speculative_use_rejection_sampling=False,
                                                   speculative_use_block_verification=False,
                                                   speculative_accept_threshold_single=1.0,
                                                   speculative_accept_threshold_acc=1.0))
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: NS(tp_group=NS(world_size=1)))
    monkeypatch.setattr(dp_attention, "is_dp_attention_enabled", lambda: False)
    return eu


def _inputs(b: int = 5, n: int = 6, v: int = 11, depth: int = 4):
    g = torch.Generator().manual_seed(3)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]]).expand(b, n)
    nt, ns = sibling_links(parents)
    tokens = torch.stack([torch.randperm(v, generator=g)[:n] for _ in range(b)])   # distinct siblings
    verify_input = NS(draft_token=tokens.reshape(-1), draft_token_num=n, max_tree_depth=depth,
                      retrieve_index=torch.arange(b * n).view(b, n), retrieve_next_token=nt,
                      retrieve_next_sibling=ns, tree_topk=2)
    info = NS(acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None,
              has_watermark_candidates=False, is_all_greedy=False, temperatures=torch.full((b, 1), 0.7),
              need_top_k_sampling=False, need_top_p_sampling=False, sampling_seed=None, need_min_p_sampling=False)
    batch = NS(forward_mode=NS(is_idle=lambda: False), seq_lens=torch.arange(b) + 5, device="cpu",
               sampling_info=info)
    # logits that favour each node's children, so paths longer than one are accepted
    logits = torch.randn(b, n, v, generator=g)
    logits.scatter_add_(2, tokens[:, None, :].expand(b, n, n), torch.full((b, n, n), 3.0))
    return verify_input, batch, NS(next_token_logits=logits.reshape(b * n, v))


def test_eagle_sample_runs_graft_tree_sampling_without_a_draft_probability_tensor(eagle_utils, monkeypatch):
    import sglang_patch.tree_sampling as ts

    seen = {}
    bound = ts.tree_speculative_sampling_target_only

    def spy(**kwargs):
        seen.update({k: (v.clone() if isinstance(v, torch.Tensor) and k not in ("draft_probs",) else v)
                     for k, v in kwargs.items()})
        return bound(**kwargs)

    monkeypatch.setattr(ts, "tree_speculative_sampling_target_only", spy)
    before = (eagle_utils.torch, eagle_utils.tree_speculative_sampling_target_only)
    vi, batch, logits = _inputs()
    torch.manual_seed(0)
    with ts.graft_sampling():
        predict, accept_lens, accept_index = eagle_utils.eagle_sample(vi, batch, logits)
    assert (eagle_utils.torch, eagle_utils.tree_speculative_sampling_target_only) == before
    draft = seen["draft_probs"]
    assert draft.shape == seen["target_probs"].shape and draft.stride() == (0, 0, 0)
    assert draft.untyped_storage().nbytes() == 4
    # the same result as the reference on the coins and probabilities SGLang computed
    b, n = vi.retrieve_index.shape
    want = (torch.zeros(b * n, dtype=torch.int32), torch.full((b, vi.max_tree_depth), -1, dtype=torch.int32),
            torch.zeros(b, dtype=torch.int32))
    tree_sample_reference(*want, seen["candidates"], seen["retrive_index"], seen["retrive_next_token"],
                          seen["retrive_next_sibling"], seen["uniform_samples"],
                          seen["uniform_samples_for_final_sampling"], seen["target_probs"])
    assert torch.equal(predict, want[0]) and torch.equal(accept_index, want[1])
    assert torch.equal(accept_lens, want[2] + 1)
    assert int(want[2].max()) >= 1   # some request accepted a candidate


def test_graft_sampling_restores_eagle_utils_on_error(eagle_utils):
    from sglang_patch.tree_sampling import graft_sampling

    before = (eagle_utils.torch, eagle_utils.tree_speculative_sampling_target_only)
    with pytest.raises(RuntimeError):
        with graft_sampling():
            assert eagle_utils.torch is not torch
            raise RuntimeError("verify failed")
    assert (eagle_utils.torch, eagle_utils.tree_speculative_sampling_target_only) == before

