"""A Python that has already imported the heavy third-party modules, forking one child per job.

Many tests run a fresh interpreter (``python -m sglang_rimuru.launch_server BAD-FLAGS``,
``python tests/sglang_cpu/X.py``, ``python -c CODE``) because SGLang may be imported
only after the CPU stand-in is installed, and seams must not leak between tests. Each
such interpreter spent ~14 of its ~20 s importing torch, transformers, scipy and the
web stack before doing anything. This process imports those once (never SGLang or the
project: a child must install the stand-in and its seams before SGLang is imported, as
a real launcher does) and then forks a child per job, which runs the job as that command
line would: same ``sys.argv``, ``sys.path[0]``, working directory and environment, its
stdout/stderr in files, its exit status.

Protocol (``tests/conftest.py``'s :class:`WarmPython` speaks it), one JSON object a line
each way:

* ``{"args", "env", "cwd", "stdout", "stderr", "timeout"}``: run to the end; ``args`` is
  what follows ``python`` on a command line (``-m MOD ...``, ``-c CODE ...`` or
  ``SCRIPT ...``); back ``{"rc", "timed_out"}``;
* the same with ``"spawn": true`` and ``"log"`` (stdout and stderr, appended): start it
  in a session of its own, as ``Popen(start_new_session=True)`` would (the test servers);
  back ``{"pid"}`` at once;
* ``{"poll": PID}``: a spawned child's exit status, reaped here; back ``{"rc"}`` (null
  while it runs).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

#: third-party modules only; importing them before the CPU stand-in changes nothing
#: (it replaces sgl_kernel and sets SGLang's own environment switches).
PREIMPORT = ("torch", "numpy", "transformers", "scipy", "scipy.sparse", "sympy", "pandas", "fastapi",
             "uvicorn", "openai", "requests", "psutil")
#: never imported ahead: SGLang and the project (the stand-in and seams come first in a
#: child), and the GPU stacks whose import probes the platform
NOT_AHEAD = {"sglang", "sgl_kernel", "sglang_rimuru", "rimuru_patches", "rimuru_kernels", "kernels", "flashinfer",
             "cutlass", "cuda", "cudnn", "triton", "triton_kernels", "tvm_ffi", "torch_memory_saver", "deep_gemm",
             "__main__", "__mp_main__"}
#: the command line whose imports are learned and made ahead (the launcher's help: every
#: module a launcher imports before it reads its flags)
LEARN = ["-m", "sglang_rimuru.launch_server", "--help"]


#: the reply pipe: a child closes its copy (a server outliving a test must not hold it)
REPLY_FD: int | None = None


def run_job(job: dict) -> None:
    """In the forked child: become the command line, run it, exit with its status."""
    if REPLY_FD is not None:
        os.close(REPLY_FD)
    if job.get("spawn"):
        os.setsid()
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    else:
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0, closefd=False)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    args = job["args"]
    code = 0
    try:
        if args[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *args[2:]], ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif args[0] == "-m":
            sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # SystemExit("message"): printed, status 1, as the interpreter does
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def wait(pid: int, timeout: float) -> tuple[int, bool]:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(0.02)


def learn_imports() -> list[str]:
    """The third-party modules a launcher imports, in import order: one forked child runs
    ``LEARN`` and lists what it added to ``sys.modules``."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        before = set(sys.modules)
        pid = os.fork()
        if pid == 0:
            def dump() -> None:
                names = [n for n in sys.modules if n not in before and n.split(".")[0] not in NOT_AHEAD]
                with open(f"{d}/modules", "w") as f:
                    f.write("\n".join(names))

            _exit = os._exit  # run_job ends in os._exit, which skips atexit: dump on the way out
            os._exit = lambda code: (dump(), _exit(code))
            run_job({"args": LEARN, "env": dict(os.environ), "cwd": os.getcwd(),
                     "stdout": os.devnull, "stderr": os.devnull})
        wait(pid, 300)
        try:
            return [n for n in open(f"{d}/modules").read().split("\n") if n]
        except OSError:
            return []


def main() -> None:
    import importlib
    import warnings

    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in learn_imports():
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except BaseException:  # a module that needs what runs before it in a launcher: skip
                    pass
    global REPLY_FD
    reply = os.fdopen(os.dup(1), "w")
    REPLY_FD = reply.fileno()
    print(json.dumps({"ready": True}), file=reply, flush=True)
    spawned: dict[int, int | None] = {}  # pid -> exit status once reaped
    for line in sys.stdin:
        job = json.loads(line)
        if "poll" in job:
            pid = job["poll"]
            if spawned.get(pid) is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    spawned[pid] = os.waitstatus_to_exitcode(status)
            print(json.dumps({"rc": spawned.get(pid)}), file=reply, flush=True)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_job(job)
        if job.get("spawn"):
            spawned[pid] = None
            print(json.dumps({"pid": pid}), file=reply, flush=True)
            continue
        rc, timed_out = wait(pid, job.get("timeout", 300))
        print(json.dumps({"rc": rc, "timed_out": timed_out}), file=reply, flush=True)


if __name__ == "__main__":
    main()
