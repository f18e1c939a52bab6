"""The one switch of the CPU layer: is this process running SGLang on a plain CPU?

SGLang 0.5.23 picks kernels per device at import time (``_is_cuda``/``_is_cpu``/... module flags,
e.g. ``kernels/ops/speculative/spec_tree.py:25-30``). Its own CPU path (``is_cpu()``,
``srt/utils/common.py:221``) needs ``SGLANG_USE_CPU_ENGINE=1`` plus the CPU build of ``sgl_kernel``
(not on PyPI). Without them, and without a GPU, the speculative kernels have no implementation;
that is the case this layer covers.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "GRAFT_SGLANG_CPU_LAYER"


def cpu_layer_enabled() -> bool:
    """Whether the torch replacements should be registered in this process.

    Returns ``True`` when no accelerator torch knows about (CUDA/ROCm, XPU, MPS) is usable and
    SGLang's own ``sgl_kernel`` CPU engine is not selected. ``GRAFT_SGLANG_CPU_LAYER=1`` forces the
    layer on (tests on a GPU host), ``=0`` forces it off.

    Source: SGLang 0.5.23 ``srt/utils/common.py:221`` (``is_cpu``) and ``:227`` (``is_musa``).
    """
    forced = os.environ.get(ENV_VAR)
    if forced is not None and forced.strip() != "":
        return forced.strip() not in ("0", "false", "False", "no")
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        return False
    if torch.cuda.is_available():
        return False
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return False
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return False
    return True
