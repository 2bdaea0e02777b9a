"""Shared test helpers: servers started through the project's launcher.

Servers come from ``sglang_rimuru.serving`` (own process group, log file under
pytest's tmp dir, stopped by killing the whole group).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from sglang_rimuru.serving import LocalServer, launcher_cmd, start_local_server  # noqa: F401 (re-exported)

STARTUP_TIMEOUT_S = float(os.environ.get("RIMURU_TEST_STARTUP_TIMEOUT", "300"))


#: a server started for a test (url, proc, log_path; .log(), .stop())
Server = LocalServer


#: SGLang's own range checks on KV writes (``set_kv_buffer``: ``0 <= loc < size + page_size``).
#: On a GPU the JIT KV store asserts the same; on CPU nothing would, so a pool that
#: hands SGLang an id past its KV pool would pass every CPU test (it did, at 0dafc5d).
CHECKED_SGLANG = {"SGLANG_ENABLE_ASYNC_ASSERT": "1"}


def zipf_layer(num_experts: int = 60, top_k: int = 4) -> list[float]:
    """One MoE layer's per-token routing probabilities, Zipf-like (expert i's weight 1/(i+1),
    scaled to sum to ``top_k``): the few hot experts saturate early in the batch. The shape
    of Qwen1.5-MoE's layer by default."""
    w = [1.0 / (i + 1) for i in range(num_experts)]
    return [top_k * x / sum(w) for x in w]


def bench_module(relpath: str):
    """A script under bench/ (not a package) loaded as a module by its path, e.g.
    ``bench_module("device/profile_decode.py")``."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def start_server(args: list[str], log_path: Path, env: dict | None = None) -> Server:
    """A server through the launcher, forked from the warm interpreter (saves the ~14 s
    its imports of torch and the web stack take; SGLang's own processes start fresh).
    With a GPU it starts as a fresh process instead: SGLang's imports ask CUDA for the
    device's capability, which torch refuses in a child forked from an interpreter that
    touched CUDA ("Cannot re-initialize CUDA in forked subprocess", the H200, 2026-12-03)."""
    import torch

    popen = None if torch.cuda.is_available() else warm_popen
    return start_local_server(args, log_path, timeout=STARTUP_TIMEOUT_S, env={**CHECKED_SGLANG, **(env or {})},
                              popen=popen)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """Where the tests' generated models live (shared by the whole session)."""
    return Path(os.environ.get("SGLANG_RIMURU_CACHE", tmp_path_factory.mktemp("models")))


def generate(server: Server, text, max_new_tokens: int = 8, *, top_logprobs: int = 0, **params) -> dict | list:
    """A greedy ``/generate`` (``params``: more sampling parameters); with ``top_logprobs``
    each step's best that many tokens and their log-probabilities come back too (the
    reference ``assert_greedy_equal_up_to_ties`` needs: 2)."""
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **params}}
    if top_logprobs:
        body |= {"return_logprob": True, "top_logprobs_num": top_logprobs}
    resp = requests.post(server.url + "/generate", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()


#: how far apart (in log-probability) the reference's best two tokens may be where a greedy
#: run first picks the second of them: one bf16 step of a logit below 16 (2**-4). The tiny
#: models' logits are bf16, so their best two are often exactly tied or one step (0.03125)
#: apart (measured: half the burst's requests have an exact tie somewhere in 24 steps),
#: and a batch of another size sums the products in another order and can tip it; a wrong
#: expert or a stale page moves logits by far more, and parts at the first step it touches.
TIE_LOGPROB_GAP = 0.0625


def assert_greedy_equal_up_to_ties(got: list[int], reference: dict, gap: float = TIE_LOGPROB_GAP) -> None:
    """``got`` equals the reference's greedy ids (a ``generate`` answer with ``top_logprobs=2``),
    or first leaves them where the reference's best two tokens lay within ``gap`` and ``got``
    took the second; after that the contexts differ, so nothing more is compared."""
    want = reference["output_ids"]
    assert len(got) == len(want), (got, want)
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        return
    (lp0, id0, *_), (lp1, id1, *_) = reference["meta_info"]["output_top_logprobs"][k][:2]
    assert id0 == want[k] and id1 == got[k] and lp0 - lp1 <= gap, \
        f"greedy ids part at step {k}: got {got[k]}, reference {want[k]}; reference's best two " \
        f"{[(id0, round(lp0, 4)), (id1, round(lp1, 4))]} (gap allowed {gap})"


def greedy_ids_or_reference(server: Server, text, max_new_tokens: int, reference: bool) -> list[int] | dict:
    """A greedy request's ids; as a reference (the mode off server) its whole answer, with
    each step's best two tokens for ``assert_greedy_equal_up_to_ties``."""
    out = generate(server, text, max_new_tokens, top_logprobs=2 if reference else 0)
    return out if reference else out["output_ids"]


def assert_all_greedy_equal_up_to_ties(got: list[list[int]], references: list[dict]) -> None:
    """``assert_greedy_equal_up_to_ties`` for each of a batch's answers, in order."""
    assert len(got) == len(references)
    for ids, ref in zip(got, references):
        assert_greedy_equal_up_to_ties(ids, ref)


def openai_completion(server: Server, prompt: str, max_tokens: int = 8) -> dict:
    """A greedy ``/v1/completions`` request (EOS ignored: always ``max_tokens`` tokens)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()


def run_dsl_program(server: Server, topics: list[str]) -> list[dict]:
    """A frontend DSL program with ``gen``, ``select`` and ``fork`` (greedy), run once per topic as a batch.

    Each state's answer, verdict and the two forks' ideas.
    """
    import sglang as sgl

    @sgl.function
    def program(s, topic):
        s += "Topic: " + topic + "\n"
        s += "Answer: " + sgl.gen("answer", max_tokens=6, temperature=0)
        s += "\nVerdict: " + sgl.select("verdict", choices=["yes", "no", "maybe"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i}: " + sgl.gen("idea", max_tokens=4, temperature=0)
        forks.join()
        s["ideas"] = [f["idea"] for f in forks]

    backend = sgl.RuntimeEndpoint(server.url)
    states = program.run_batch([{"topic": t} for t in topics], backend=backend) if len(topics) > 1 else [
        program.run(topic=topics[0], backend=backend)]
    return [{"answer": st["answer"], "verdict": st["verdict"], "ideas": st["ideas"]} for st in states]


class WarmPython:
    """``tests/warm_python.py``: one interpreter that imported torch and the web stack
    once, forking a child per command line (saves ~14 s a run). Started on first use,
    killed when the test session's process exits."""

    def __init__(self) -> None:
        import atexit
        import threading

        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "warm_python.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        atexit.register(self.proc.kill)
        if '"ready"' not in (self.proc.stdout.readline() or ""):
            raise RuntimeError(f"tests/warm_python.py did not start (exit {self.proc.poll()})")

    def ask(self, msg: dict) -> dict:
        import json

        with self.lock:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"tests/warm_python.py exited ({self.proc.poll()})")
        return json.loads(reply)

    def run(self, args: list[str], *, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """What ``subprocess.run([sys.executable, *args], capture_output=True, text=True)``
        returns; a run past ``timeout`` raises ``subprocess.TimeoutExpired`` as that would."""
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            res = self.ask({"args": list(args), "env": dict(os.environ if env is None else env), "cwd": os.getcwd(),
                            "stdout": f"{d}/out", "stderr": f"{d}/err", "timeout": timeout})
            out, err = Path(f"{d}/out").read_text(), Path(f"{d}/err").read_text()
        if res["timed_out"]:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, out, err)
        return subprocess.CompletedProcess([sys.executable, *args], res["rc"], out, err)


class WarmChild:
    """A command line running in the background in a child of the warm interpreter, in a
    session of its own: what the test servers need of a ``subprocess.Popen``."""

    def __init__(self, warm: WarmPython, pid: int) -> None:
        self.warm, self.pid, self.returncode = warm, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.warm.ask({"poll": self.pid})["rc"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode


_warm: WarmPython | None = None


def _warm_python() -> WarmPython:
    global _warm
    if _warm is None or _warm.proc.poll() is not None:
        _warm = WarmPython()
    return _warm


def warm_popen(cmd: list[str], log_path: Path, env: dict) -> WarmChild:
    """``start_local_server``'s ``popen``: ``cmd`` (``python ARGS``) forked from the warm
    interpreter, its output appended to ``log_path``."""
    assert cmd[0] == sys.executable, cmd
    warm = _warm_python()
    reply = warm.ask({"args": cmd[1:], "env": env, "cwd": os.getcwd(), "spawn": True, "log": str(log_path)})
    return WarmChild(warm, reply["pid"])


def warm_run(args: list[str], *, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (``-m MOD ...``, ``-c CODE``, ``SCRIPT ...``) as a fresh
    interpreter would, in a child of the warm interpreter (:class:`WarmPython`)."""
    return _warm_python().run(args, env=env, timeout=timeout)


def run_sglang_cpu_script(name: str, timeout: float = 300) -> None:
    """Run ``tests/sglang_cpu/<name>`` in a fresh interpreter (importing SGLang needs the
    CPU stand-in installed first); it must exit 0 and print ``OK`` last."""
    script = Path(__file__).parent / "sglang_cpu" / name
    out = warm_run([str(script)], timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
