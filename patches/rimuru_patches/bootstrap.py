"""Per-process installation of the project's patches.

Every process of a rimuru server runs :func:`bootstrap_process` before SGLang
is imported: the launcher calls it first thing, and SGLang's spawned children
(schedulers, detokenizer) run it because multiprocessing's spawn start method
re-imports the launcher module (``sglang_rimuru.launch_server``) as
``__mp_main__`` in each child before unpickling the child's target. The
launcher publishes a :class:`ProcessContext` in the environment, which the
children inherit; a process without one (a plain ``import``) is left alone.
"""

from __future__ import annotations

import os
import sys

from rimuru_patches.context import ProcessContext

_done = False


def bootstrap_process(ctx: ProcessContext | None = None, *, announce: bool = False) -> ProcessContext | None:
    """Prepare this process and install every applicable seam. Idempotent.

    ``announce`` prints one line naming the installed seams (used in spawned
    children, so a server log shows the seams are live in every process).
    """
    global _done
    ctx = ctx or ProcessContext.from_env()
    if ctx is None or _done:
        return ctx
    if ctx.on_cpu:
        from rimuru_patches import cpu_platform

        cpu_platform.prepare_process(ctx)
    from rimuru_patches import all_seams, seams

    all_seams.load()
    names = seams.install(ctx)
    _done = True
    if announce:
        print(
            f"[sglang-rimuru] pid {os.getpid()}: {len(names)} seams installed"
            f" ({', '.join(names) or 'none'})",
            file=sys.stderr,
            flush=True,
        )
    return ctx
