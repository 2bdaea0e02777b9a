"""``rimuru_patches.card_cap``: an emulated card's limit on torch's allocator (bench only).

The arithmetic, the environment variable's errors, the seam's wrapper over a stand-in
``torch.cuda`` (the cap set after SGLang's device set-up, then following what comes to lie
outside torch: the host store's page-locking at once, graphs and kernels before forward
passes, never during a graph capture), and when the seams apply.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch

from rimuru_patches import card_cap
from tests.conftest import warm_run

MIB = 1 << 20
GIB = 1 << 30


def test_the_cap_is_the_card_less_what_lives_outside_torch_and_the_margin():
    # 141 GiB device, 1 GiB used of which torch holds 0.25 GiB: 0.75 GiB outside it
    total, free, reserved = 141 * GIB, 140 * GIB, GIB // 4
    assert card_cap.cap_bytes(32 * GIB, total, free, reserved) == 32 * GIB - 3 * GIB // 4 - card_cap.MARGIN_MIB * MIB
    with pytest.raises(ValueError, match="larger than the device's 144384 MiB"):
        card_cap.cap_bytes(142 * GIB, total, free, reserved)
    with pytest.raises(ValueError, match="leaves nothing for torch: 768 MiB are in use outside"):
        card_cap.cap_bytes(GIB, total, free, reserved)


def test_the_card_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(card_cap.ENV_VAR, raising=False)
    assert card_cap.card_mib() is None
    monkeypatch.setenv(card_cap.ENV_VAR, "32768")
    assert card_cap.card_mib() == 32768
    monkeypatch.setenv(card_cap.ENV_VAR, "32GB")
    with pytest.raises(ValueError, match=r"SGLANG_RIMURU_CARD_MIB='32GB': expected the emulated card's size in MiB"):
        card_cap.card_mib()
    monkeypatch.setenv(card_cap.ENV_VAR, "0")
    with pytest.raises(ValueError, match="must be positive"):
        card_cap.card_mib()


class FakeCuda:
    """The ``torch.cuda`` calls the seam makes, over numbers the test sets."""

    def __init__(self, total: int, free: int, reserved: int) -> None:
        self.total, self.free, self.reserved = total, free, reserved
        self.fractions: list[tuple[float, int]] = []
        self.capturing = False

    def current_device(self) -> int:
        return 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.free, self.total

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def get_device_properties(self, device):
        return SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        self.fractions.append((fraction, device))


def _fake_cuda(monkeypatch, fake: FakeCuda) -> None:
    for name in ("current_device", "mem_get_info", "memory_reserved", "get_device_properties",
                 "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
    monkeypatch.setattr(card_cap, "_CAP", None)


def test_the_seam_caps_after_sglangs_device_setup_and_the_cap_follows_what_lies_outside_torch(monkeypatch):
    fake = FakeCuda(total=128 * GIB, free=127 * GIB, reserved=0)
    _fake_cuda(monkeypatch, fake)
    monkeypatch.setenv(card_cap.ENV_VAR, str(32 * 1024))
    calls = []
    wrapped = card_cap._capped(lambda self: calls.append("sglang") or "result", None)
    assert wrapped(SimpleNamespace(device="cuda")) == "result" and calls == ["sglang"]
    margin = card_cap.MARGIN_MIB * MIB
    cap = 32 * GIB - GIB - margin
    assert fake.fractions == [(cap / (128 * GIB), 0)]
    t0 = card_cap._CAP.checked
    # torch reserves 20 GiB: free falls as much, nothing new outside torch, the cap stays
    fake.free, fake.reserved = 107 * GIB, 20 * GIB
    assert card_cap.follow(now=t0 + 5) == cap and len(fake.fractions) == 1
    # the host store's pinning takes 108 MiB outside torch: measured at once, whatever the clock says
    fake.free -= 108 * MIB
    assert card_cap.follow(now=t0 + 5, force=True) == cap - 108 * MIB
    assert fake.fractions[-1] == ((cap - 108 * MIB) / (128 * GIB), 0)
    # graphs and kernels take 600 MiB more: not measured again before FOLLOW_S, then followed
    fake.free -= 600 * MIB
    assert card_cap.follow(now=t0 + 5 + card_cap.FOLLOW_S / 2) == cap - 108 * MIB
    assert card_cap.follow(now=t0 + 5 + card_cap.FOLLOW_S) == cap - 708 * MIB
    assert fake.fractions[-1] == ((cap - 708 * MIB) / (128 * GIB), 0) and len(fake.fractions) == 3
    # outside torch alone past the card: cap 0, the next allocation fails as on the card
    fake.free -= 32 * GIB
    assert card_cap.follow(force=True) < 0 and fake.fractions[-1] == (0.0, 0)
    # plain CPU model runners and an unset card: nothing
    monkeypatch.setattr(card_cap, "_CAP", None)
    wrapped(SimpleNamespace(device="cpu"))
    monkeypatch.delenv(card_cap.ENV_VAR)
    wrapped(SimpleNamespace(device="cuda"))
    assert card_cap.follow(force=True) is None and len(fake.fractions) == 4


def test_forward_passes_measure_again_but_never_inside_a_graph_capture(monkeypatch):
    fake = FakeCuda(total=128 * GIB, free=127 * GIB, reserved=0)
    _fake_cuda(monkeypatch, fake)
    monkeypatch.setenv(card_cap.ENV_VAR, str(24 * 1024))
    card_cap._capped(lambda self: None, None)(SimpleNamespace(device="cuda"))
    card_cap._CAP.checked -= 2 * card_cap.FOLLOW_S  # the last measurement is old
    forward = card_cap._following(lambda self, batch: f"ran {batch}", None)
    fake.free -= 512 * MIB
    fake.capturing = True
    assert forward(None, "b1") == "ran b1" and len(fake.fractions) == 1
    fake.capturing = False
    assert forward(None, "b2") == "ran b2" and len(fake.fractions) == 2
    assert card_cap._CAP.cap == 24 * GIB - GIB - 512 * MIB - card_cap.MARGIN_MIB * MIB


def test_the_seam_applies_on_cuda_with_a_card_only():
    code = textwrap.dedent(
        """
        import os
        from rimuru_patches import all_seams, seams
        from rimuru_patches.context import ProcessContext
        all_seams.load()
        names = lambda device: sorted(s.name for s in seams.REGISTRY if s.applies(ProcessContext(device=device)))
        before = names("cuda")
        os.environ["SGLANG_RIMURU_CARD_MIB"] = "24576"
        print(before, names("cuda"), names("cpu").count("bench.card_cap"))
        [s.resolve() for s in seams.REGISTRY if s.name.startswith("bench.card_cap")]
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "['http.request_validation'] ['bench.card_cap', 'bench.card_cap_follow', 'http.request_validation'] 0")
