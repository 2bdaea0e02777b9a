"""Stand-in for flashinfer on the lent H200 (it cannot be carried: 15 MB + nvcc JIT).

SGLang 0.5.17 imports flashinfer unconditionally and calls its RMSNorm on every
forward; with the triton attention backend nothing else was called there.
"""

from . import norm  # noqa: F401


def bmm_fp8(*args, **kwargs):
    raise NotImplementedError("flashinfer stand-in: bmm_fp8 is not available on this machine")


__version__ = "0.0.0+standin"
