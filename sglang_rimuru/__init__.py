"""sglang-rimuru: MoE serving on SGLang with one elastic page pool for experts and KV.

The core (this package: pool, config, models) never imports SGLang; the
seams into SGLang live in ``rimuru_patches`` (folder ``patches/``), the Triton
kernels in ``rimuru_kernels`` (folder ``kernels/``).
"""

__version__ = "0.1.0"
