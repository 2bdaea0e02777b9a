"""Kernel tests run the Triton interpreter on CPU unless a CUDA GPU is present.

Triton decides interpreter-or-compiler when a kernel is defined, i.e. when
rimuru_kernels is imported, so the variable is set here, at conftest import,
before any test module imports triton or rimuru_kernels. Set TRITON_INTERPRET
yourself to override. With CUDA present the same tests run the compiled
kernels on the GPU.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Without an installed project, import the package from the checkout.
if importlib.util.find_spec("rimuru_kernels") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
