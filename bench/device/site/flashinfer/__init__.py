"""Stand-in for flashinfer on the lent H200 (it cannot be carried: 15 MB + nvcc JIT).

SGLang 0.5.17 imports flashinfer modules at import time on CUDA and calls its
RMSNorm (``norm``, implemented in torch here) on every forward; with the
triton attention backend and pytorch sampling nothing else is called. Every
other ``flashinfer.<sub>`` module and attribute resolves to a stub whose call
raises NotImplementedError naming it.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+standin"


class _Stub:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"flashinfer stand-in: {self._name} is not available on this machine")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    REAL = {"flashinfer.norm"}

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("flashinfer.") and fullname not in self.REAL:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Stub(f"flashinfer.{attr}")


from . import norm  # noqa: E402,F401
