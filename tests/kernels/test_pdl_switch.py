"""`BLINK_PDL` chooses where programmatic dependent launch is used for the decode kernels (kernels/_common.pdl_on):
by default ("auto") in the steps of at most PDL_AUTO_MAX_TOKENS tokens (the batch-1 decode step) and nowhere else,
"1" in every step, "0" in none; never under Triton's interpreter (which has no such launch) or before Hopper; a
bad value is an error naming the variable. What it computes: tests/gpu_backend/test_pdl_gpu.py."""
import pytest
import torch

from kernels import _common


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    _common.pdl_mode.cache_clear()
    yield
    _common.pdl_mode.cache_clear()


def test_auto_by_default_on_in_the_one_token_steps_only(monkeypatch):
    monkeypatch.delenv("BLINK_PDL", raising=False)
    assert _common.pdl_mode() == "auto"
    assert not _common.pdl_on() and _common.pdl_launch() == {}          # outside a step
    with _common.pdl_step(1):
        assert _common.pdl_on() and _common.pdl_launch() == {"launch_pdl": True}
        with _common.pdl_step(_common.PDL_AUTO_MAX_TOKENS + 1):
            assert not _common.pdl_on()
        assert _common.pdl_on()                                          # the outer step's again
    with _common.pdl_step(64):
        assert not _common.pdl_on()


@pytest.mark.parametrize("value, one_token, many", [("1", True, True), ("0", False, False), (" AUTO ", True, False)])
def test_the_switch(monkeypatch, value, one_token, many):
    monkeypatch.setenv("BLINK_PDL", value)
    with _common.pdl_step(1):
        assert _common.pdl_on() is one_token
    with _common.pdl_step(256):
        assert _common.pdl_on() is many


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("BLINK_PDL", "yes")
    with pytest.raises(ValueError, match="BLINK_PDL"):
        _common.pdl_mode()


def test_off_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("BLINK_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _common.pdl_mode() == "off"
    with _common.pdl_step(1):
        assert not _common.pdl_on()


def test_off_before_hopper(monkeypatch):
    monkeypatch.setenv("BLINK_PDL", "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))  # an A100
    assert _common.pdl_mode() == "off" and _common.pdl_launch() == {}
