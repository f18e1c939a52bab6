"""With ``GRAFT_RECORD_LAUNCHES=<file>`` (tests/test_kernels.py sets it), every kernel launch of these
interpreted tests is recorded there for the GPU compile check (tests/kernel_launches.py)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("GRAFT_RECORD_LAUNCHES"):
    from kernel_launches import install_recorder

    install_recorder(os.environ["GRAFT_RECORD_LAUNCHES"])
