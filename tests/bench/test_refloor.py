"""bench/refloor.py and the floor a decode step reads: the embedding table counts only for its looked-up rows."""

from __future__ import annotations

import json

import pytest
import torch

from bench.refloor import main, model_of, refloor
from gpu_backend.models.presets import PRESETS


def test_a_recorded_floor_loses_the_unread_table_at_the_rows_own_rate():
    # Llama-3-8B, batch 1: 16.06 GB moved at 3,000 GB/s; the table's other 128,255 rows (1.05 GB) are not read
    row = {"batch": 1, "bare_step_ms": 6.0, "floor_ms": 16.06e9 / 3000e9 * 1e3, "achieved_gbps": 16.06e9 / 6.0e6}
    got = refloor(row, "llama-3-8b")
    unread = 128255 * 4096 * 2
    assert got["unread_embedding_gb"] == pytest.approx(unread / 1e9, abs=1e-3)
    assert got["floor_ms"] == pytest.approx((16.06e9 - unread) / 3000e9 * 1e3, abs=1e-3)
    assert got["ratio"] > got["ratio_recorded"]


def test_tied_tables_are_read_whole_by_the_lm_head():
    row = {"batch": 1, "bare_step_ms": 1.0, "floor_ms": 0.5, "achieved_gbps": 1000.0}
    tied = [name for name, cfg in PRESETS.items() if cfg.tie_word_embeddings]
    assert tied, "no preset with tied embeddings"
    assert refloor(row, tied[0])["floor_ms"] == 0.5


def test_the_config_counts_the_unread_rows_only_when_the_table_is_not_the_lm_head():
    untied = PRESETS["llama-3-8b"]
    vocab, hidden = untied.vocab_size, untied.hidden_size
    assert untied.unread_embedding_params(3) == (vocab - 3) * hidden and untied.unread_embedding_params(vocab + 1) == 0
    assert untied.replace(tie_word_embeddings=True).unread_embedding_params(1) == 0


def test_run_labels_name_their_presets_and_the_cli_writes_every_row(tmp_path, monkeypatch):
    assert model_of("run1_moe_1") == "qwen3-30b-a3b" and model_of("random:qwen3-32b") == "qwen3-32b"
    assert model_of("run4_llama_64_512") == "llama-3-8b" and model_of("run3_fp8_1") is None
    src = tmp_path / "steps.json"
    src.write_text(json.dumps({"model": "random:phi-4", "rows": [
        {"batch": 1, "bare_step_ms": 10.0, "floor_ms": 9.0, "achieved_gbps": 3000.0}]}))
    out = tmp_path / "out.json"
    monkeypatch.setattr("sys.argv", ["refloor", str(src), "--out", str(out)])
    main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["phi-4"] and rows[0]["floor_ms"] < 9.0
