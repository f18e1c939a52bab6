"""The spine tree of the vLLM adapter (graft_spec/chain.py), on CPU tensors; the chain choice:
tests/test_vllm_chain.py.

No vLLM needed: these are the pure functions the proposer applies after vLLM's EAGLE loop.
Expected values are recomputed independently (plain Python walks over the parents array,
or the fake target's own probabilities), never copied from the implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from graft_spec.chain import spine_tree


def test_spine_tree_layout():
    lp = torch.log(torch.tensor([[[0.6, 0.3], [0.5, 0.2], [0.9, 0.05]]]))
    ids = torch.tensor([[[5, 6], [7, 8], [9, 10]]])
    t = spine_tree(torch.tensor([4]), lp, ids)
    t.validate()
    assert t.tokens.tolist() == [[4, 5, 6, 7, 8, 9, 10]]
    # depth-1 nodes hang under the root, depth-d nodes under the depth-(d-1) top-1 node
    assert t.parents.tolist() == [[-1, 0, 0, 1, 1, 3, 3]]
    want = [0.0, math.log(0.6), math.log(0.3), math.log(0.6 * 0.5), math.log(0.6 * 0.2),
            math.log(0.6 * 0.5 * 0.9), math.log(0.6 * 0.5 * 0.05)]
    assert t.logp[0].tolist() == pytest.approx(want, abs=1e-5)


def test_spine_tree_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must both be"):
        spine_tree(torch.tensor([1]), torch.zeros(1, 2, 3), torch.zeros(1, 2, 2, dtype=torch.int64))
