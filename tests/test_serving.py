"""start_local_server against a stand-in launcher: port picking and the bind-collision retry."""

from __future__ import annotations

import socket
import sys
import textwrap

import pytest

from sglang_rimuru import serving

# Binds --port like uvicorn (printing uvicorn's message when it cannot) and
# answers /health; after a failed bind it hangs, as SGLang's launcher does.
_STAND_IN = textwrap.dedent(
    """
    import sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    try:
        srv = HTTPServer(("127.0.0.1", port), H)
    except OSError as e:
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): {e}", flush=True)
        time.sleep(600)
    srv.serve_forever()
    """
)


def test_free_port_is_outside_the_ephemeral_range():
    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    for _ in range(20):
        port = serving.free_port()
        assert not lo <= port <= hi
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.fixture
def squatter(tmp_path, monkeypatch):
    """The stand-in launcher in place of the real one, and a socket holding a port."""
    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    monkeypatch.setattr(serving, "launcher_cmd", lambda *args: [sys.executable, str(script), *args])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_a_taken_port_is_retried_on_a_new_one(tmp_path, monkeypatch, squatter):
    taken = squatter.getsockname()[1]
    picks = iter([taken, serving.free_port()])
    monkeypatch.setattr(serving, "free_port", lambda: next(picks))
    server = serving.start_local_server([], tmp_path / "log", timeout=60)
    try:
        assert server.url != f"http://127.0.0.1:{taken}"
    finally:
        server.stop()


def test_three_taken_ports_give_up_with_the_log(tmp_path, monkeypatch, squatter):
    monkeypatch.setattr(serving, "free_port", lambda: squatter.getsockname()[1])
    with pytest.raises(serving.ServerNotReady, match="three picked ports were taken"):
        serving.start_local_server([], tmp_path / "log", timeout=60)
