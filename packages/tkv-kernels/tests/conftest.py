"""Kernel tests run compiled on a CUDA GPU when there is one, else under the Triton CPU
interpreter. TRITON_INTERPRET must be set before triton is first imported (it decides at
@triton.jit time), hence here, at conftest import."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
