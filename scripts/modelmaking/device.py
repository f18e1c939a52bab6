"""Mixed precision for the training device: bf16 autocast on CUDA, plain float32 elsewhere.

Weights and optimiser state stay float32 on every device (checkpoints are written in float32;
``ship_models.py`` converts the shipped pair to bf16). On CPU nothing changes, so CPU builds stay
bit-reproducible for a seed, machine and thread count.
"""

from __future__ import annotations

import contextlib

import torch


def autocast(device: str | torch.device):
    """``torch.autocast`` in bfloat16 on CUDA (TF32 matmuls enabled), a no-op context elsewhere."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return torch.autocast("cuda", dtype=torch.bfloat16)
