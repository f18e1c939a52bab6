"""`kernels.registry.fused_op`: the op's schema derived from its reference, views flattened and
rebuilt in one place, the reference on CPU, one dispatch inside `fused_ops_everywhere`."""

from __future__ import annotations

from typing import NamedTuple, Optional

import pytest
import torch

from graft_spec.kernels import fused_ops_everywhere
from graft_spec.kernels.registry import fused_op


class _Pair(NamedTuple):
    a: torch.Tensor
    n: int


class _Extra(NamedTuple):
    b: torch.Tensor
    c: Optional[torch.Tensor]


def _toy_reference(x: torch.Tensor, pair: _Pair, extra: Optional[_Extra], scale: float) -> torch.Tensor:
    """``x * scale + pair.a * pair.n`` (+ ``extra.b``; ``extra.c`` incremented in place)."""
    out = x * scale + pair.a * pair.n
    if extra is not None:
        out = out + extra.b
        if extra.c is not None:
            extra.c.add_(1)
    return out


def _toy_fake(x: torch.Tensor, pair: _Pair, extra: Optional[_Extra], scale: float) -> torch.Tensor:
    return torch.empty_like(x)


TOY = fused_op("registry_toy", _toy_reference, _toy_fake, mutates=("extra_c",))


def test_schema_is_derived_from_the_reference_with_views_flattened():
    assert TOY.schema == ("(Tensor x, Tensor pair_a, int pair_n, Tensor? extra_b, Tensor(a1!)? extra_c, "
                          "float scale) -> Tensor")
    x, pair, extra = torch.ones(3), _Pair(torch.arange(3.0), 2), _Extra(torch.full((3,), 5.0), None)
    flat = TOY.flatten(x, pair, extra, scale=0.5)
    assert flat[1:4] == [pair.a, 2, extra.b] and flat[4] is None and flat[5] == 0.5
    back = TOY.unflatten(flat)
    assert back[1] == pair and back[2] == extra and back[3] == 0.5
    assert TOY.unflatten(TOY.flatten(x, pair, None, 1.0))[2] is None          # an absent view stays None


def test_the_op_is_the_reference_on_cpu_and_one_dispatch_when_fused():
    from sglang_patch.bench.step import OpCounter

    x, pair = torch.ones(3), _Pair(torch.arange(3.0), 2)
    c_ref, c_op = torch.zeros(3), torch.zeros(3)
    want = _toy_reference(x, pair, _Extra(torch.ones(3), c_ref), 2.0)
    with OpCounter() as c:
        got = TOY(x, pair, _Extra(torch.ones(3), torch.zeros(3)), 2.0)
    assert c.ops > 1 and torch.equal(got, want)                                # CPU: the reference itself
    extra = _Extra(torch.ones(3), c_op)
    with fused_ops_everywhere(), OpCounter() as c:
        got = TOY(x, pair, extra, 2.0)
    assert c.ops == 1 and c.names == {"registry_toy": 1}
    assert torch.equal(got, want) and torch.equal(c_op, c_ref)                 # the declared mutation happened


def test_bad_declarations_are_refused():
    def wide(x: torch.Tensor, d: dict) -> torch.Tensor:
        return x

    with pytest.raises(TypeError, match="unsupported annotation"):
        fused_op("registry_bad_type", wide, wide)
    with pytest.raises(ValueError, match="mutates unknown arguments"):
        fused_op("registry_bad_mutates", _toy_reference, _toy_fake, mutates=("pair_b",))
