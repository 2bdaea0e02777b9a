"""Expert-residency tests run on CPU; the paged-kernel wiring test uses the Triton
interpreter, which must be chosen before anything imports rimuru_kernels (as in
tests/kernels/conftest.py). With CUDA present nothing is set."""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
