"""Recorders of the interpreted tests, set by tests/test_kernels.py:

* ``GRAFT_RECORD_LAUNCHES=<file>``: every kernel launch, for the GPU compile check
  (tests/kernel_launches.py);
* ``GRAFT_RECORD_LAUNCHER_OPS=<file>``: the torch ops each fused op's launcher issues besides its
  Triton launch (tests/launcher_ops.py)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("GRAFT_RECORD_LAUNCHES"):
    from kernel_launches import install_recorder

    install_recorder(os.environ["GRAFT_RECORD_LAUNCHES"])

if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("GRAFT_RECORD_LAUNCHER_OPS"):
    from launcher_ops import install_op_recorder

    install_op_recorder(os.environ["GRAFT_RECORD_LAUNCHER_OPS"])
