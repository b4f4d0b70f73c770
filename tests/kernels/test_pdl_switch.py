"""`BLINK_PDL` switches programmatic dependent launch on for the decode kernels (kernels/_common.pdl_on): off
by default, off under Triton's interpreter (which has no such launch), on where asked and the GPU is Hopper or
later (or no GPU: kernels/compile_check.py compiling for sm_90). What it computes: tests/gpu_backend/test_pdl_gpu.py."""
import pytest
import torch

from kernels import _common


@pytest.fixture(autouse=True)
def _fresh():
    _common.pdl_on.cache_clear()
    yield
    _common.pdl_on.cache_clear()


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("BLINK_PDL", raising=False)
    assert not _common.pdl_on() and _common.pdl_launch() == {}


def test_off_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("BLINK_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _common.pdl_on()


def test_on_when_asked_by_compute_capability(monkeypatch):
    monkeypatch.setenv("BLINK_PDL", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert not _common.pdl_on()                          # an A100: no programmatic launch
    _common.pdl_on.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert _common.pdl_on() and _common.pdl_launch() == {"launch_pdl": True}
