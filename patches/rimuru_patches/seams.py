"""The seam registry: every place where sglang-rimuru changes SGLang.

A seam replaces one attribute of an SGLang module or class with a wrapper or a
subclass built from the original (never a copied function body). Each seam
says when it applies (CPU only, a rimuru mode, ...), and installation resolves
every target first: a target that moved or vanished in another SGLang release
stops the start with :class:`SeamTargetMissing`, naming the seam and target.

Seams are installed in every SGLang process: the launcher process, and each
spawned scheduler and detokenizer (see :mod:`rimuru_patches.bootstrap`).
``patches/README.md`` is the human-readable ledger of the same records.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Callable

from rimuru_patches.context import ProcessContext

logger = logging.getLogger(__name__)


class SeamTargetMissing(RuntimeError):
    """A seam's target does not exist in the installed SGLang."""


@dataclasses.dataclass(frozen=True)
class Seam:
    """One change to SGLang.

    ``target`` is ``"package.module:Attr"`` or ``"package.module:Class.attr"``.
    ``build(original, ctx)`` returns the replacement; it must wrap or subclass
    ``original``. ``applies(ctx)`` says whether this process needs the seam.
    """

    name: str
    target: str
    why: str
    build: Callable[[Any, ProcessContext], Any]
    applies: Callable[[ProcessContext], bool]

    def resolve(self) -> tuple[Any, str, Any]:
        """Return ``(owner, attribute name, current value)`` or raise."""
        module_name, _, path = self.target.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise SeamTargetMissing(
                f"seam {self.name!r}: cannot import {module_name} ({exc})"
            ) from exc
        *parents, attr = path.split(".")
        for part in parents:
            if not hasattr(owner, part):
                raise SeamTargetMissing(f"seam {self.name!r}: {module_name} has no {part!r} (target {self.target})")
            owner = getattr(owner, part)
        if not hasattr(owner, attr):
            raise SeamTargetMissing(f"seam {self.name!r}: target {self.target} does not exist in the installed SGLang")
        return owner, attr, getattr(owner, attr)


#: every seam, in installation order; filled by the modules that define them
REGISTRY: list[Seam] = []

_INSTALLED: dict[str, Any] = {}


def register(seam: Seam) -> Seam:
    if any(s.name == seam.name for s in REGISTRY):
        raise ValueError(f"seam {seam.name!r} registered twice")
    REGISTRY.append(seam)
    return seam


def verify(ctx: ProcessContext) -> list[Seam]:
    """Resolve every applicable seam's target without changing anything."""
    active = [s for s in REGISTRY if s.applies(ctx)]
    for seam in active:
        seam.resolve()
    return active


def install(ctx: ProcessContext) -> list[str]:
    """Install every applicable seam once per process; return their names."""
    for seam in verify(ctx):
        if seam.name in _INSTALLED:
            continue
        owner, attr, original = seam.resolve()
        setattr(owner, attr, seam.build(original, ctx))
        _INSTALLED[seam.name] = original
    return list(_INSTALLED)


def installed() -> list[str]:
    return list(_INSTALLED)


def original(name: str) -> Any:
    """The SGLang object a seam replaced in this process."""
    return _INSTALLED[name]
