"""``rimuru_patches.pass_timer``: the GPU time of forward passes beside the step record.

CUDA events are stood in for by objects whose completion the test controls; the
forward seam's use of it (decode and prefill passes timed with their kind, a capture not) runs
through ``unified_pool._forward`` with stand-in runtime and batches.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rimuru_patches import elastic, pass_timer
from rimuru_patches import unified_pool as up
from sglang_rimuru.adjuster.cost import CostModel


class FakeEvent:
    """Records the fake clock when recorded; done once the test says so."""

    clock = [0.0]
    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.t = None
        self.done = False

    def record(self) -> None:
        self.t, self.done = FakeEvent.clock[0], False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.t - self.t


def _pass(timer, batch, ms, kind="decode"):
    tok = timer.begin(batch, kind)
    FakeEvent.clock[0] += ms
    timer.end(tok)
    return tok[2], timer._pending[-1][3]


def test_finished_passes_come_back_in_order_and_the_running_one_waits():
    FakeEvent.clock[0], FakeEvent.made = 0.0, 0
    timer = pass_timer.PassTimer(FakeEvent)
    s1, e1 = _pass(timer, 4, 10.0)
    s2, e2 = _pass(timer, 5, 12.5)
    assert timer.collect() == []  # nothing finished yet
    e2.done = True  # the later one's flag alone cannot overtake the first: passes finish in order
    assert timer.collect() == []
    e1.done = True
    assert timer.collect() == [[4, 10.0, "decode"], [5, 12.5, "decode"]]
    assert timer.collect() == []
    # their four events are reused by the next passes: no new ones
    _pass(timer, 6, 1.0)
    _pass(timer, 6, 2.0)
    assert FakeEvent.made == 4


def test_unread_passes_are_capped():
    timer = pass_timer.PassTimer(FakeEvent, max_pending=3)
    ends = [_pass(timer, b, 1.0)[1] for b in range(1, 6)]
    for e in ends:
        e.done = True
    assert [b for b, _, _ in timer.collect()] == [3, 4, 5] and timer.dropped == 2


class FakeMemory:
    """``CudaMemory.span()`` over a peak and a reserved figure the test sets (MiB)."""

    def __init__(self) -> None:
        self.peak, self.reserved, self.spans = 0, 0, 0

    def span(self) -> tuple[int, int]:
        self.spans += 1
        out = self.peak << 20, self.reserved << 20
        self.peak = 0  # reset, as torch.cuda.reset_peak_memory_stats
        return out


def test_each_pass_gets_the_allocator_peak_up_to_the_next_pass():
    """A span runs from one pass's start to the next one's: what the pass, its sampling
    and anything between them took is charged to that pass; the last span stays open."""
    mem = FakeMemory()
    timer = pass_timer.PassTimer(FakeEvent, memory=mem)
    mem.peak, mem.reserved = 5, 100  # before the first pass: charged to nothing
    _pass(timer, 160, 1.0)
    mem.peak, mem.reserved = 900, 31000
    _pass(timer, 200, 1.0, "mixed")
    assert timer.collect_memory() == [["decode", 160, 900, 31000]]
    assert timer.collect_memory() == []
    mem.peak, mem.reserved = 2500, 33000
    _pass(timer, 240, 1.0)
    mem.peak, mem.reserved = 1400, 34000
    _pass(timer, 8, 1.0)
    assert timer.collect_memory() == [["mixed", 200, 2500, 33000], ["decode", 240, 1400, 34000]]
    assert mem.spans == 4


def test_cuda_memory_reads_the_peak_then_resets_it():
    calls = []
    cuda = SimpleNamespace(max_memory_allocated=lambda: calls.append("peak") or 3 << 20,
                           memory_reserved=lambda: calls.append("reserved") or 7 << 20,
                           reset_peak_memory_stats=lambda: calls.append("reset"))
    assert pass_timer.CudaMemory(cuda).span() == (3 << 20, 7 << 20)
    assert calls == ["peak", "reserved", "reset"]


@pytest.fixture
def seam(monkeypatch):
    """unified_pool's ModelRunner.forward wrapper over a stand-in runtime with a trace on CUDA."""
    monkeypatch.setattr(pass_timer, "_TIMER", None)
    monkeypatch.setattr(pass_timer, "_CHECKED", False)
    calls = []
    manager = SimpleNamespace(begin_forward=lambda: calls.append("begin"), end_forward=lambda: calls.append("end"))
    ctl = SimpleNamespace(trace_path="/tmp/x_trace.jsonl", before_forward=lambda: None, after_forward=lambda: None)
    runtime = SimpleNamespace(manager=manager, elastic=ctl, device=SimpleNamespace(type="cuda"),
                              log_stats_every=lambda n: None, cpu_split=None)
    monkeypatch.setattr(up, "_runtime", lambda: runtime)
    capturing = [False]
    monkeypatch.setattr(up.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(up.torch.cuda, "Event", lambda enable_timing: FakeEvent())
    monkeypatch.setattr(pass_timer, "CudaMemory", lambda cuda: FakeMemory())
    forward = up._forward(lambda self, fb: calls.append(("pass", fb.batch_size)) or "out", None)

    def run(decode: bool, batch: int, capture: bool = False, mixed: bool = False, idle: bool = False,
            tokens: int | None = None):
        capturing[0] = capture
        mode = SimpleNamespace(is_decode=lambda: decode, is_mixed=lambda: mixed,
                               is_extend=lambda: not decode and not idle)
        ids = None if tokens is None else up.torch.zeros(tokens, dtype=up.torch.int64)
        return forward(None, SimpleNamespace(batch_size=batch, forward_mode=mode, input_ids=ids))

    return run, calls, runtime


def test_the_forward_seam_times_passes_with_their_kind_but_not_captures(seam):
    run, calls, _ = seam
    assert run(True, 7) == "out"
    run(False, 12)  # a prefill of 12 requests
    run(False, 40, mixed=True)  # a prefill carrying the running decodes
    run(False, 0, idle=True)  # an idle pass (TP/DP padding): nothing to count
    run(True, 8, capture=True)  # a graph being captured: events may not be recorded there
    timer = pass_timer.current()
    assert [(b, k) for b, k, s, e in timer._pending] == [(7, "decode"), (12, "extend"), (40, "mixed")]
    assert [(k, b) for k, b, _, _ in timer.collect_memory()] == [("decode", 7), ("extend", 12)]  # 40's span is open
    assert calls == ["begin", ("pass", 7), "end", "begin", ("pass", 12), "end", "begin", ("pass", 40), "end",
                     "begin", ("pass", 0), "end", "begin", ("pass", 8), "end"]


def test_the_forward_seam_gives_the_cpu_split_each_passs_tokens(seam):
    """With the CPU split, each pass's token count goes to ``note_pass`` (decode: its batch;
    a prefill or mixed pass: all its tokens), after the host side is checked; not a pass
    being captured, nor one without input ids."""
    run, calls, runtime = seam
    noted = []
    runtime.cpu_split = SimpleNamespace(note_pass=noted.append)
    runtime.check_cpu_split = lambda: calls.append("check")
    run(True, 7, tokens=7)
    run(False, 3, mixed=True, tokens=2048 + 2)
    run(True, 8, capture=True, tokens=8)
    run(False, 0, idle=True)
    assert noted == [7, 2050]
    assert calls[:3] == ["check", "begin", ("pass", 7)]


def test_no_timer_without_a_trace_or_off_cuda(seam):
    run, _, runtime = seam
    runtime.elastic.trace_path = None
    run(True, 3)
    assert pass_timer.current() is None


def _step_timing(monkeypatch, tmp_path, refit_rounds: int, dump_s: float):
    """_StepTiming from a clean state, a fake-event timer, a settable clock (``now[0]``) and
    stand-ins for the controller (trace at ``tmp_path/e_trace.jsonl``) and the scheduler."""
    st = elastic._StepTiming
    for name, value in (("clock", None), ("last", None), ("before_last", False), ("reads_key", None),
                        ("reads", 0.0), ("batch_now", None), ("rounds", 0), ("pending", None), ("gpu_pending", []),
                        ("passes_pending", []), ("mem_pending", []), ("REFIT_ROUNDS", refit_rounds), ("DUMP_S", dump_s), ("dumped", 0.0)):
        monkeypatch.setattr(st, name, value)
    timer = pass_timer.PassTimer(FakeEvent, memory=FakeMemory())
    monkeypatch.setattr(pass_timer, "_TIMER", timer)
    now = [0.0]
    monkeypatch.setattr(elastic.time, "monotonic", lambda: now[0])
    adjuster = SimpleNamespace(cost=CostModel(expert_ms=0.3, base_ms=5.9, per_request_ms=0.17), last_seq=0,
                               in_flight=(), offloaded_token_probabilities=lambda: [],
                               token_probabilities=lambda: [])
    ctl = SimpleNamespace(adjuster=adjuster, trace_path=str(tmp_path / "e_trace.jsonl"))
    return st, timer, now, ctl, SimpleNamespace(tp_group=SimpleNamespace(world_size=1))


def test_the_step_record_carries_the_gpu_times(monkeypatch, tmp_path):
    """_StepTiming writes the passes finished since its last dump under "gpu"."""
    st, timer, now, ctl, scheduler = _step_timing(monkeypatch, tmp_path, refit_rounds=4, dump_s=1e9)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), reqs=[None] * 4)
    for i in range(8):
        st.round(scheduler, ctl, batch)
        _, end = _pass(timer, 4, 9.0)  # the round's pass, done by the next round
        end.done = True
        now[0] += 0.01
    lines = [json.loads(x) for x in (tmp_path / "e_trace.steps.jsonl").read_text().splitlines()]
    # rounds 2 and 3 time the first steps (the record starts at round 2, with the passes
    # finished by then), the dump closes round 3; then rounds 4-7 and their passes
    assert [len(line["steps"]) for line in lines] == [2, 4]
    assert [line["gpu"] for line in lines] == [[[4, 9.0]] * 3, [[4, 9.0]] * 4]


def test_prefill_passes_go_under_passes_and_the_record_is_written_every_dump_s(monkeypatch, tmp_path):
    """Rounds a second apart (a pass with experts out): the record is written every DUMP_S
    seconds, not only every REFIT_ROUNDS rounds; mixed and extend passes under "passes"."""
    st, timer, now, ctl, scheduler = _step_timing(monkeypatch, tmp_path, refit_rounds=256, dump_s=2.5)
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), reqs=[None] * 4)
    mixed = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False), reqs=[None] * 6)
    for i, batch in enumerate([decode, decode, decode, mixed, decode, decode, decode]):
        st.round(scheduler, ctl, batch)
        kind = "decode" if batch is decode else "mixed"
        _, end = _pass(timer, len(batch.reqs), 900.0, kind)
        end.done = True
        now[0] += 1.0
    lines = [json.loads(x) for x in (tmp_path / "e_trace.steps.jsonl").read_text().splitlines()]
    # round 2 (t=2 s) times the first step and opens the record, under DUMP_S since 0; round 3
    # (the mixed one, t=3 s) writes it with the first three passes; round 6 (t=6 s) times the
    # next step (the first decode interval after a prefill is never timed) and writes again
    assert [len(line["steps"]) for line in lines] == [1, 1]
    assert [line["passes"] for line in lines] == [[], [["mixed", 6, 900.0]]]
    assert [len(line["gpu"]) for line in lines] == [3, 2]
    # each pass's allocator span (closed when the next pass began) under "memory"
    assert [[(k, b) for k, b, _, _ in line["memory"]] for line in lines] == [
        [("decode", 4)] * 2, [("decode", 4), ("mixed", 6), ("decode", 4)]]
