"""bench/structured_check.py: ended answers must validate; cut ones are counted, never called valid."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import structured_check  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_ended_answers_are_validated_and_cut_ones_counted():
    answers = [{"finish_reason": "stop", "content": '{"ok": true, "n": 3}'},
               {"finish_reason": "stop", "content": '{"ok": true, "n": 30}'},
               {"finish_reason": "stop", "content": '{"ok": tr'},
               {"finish_reason": "length", "content": '{"ok": tr'},
               {"error": "HTTP 400: bad"}]
    report = structured_check.check(answers, SCHEMA)
    assert (report["ended"], report["valid"], report["length"], report["failed"]) == (3, 1, 1, ["HTTP 400: bad"])
    assert [x["error"][:7] for x in report["invalid"]] == ["30 is g", "not JSO"]


@pytest.mark.slow
def test_the_demo_model_under_a_small_schema_passes(live_server, tmp_path, monkeypatch, capsys):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    monkeypatch.setenv("BLINK_API_KEY", live_server.api_key)
    out = tmp_path / "check.json"
    code = structured_check.main(["--url", live_server.base_url, "--schema", str(schema), "--num-requests", "2",
                                  "--max-tokens", "32", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().out
    assert report["ended"] == report["valid"] == 2 and not report["invalid"]
