"""``rimuru_patches.card_cap``: an emulated card's limit on torch's allocator (bench only).

The arithmetic, the environment variable's errors, the seam's wrapper over a stand-in
``torch.cuda`` (the cap set after SGLang's device set-up, lowered by the host store's
page-locking), and when the seam applies.
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


def test_the_seam_caps_after_sglangs_device_setup_and_pinning_lowers_it(monkeypatch):
    fake = FakeCuda(total=128 * GIB, free=127 * GIB, reserved=0)
    for name in ("current_device", "mem_get_info", "memory_reserved", "get_device_properties",
                 "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(card_cap, "_CAP", None)
    monkeypatch.setenv(card_cap.ENV_VAR, str(32 * 1024))
    calls = []
    wrapped = card_cap._capped(lambda self: calls.append("sglang") or "result", None)
    assert wrapped(SimpleNamespace(device="cuda")) == "result" and calls == ["sglang"]
    cap = 32 * GIB - GIB - card_cap.MARGIN_MIB * MIB
    assert fake.fractions == [(cap / (128 * GIB), 0)]
    card_cap.lower_by(108 * MIB, cuda=fake)
    assert fake.fractions[-1] == ((cap - 108 * MIB) / (128 * GIB), 0)
    # plain CPU model runners and an unset card: nothing
    monkeypatch.setattr(card_cap, "_CAP", None)
    wrapped(SimpleNamespace(device="cpu"))
    monkeypatch.delenv(card_cap.ENV_VAR)
    wrapped(SimpleNamespace(device="cuda"))
    card_cap.lower_by(MIB, cuda=fake)
    assert len(fake.fractions) == 2


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
        seams.REGISTRY[[s.name for s in seams.REGISTRY].index("bench.card_cap")].resolve()
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "['http.request_validation'] ['bench.card_cap', 'http.request_validation'] 0")
