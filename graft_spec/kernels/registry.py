"""One registration for every fused op: the torch custom op derived from its torch reference.

A fused op is three functions with one signature: the torch reference (the contract, and the op's
CPU implementation), the Triton launcher (its CUDA implementation) and the fake (output shapes, for
``torch.compile`` and meta tensors). Their parameters may be *views*: a ``typing.NamedTuple`` (or a
dataclass) of tensors and scalars that a state object hands out whole (`kernels.views`), or
``Optional`` of one. `fused_op` derives the op's schema from the reference's annotations, each view
flattened to one schema argument per field (``<param>_<field>``; a field of an ``Optional`` view is
optional, and a view whose fields all arrive as None is None), so the flat tensor list a schema
needs is built here and nowhere else.

Calling the returned `FusedOp` runs the reference directly where no fused op should run
(`dispatch.fused_kernels_for` of the first tensor argument: CPU outside `fused_ops_everywhere`, or
``GRAFT_REFERENCE_KERNELS=1``), else ``torch.ops.graft.<name>``: one op to the dispatcher (and to
``sglang_patch.bench.step``'s counter), the Triton launch on a CUDA device.

Source: ``torch.library.custom_op`` (torch/_library/custom_ops.py) with an explicit schema.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch

from . import shadow
from .dispatch import fused_kernels_for

__all__ = ["FusedOp", "fused_op"]

_SCALARS = {torch.Tensor: "Tensor", int: "int", float: "float", bool: "bool", str: "str"}


def _schema_type(tp: Any) -> str:
    """The schema type of a plain annotation (``Tensor``, ``int``, ``list[int]``, ``Optional`` of one)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _schema_type(inner).rstrip("?") + "?"
    if origin is list:
        return _schema_type(args[0]) + "[]"
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise TypeError(f"graft fused_op: unsupported annotation {tp!r}")


def _view_fields(tp: Any) -> Optional[list[tuple[str, Any]]]:
    """``[(field, annotation)]`` of a view class (NamedTuple or dataclass), None for a plain type."""
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):
        hints = typing.get_type_hints(tp)
        return [(f, hints[f]) for f in tp._fields]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return [(f.name, hints[f.name]) for f in dataclasses.fields(tp)]
    return None


class _Param(NamedTuple):
    name: str
    view: Optional[type]          # the view class, None for a plain argument
    optional: bool                # an Optional view
    fields: list[str]             # the view's field names (empty for a plain argument)


class FusedOp:
    """A fused op ``graft::<name>`` (see module docstring); build it with `fused_op`.

    Attributes:
        name: the op's name in the ``graft`` namespace.
        reference: the torch reference (the contract; the op's CPU implementation).
        kernel: the Triton launcher (the op's CUDA implementation), or None without Triton.
        schema: the derived schema string.
    """

    def __init__(self, name: str, reference: Callable, fake: Callable, kernel: Optional[Callable],
                 mutates: Sequence[str], cpu: Optional[Callable], when: Optional[Callable],
                 approximate: Sequence = ()):
        self.name, self.reference, self.kernel, self._when = name, reference, kernel, when
        self._approximate = frozenset(str(a) for a in approximate)
        hints = typing.get_type_hints(reference)
        sig = inspect.signature(reference)
        self._params: list[_Param] = []
        flat: list[str] = []
        self._flat_names: list[str] = []
        self._mutates = frozenset(mutates)
        mutated = set(mutates)
        alias = [0]

        def arg(flat_name: str, tp: str) -> str:
            self._flat_names.append(flat_name)
            if flat_name in mutated:
                mutated.discard(flat_name)
                alias[0] += 1
                opt = "?" if tp.endswith("?") else ""
                tp = f"{tp.rstrip('?')}(a{alias[0]}!){opt}"
            return f"{tp} {flat_name}"

        for p in sig.parameters.values():
            tp = hints[p.name]
            origin, targs = typing.get_origin(tp), typing.get_args(tp)
            optional = origin is Union and type(None) in targs
            inner = [a for a in targs if a is not type(None)][0] if optional else tp
            fields = _view_fields(inner)
            if fields is None:
                self._params.append(_Param(p.name, None, False, []))
                flat.append(arg(p.name, _schema_type(tp)))
                continue
            self._params.append(_Param(p.name, inner, optional, [f for f, _ in fields]))
            for f, ftp in fields:
                st = _schema_type(ftp)
                flat.append(arg(f"{p.name}_{f}", st if not optional or st.endswith("?") else st + "?"))
        if mutated:
            raise ValueError(f"graft fused_op {name}: mutates unknown arguments {sorted(mutated)}")
        self.schema = f"({', '.join(flat)}) -> {self._returns(hints.get('return'))}"
        self._defaults = {p.name: p.default for p in sig.parameters.values() if p.default is not p.empty}
        self._op = torch.library.custom_op(f"graft::{name}", self._on_flat(cpu or reference),
                                           mutates_args=tuple(mutates), schema=self.schema)
        self._op.register_fake(self._on_flat(fake))
        if kernel is not None:
            self._op.register_kernel("cuda")(self._on_flat(kernel))

    @staticmethod
    def _returns(tp: Any) -> str:
        if tp is None or tp is type(None):
            return "()"
        if typing.get_origin(tp) is tuple:
            return "(" + ", ".join(_schema_type(a) for a in typing.get_args(tp)) + ")"
        return _schema_type(tp)

    def _arguments(self, args: tuple, kwargs: dict):
        """``(param, value)`` of a call with the reference's signature, defaults filled in."""
        for i, p in enumerate(self._params):
            yield p, (args[i] if i < len(args) else kwargs.get(p.name, self._defaults.get(p.name)))

    def flatten(self, *args: Any, **kwargs: Any) -> list:
        """The op's flat schema arguments of a call with the reference's signature."""
        out: list = []
        for p, v in self._arguments(args, kwargs):
            if p.view is None:
                out.append(v)
            elif v is None:
                out.extend([None] * len(p.fields))
            else:
                out.extend(getattr(v, f) for f in p.fields)
        return out

    def unflatten(self, flat: Sequence) -> list:
        """The reference's positional arguments from the op's flat schema arguments."""
        out, i = [], 0
        for p in self._params:
            if p.view is None:
                out.append(flat[i])
                i += 1
                continue
            vals = flat[i:i + len(p.fields)]
            i += len(p.fields)
            out.append(None if p.optional and all(v is None for v in vals)
                       else p.view(**dict(zip(p.fields, vals))))
        return out

    def _on_flat(self, fn: Callable) -> Callable:
        def impl(*flat):
            return fn(*self.unflatten(flat))
        impl.__name__ = getattr(fn, "__name__", "impl")
        return impl

    def __call__(self, *args: Any, **kwargs: Any):
        """The reference's contract: the op where `fused_kernels_for` says so, the reference elsewhere;
        inside `shadow.shadow_references`, kernel and reference compared (`shadow`)."""
        first = self._first_tensor(args, kwargs)
        log = shadow.active()
        fused = first is not None and (fused_kernels_for(first) or (log is not None and self.kernel is not None))
        if fused and (self._when is None or self._when(*args, **kwargs)):
            if log is not None and self.kernel is not None:
                return self._shadow(log, args, kwargs)
            return getattr(torch.ops.graft, self.name)(*self.flatten(*args, **kwargs))
        return self.reference(*args, **kwargs)

    def _shadow(self, log: "shadow.ShadowLog", args: tuple, kwargs: dict):
        """The kernel's launcher on the call's tensors, the reference on clones of them; what each
        wrote (the mutated arguments) and returned go to ``log``; the kernel's result is returned."""
        flat = self.flatten(*args, **kwargs)
        clones = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
        got = self.kernel(*self.unflatten(flat))
        want = self.reference(*self.unflatten(clones))
        pairs = [(str(i), a, b) for i, (a, b) in enumerate(zip(_tensors(got), _tensors(want)))]
        pairs += [(n, flat[i], clones[i]) for i, n in enumerate(self._flat_names)
                  if n in self._mutates and isinstance(flat[i], torch.Tensor)]
        log.compare(self.name, pairs, self._approximate)
        return got

    def _first_tensor(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        """The first tensor among a call's arguments and their views' fields (the device it runs on)."""
        for p, v in self._arguments(args, kwargs):
            if p.view is None:
                values = (v,)
            else:
                values = () if v is None else (getattr(v, f) for f in p.fields)
            for x in values:
                if isinstance(x, torch.Tensor):
                    return x
        return None


def _tensors(result: Any) -> list:
    """The tensors an op returned (one, a tuple of them, or none)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [x for x in result if isinstance(x, torch.Tensor)]
    return []


def fused_op(name: str, reference: Callable, fake: Callable, kernel: Optional[Callable] = None,
             mutates: Sequence[str] = (), cpu: Optional[Callable] = None,
             when: Optional[Callable] = None, approximate: Sequence = ()) -> FusedOp:
    """Register ``graft::<name>`` from ``reference`` (see module docstring).

    Args:
        name: the op's name in the ``graft`` namespace.
        reference: the torch reference; its annotations give the schema (views flattened).
        fake: output shapes (same signature), for ``torch.compile`` and meta tensors.
        kernel: the Triton launcher (same signature), the op's CUDA implementation; None without Triton.
        mutates: flat names (``<param>`` or ``<param>_<field>``) of the tensors the op writes in place.
        cpu: the op's CPU implementation where it differs from ``reference`` (copies of outputs that
            would alias inputs: an op returns no input); default ``reference``.
        when: a predicate of the call's arguments; where it is False the reference runs (shapes the
            kernel does not take); default always the op.
        approximate: the outputs the kernel computes within float rounding of the reference, not bit
            for bit (an index of a returned tensor, or a flat name in ``mutates``), for
            `shadow.shadow_references`; every other output is compared bit for bit.
    Returns:
        The `FusedOp`; call it with the reference's arguments.
    Raises:
        TypeError: an annotation the schema cannot express; ValueError: ``mutates`` names no argument.
    """
    return FusedOp(name, reference, fake, kernel, mutates, cpu, when, approximate)
