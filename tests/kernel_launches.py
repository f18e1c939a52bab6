"""Every Triton kernel the interpreter tests launch, compiled for a CUDA GPU without one.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on CPU tensors and never lowers
it, so a kernel can pass every interpreted test and still not compile for a GPU (a loop-carried
variable whose type changes, an op the interpreter accepts on a scalar and the compiler does not).
`install_recorder` records each distinct launch of the interpreted tests (kernel, argument types,
constexpr values, launch options) and `compile_launches` compiles each for an NVIDIA target
(``sm_90`` by default) down to a cubin with the ``ptxas`` shipped in Triton's wheel, on a machine
with no GPU.

    TRITON_INTERPRET=1 GRAFT_RECORD_LAUNCHES=/tmp/l.json python -m pytest tests/interpret/...
    python tests/kernel_launches.py /tmp/l.json       # prints one line per kernel, exits 1 on a failure
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import json
import sys
from pathlib import Path

ENV = "GRAFT_RECORD_LAUNCHES"
#: launch keywords that are compile options, not kernel arguments
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
_DTYPES = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _arg_type(value) -> str:
    """Triton signature type of one runtime argument."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "data_ptr"):
        return "*" + _DTYPES[str(dtype).replace("torch.", "")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def install_recorder(path: str) -> None:
    """Record every interpreted launch into ``path`` (JSON, written when the process exits)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
        sig = inspect.signature(self.fn)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constexprs = {}, {}
        for name, param in sig.parameters.items():
            value = bound.arguments[name]
            if _is_constexpr(param) or value is None:
                signature[name] = "constexpr"
                constexprs[name] = value
            else:
                signature[name] = _arg_type(value)
        entry = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": signature,
                 "constexprs": constexprs, "options": options}
        # one launch per code path: integer constexprs (block sizes, widths) are left out of the key,
        # flags (bool) and argument types are in it
        key = dict(entry, constexprs={k: v for k, v in constexprs.items() if not type(v) is int})
        seen.setdefault(json.dumps(key, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs, **options)

    InterpretedFunction.run = recording_run
    atexit.register(lambda: Path(path).write_text(json.dumps(list(seen.values()), indent=1)))


def compile_launches(path: str, arch: int = 90) -> list[str]:
    """Compile every launch recorded in ``path`` for ``cuda`` ``sm_<arch>``; returns the failures,
    one ``module.kernel: error`` line each (empty when everything compiled).

    Raises:
        ValueError: nothing was recorded.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = json.loads(Path(path).read_text())
    if not launches:
        raise ValueError(f"{path}: no kernel launch was recorded")
    failures = []
    for entry in launches:
        fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        src = ASTSource(fn=fn, signature=entry["signature"], constexprs=entry["constexprs"])
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=entry["options"])
            if not kernel.asm.get("cubin"):
                raise RuntimeError("no cubin")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, not only the first
            failures.append(f"{entry['module']}.{entry['kernel']}: {type(exc).__name__}: {str(exc)[:2000]}")
    return failures


def main(argv: list[str]) -> int:
    launches = json.loads(Path(argv[0]).read_text())
    failures = compile_launches(argv[0])
    kernels = sorted({f"{e['module']}.{e['kernel']}" for e in launches})
    print(f"compiled for sm_90: {len(launches) - len(failures)} of {len(launches)} launches "
          f"of {len(kernels)} kernels: {', '.join(k.rsplit('.', 1)[1] for k in kernels)}")
    for line in failures:
        print("FAILED", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
