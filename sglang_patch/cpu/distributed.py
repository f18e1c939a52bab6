"""Tensor parallelism on a plain CPU: gloo groups, no CUDA communicators.

SGLang 0.5.23 builds every model-parallel group with ``init_model_parallel_group``
(``srt/distributed/parallel_state.py:2160``). Off its own CPU engine (``SGLANG_USE_CPU_ENGINE``, which
needs the CPU build of ``sgl_kernel``) the device counts as "other", so the group asks for a PyNccl
communicator (``use_pynccl = not (npu or xpu or mooncake)``, :2185) and custom all-reduce, and
``PyNcclCommunicator`` dies on a CPU device (``device_communicators/pynccl.py:116``: "Expected a cuda
device"). The groups' torch backend is already gloo there (``get_default_distributed_backend``,
:2396), and with no device communicator every collective of ``GroupCoordinator`` falls back to
``torch.distributed`` on that gloo group. `cpu_model_parallel_group` turns the device communicators
off, which is all ``--tp-size N --device cpu`` needs.
"""

from __future__ import annotations

TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def cpu_model_parallel_group(orig, *args, **kwargs):
    """AROUND hook on ``init_model_parallel_group``: the same group, without PyNccl, custom
    all-reduce, MSCCL++ or torch symmetric-memory all-reduce (none of them runs on a CPU)."""
    kwargs.update(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                  use_torch_symm_mem_allreduce=False)
    return orig(*args, **kwargs)
