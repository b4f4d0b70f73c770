"""bench/gpu_host.py's persistent window asks for no more tokens than the KV cache holds (no preemption timed)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
gpu_host = pytest.importorskip("gpu_host")


def _runner(num_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(block_size=16, max_num_batched_tokens=512), num_blocks=num_blocks)


def test_the_persistent_window_fits_the_kv_cache(capsys):
    prefill = gpu_host.prefill_steps(_runner(1), 64, 384)
    assert gpu_host.persistent_new_tokens(_runner(100_000), 64, 384, 64) == prefill + 4 * 64   # room: 4x the window
    tight = gpu_host.persistent_new_tokens(_runner(2_800), 64, 384, 64)                      # Qwen3-32B-like
    assert prefill + 64 < tight < prefill + 4 * 64 and 64 * (384 + tight) <= 2_800 * 16
    assert capsys.readouterr().err == ""
    gpu_host.persistent_new_tokens(_runner(1_700), 64, 384, 64)                               # under the window
    assert "expect preemption" in capsys.readouterr().err
