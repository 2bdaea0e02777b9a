"""A budget that cannot work, found inside a spawned scheduler, ends the start with one line.

On a GPU the pool's size is known only in the scheduler (the memory SGLang leaves
after loading weights), so that check cannot run in the launcher. The scheduler
hands its message to the launcher through a file (``rimuru_patches.start_errors``)
and exits; the launcher prints it as its one error line and stops every child.
On CPU the pool is always sized from flags, so the mechanism is tested here with
a stand-in scheduler; the H200 run starts a real one with too little memory.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str, env_file: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"}
    import os

    env.update({k: v for k, v in os.environ.items() if k.startswith(("PYTHON", "HOME", "VIRTUAL"))})
    if env_file is not None:
        env["SGLANG_RIMURU_START_ERROR"] = env_file
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)


CHILD = """
    from rimuru_patches.start_errors import one_line_start_errors
    from sglang_rimuru.plan import PlanError
    with one_line_start_errors(PlanError):
        raise PlanError("--mem-fraction-static (the GPU memory SGLang leaves for KV): a pool of 1.5 GiB\\n"
                        "cannot hold 40 resident experts")
    print("not reached")
"""


def test_child_writes_one_line_and_exits(tmp_path):
    err = tmp_path / "err.txt"
    err.write_text("")
    proc = run(CHILD, str(err))
    assert proc.returncode == 2 and "not reached" not in proc.stdout
    assert "Traceback" not in proc.stderr
    assert err.read_text() == ("--mem-fraction-static (the GPU memory SGLang leaves for KV): a pool of 1.5 GiB "
                               "cannot hold 40 resident experts\n")


def test_child_without_a_launcher_says_it_itself():
    proc = run(CHILD)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("python -m sglang_rimuru.launch_server: error: --mem-fraction-static (the GPU "
                                   "memory SGLang leaves for KV): a pool of 1.5 GiB cannot hold 40 resident experts")


LAUNCHER = """
import os, subprocess, sys, time
from rimuru_patches import start_errors
path = start_errors.publish_error_file()
def failed(line):
    print(f"{start_errors.PROG}: error: {line}", file=sys.stderr, flush=True)
    os._exit(start_errors.EXIT_CODE)
start_errors.watch(path, failed, interval=0.05)
child = "from rimuru_patches.start_errors import fail_start; fail_start('elastic budget too small')"
subprocess.run([sys.executable, "-c", child], env=dict(os.environ))
time.sleep(30)
print("not reached")
"""


def test_launcher_prints_the_childs_line_once_and_exits():
    # The launcher side: the watcher sees the child's line and ends the process with it.
    proc = run(LAUNCHER)
    assert proc.returncode == 2 and "not reached" not in proc.stdout
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert errors == ["python -m sglang_rimuru.launch_server: error: elastic budget too small"]
