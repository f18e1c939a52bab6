"""Every Triton kernel the interpreter tests launch, compiled for a CUDA GPU without one.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on CPU tensors and never lowers
it, so a kernel can pass every interpreted test and still not compile for a GPU (a loop-carried
variable whose type changes, an op the interpreter accepts on a scalar and the compiler does not).
`install_recorder` records each distinct launch of the interpreted tests (kernel, argument types,
constexpr values, launch options) and `compile_launches` compiles each for an NVIDIA target
(``sm_90`` by default) down to a cubin with the ``ptxas`` shipped in Triton's wheel, on a machine
with no GPU, and holds every launch to `MAX_SPILL_BYTES` of register spills.

    TRITON_INTERPRET=1 GRAFT_RECORD_LAUNCHES=/tmp/l.json python -m pytest tests/interpret/...
    TRITON_CACHE_DIR=$(mktemp -d) python tests/kernel_launches.py /tmp/l.json [--usage]
    # exits 1 on a failure; --usage prints every launch's registers and spills
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import io
import json
import re
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
        # one launch per code path and tile shape: flags (bool), block sizes (integer constexprs named
        # B...) and argument types are in the key; other integer constexprs (widths, loop bounds) are not
        key = dict(entry, constexprs={k: v for k, v in constexprs.items() if type(v) is not int or k.startswith("B")})
        seen.setdefault(json.dumps(key, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs, **options)

    InterpretedFunction.run = recording_run
    atexit.register(lambda: Path(path).write_text(json.dumps(list(seen.values()), indent=1)))


#: the most spill-store bytes per thread a launch may have (ptxas -v): local-memory traffic in every
#: program of the kernel; whole-tile code (a [BLOCK, BLOCK] comparison held at once) goes far past it
MAX_SPILL_BYTES = 512


def _usage(log: str) -> tuple[int, str]:
    """``(spill store bytes, summary)`` from ptxas' ``-v`` log of one kernel."""
    lines = [line.split("info    :")[-1].strip() for line in log.splitlines()
             if "registers" in line or "spill" in line]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    return max(spills, default=0), "; ".join(lines)


def compile_launches(path: str, arch: int = 90) -> tuple[list[str], list[str]]:
    """Compile every launch recorded in ``path`` for ``cuda`` ``sm_<arch>`` (ptxas' log read through
    ``TRITON_DUMP_PTXAS_LOG``'s knob).

    Returns:
        ``(failures, usage lines)``: one ``module.kernel: error`` line per launch that did not
        compile or spills more than `MAX_SPILL_BYTES` (empty when none), and one line per launch
        with its constexprs, registers and spill bytes.
    Raises:
        ValueError: nothing was recorded.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = json.loads(Path(path).read_text())
    if not launches:
        raise ValueError(f"{path}: no kernel launch was recorded")
    failures, report = [], []
    logged: dict[str, tuple[int, str]] = {}
    knobs.nvidia.dump_ptxas_log = True
    for entry in launches:
        name = f"{entry['module']}.{entry['kernel']}"
        fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        src = ASTSource(fn=fn, signature=entry["signature"], constexprs=entry["constexprs"])
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=entry["options"])
            if not kernel.asm.get("cubin"):
                raise RuntimeError("no cubin")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, not only the first
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        spills, summary = _usage(log.getvalue())
        if summary:
            logged[kernel.hash] = (spills, summary)
        elif kernel.hash in logged:          # the same binary as an earlier launch of this run
            spills, summary = logged[kernel.hash]
        else:
            failures.append(f"{name}: no ptxas log (a cached kernel): run with an empty TRITON_CACHE_DIR")
            continue
        report.append(f"{entry['kernel']} {entry['constexprs']} {entry['options']}: {summary}")
        if spills > MAX_SPILL_BYTES:
            failures.append(f"{name} {entry['constexprs']}: {spills} bytes of spill stores per thread "
                            f"(limit {MAX_SPILL_BYTES}): {summary}")
    return failures, report


def main(argv: list[str]) -> int:
    """``kernel_launches.py LAUNCHES.json [--usage]``: compile, print a summary (and with ``--usage``
    every launch's registers and spills); exit status 1 when a launch failed."""
    launches = json.loads(Path(argv[0]).read_text())
    failures, report = compile_launches(argv[0])
    kernels = sorted({f"{e['module']}.{e['kernel']}" for e in launches})
    print(f"compiled for sm_90: {len(launches)} launches of {len(kernels)} kernels "
          f"({', '.join(k.rsplit('.', 1)[1] for k in kernels)}), {len(failures)} failed")
    if "--usage" in argv[1:]:
        for line in report:
            print(line)
    for line in failures:
        print("FAILED", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
