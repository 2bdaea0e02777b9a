"""Shared test helpers: SGLang servers started through the project's launcher.

Each server runs in its own process group (SGLang spawns a scheduler per TP
rank and a detokenizer; a crashed scheduler can orphan them), logs to a file
under pytest's tmp dir, and is stopped by killing the whole group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

STARTUP_TIMEOUT_S = float(os.environ.get("RIMURU_TEST_STARTUP_TIMEOUT", "300"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
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


def start_server(args: list[str], log_path: Path, env: dict | None = None) -> Server:
    port = free_port()
    cmd = launcher_cmd("--host", "127.0.0.1", "--port", str(port), *args)
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    server = Server(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start:\n{server.log()[-4000:]}")
        try:
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """Where the tests' generated models live (shared by the whole session)."""
    return Path(os.environ.get("SGLANG_RIMURU_CACHE", tmp_path_factory.mktemp("models")))


def generate(server: Server, text, max_new_tokens: int = 8, **params) -> dict | list:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **params}}
    resp = requests.post(server.url + "/generate", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()
