"""Start-up errors found inside a spawned scheduler, reported as one launcher line.

Some checks can only run in the scheduler: on a GPU the pool's size is the
memory SGLang leaves after loading the weights, known only there. SGLang
reports any exception in a scheduler as a traceback and then kills the
launcher with SIGQUIT. For a bad budget that is the wrong answer: the user
needs one line naming the flag.

So the scheduler writes the message to a file the launcher named
(``SGLANG_RIMURU_START_ERROR``, inherited through the environment) and
leaves at once (``os._exit``, no traceback); a thread in the launcher
watches that file, stops every child and exits with the same one line as a
command-line error (``python -m sglang_rimuru.launch_server: error: ...``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time

ENV_VAR = "SGLANG_RIMURU_START_ERROR"
PROG = "python -m sglang_rimuru.launch_server"
EXIT_CODE = 2


class StartError(Exception):
    """A budget or setting that cannot work, found after SGLang started (one line)."""


def fail_start(message: str) -> None:
    """In a spawned process: hand ``message`` to the launcher and leave now."""
    line = " ".join(str(message).split())
    path = os.environ.get(ENV_VAR)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    else:  # not under the launcher (a test, an Engine): say it ourselves
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


@contextlib.contextmanager
def one_line_start_errors(*kinds: type[BaseException]):
    """Turn ``kinds`` (and :class:`StartError`) raised in the block into :func:`fail_start`."""
    try:
        yield
    except (StartError, *kinds) as exc:
        fail_start(str(exc))


def publish_error_file() -> str:
    """In the launcher, before SGLang spawns anything: the file the children write to."""
    fd, path = tempfile.mkstemp(prefix="sglang-rimuru-start-error-", suffix=".txt")
    os.close(fd)
    os.environ[ENV_VAR] = path
    return path


def watch(path: str, on_error, interval: float = 0.2) -> threading.Thread:
    """Call ``on_error(first line)`` once ``path`` holds a child's message (daemon thread)."""

    def run() -> None:
        while True:
            try:
                text = open(path).read().strip()
            except FileNotFoundError:
                return
            if text:
                on_error(text.splitlines()[0])
                return
            time.sleep(interval)

    thread = threading.Thread(target=run, name="sglang-rimuru-start-errors", daemon=True)
    thread.start()
    return thread


def read(path: str) -> str | None:
    try:
        text = open(path).read().strip()
    except FileNotFoundError:
        return None
    return text.splitlines()[0] if text else None
