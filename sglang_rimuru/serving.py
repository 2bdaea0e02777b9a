"""A rimuru server as a child process: start it, wait until it answers, stop it.

Used by ``python -m sglang_rimuru.rank``, the demo client and the tests. The
server runs in its own process group (SGLang spawns a scheduler per TP rank
and a detokenizer; a crashed scheduler can orphan them), so stopping it ends
the whole group. Plain Python: the server is reached over HTTP only.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class ServerNotReady(RuntimeError):
    """The server exited while starting, or did not answer /health in time."""


# Below Linux's default ephemeral range (32768-60999). A port the kernel hands
# out for bind(0) is an ephemeral one, and during the seconds a server takes
# to start, any outgoing connection on the machine (the server's own
# torch.distributed store, a test's HTTP client) may be given that same port:
# CI saw uvicorn fail with "address already in use" exactly so.
_PORT_RANGE = (20000, 32000)
BIND_FAILED = "error while attempting to bind"


def free_port() -> int:
    """A loopback port free now, outside the ephemeral range."""
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_PORT_RANGE}")


class PortTaken(ServerNotReady):
    """The HTTP server could not bind its port (someone took it after it was picked)."""


def wait_healthy(
    url: str, timeout: float, proc: subprocess.Popen | None = None, log_path: Path | None = None
) -> None:
    """Poll ``url/health`` once a second; raise ServerNotReady if ``proc`` dies or time runs out.

    With ``log_path``, a bind failure in the log raises PortTaken at once:
    SGLang's launcher does not exit after uvicorn fails to bind, it hangs.
    """
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerNotReady(f"the server exited with {proc.returncode} while starting")
        if log_path is not None and BIND_FAILED in log_path.read_text(errors="replace"):
            raise PortTaken(f"the server could not bind {url}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise ServerNotReady(f"the server at {url} was not healthy after {timeout:.0f} s")


@dataclasses.dataclass
class LocalServer:
    url: str
    proc: subprocess.Popen  # or what start_local_server's ``popen`` returned
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children that outlived the launcher
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_rimuru.launch_server", *args]


def popen_in_own_group(cmd: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    """The server's process: its own process group, stdout and stderr into ``log_path``."""
    with open(log_path, "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def start_local_server(
    args: list[str], log_path: str | Path, *, timeout: float = 300, env: dict | None = None, popen=None
) -> LocalServer:
    """Start ``launch_server`` on a free loopback port with ``args`` and wait for /health.

    A port taken between picking and binding is retried on a new port (twice).
    On failure the server is stopped and ServerNotReady carries the log's tail.
    ``popen(cmd, log_path, env)`` starts the process (default :func:`popen_in_own_group`;
    the tests pass one that forks it from a pre-warmed interpreter); what it returns
    needs ``pid``, ``returncode``, ``poll()`` and ``wait(timeout)`` as a Popen has.
    """
    log_path = Path(log_path)
    popen = popen or popen_in_own_group
    for attempt in range(3):
        port = free_port()
        log_path.write_text("")
        proc = popen(launcher_cmd("--host", "127.0.0.1", "--port", str(port), *args), log_path,
                     {**os.environ, **(env or {})})
        server = LocalServer(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
        try:
            wait_healthy(server.url, timeout, proc, log_path)
            return server
        except PortTaken:
            server.stop()
            if attempt == 2:
                raise ServerNotReady(f"three picked ports were taken; log ({log_path}):\n{server.log()[-4000:]}")
        except ServerNotReady as exc:
            server.stop()
            raise ServerNotReady(f"{exc}; its log ({log_path}) ends:\n{server.log()[-4000:]}") from None
    raise AssertionError("unreachable")
