"""Bad command lines end the start with one clear line and a non-zero exit."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.conftest import launcher_cmd


def run_launcher(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(launcher_cmd(*args), capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_unknown_flag():
    proc = run_launcher("--definitely-not-a-flag", "3")
    assert_one_line_error(proc, "unrecognized arguments", "--definitely-not-a-flag")


def test_unknown_rimuru_mode():
    proc = run_launcher("--rimuru-mode", "sideways")
    assert_one_line_error(proc, "--rimuru-mode", "sideways")


def test_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = run_launcher("--model-path", str(missing))
    assert_one_line_error(proc, "--model-path", str(missing), "does not exist")


def test_port_already_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_launcher("--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(proc, f"--port {port}", "already in use")


def test_help_lists_sglang_and_rimuru_flags():
    proc = run_launcher("--help")
    assert proc.returncode == 0
    for flag in ("--model-path", "--tp-size", "--max-total-tokens", "--rimuru-mode"):
        assert flag in proc.stdout
    assert "sglang-rimuru options" in proc.stdout
