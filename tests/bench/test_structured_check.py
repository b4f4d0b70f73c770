"""bench/structured_check.py: ended answers must validate; cut ones are counted, never called valid."""
import json
import sys
import time
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


def test_compile_latency_pairs_a_fresh_schema_with_itself_again():
    seen: list[str] = []

    def ask_one(schema):
        title = schema["title"]
        time.sleep(0.002 if title in seen else 0.030)  # a schema the server has not seen costs its compile
        seen.append(title)
        return {"finish_reason": "length", "content": "{"}

    out = structured_check.compile_latency(ask_one, SCHEMA, 3)
    assert len(set(seen)) == 3 and seen[0] == seen[1] and seen[2] == seen[3] and seen[1] != seen[2]
    assert all(c > w for c, w in zip(out["cold_ms"], out["cached_ms"])) and out["failed"] == []
    assert 20 < out["compile_ms_estimate"] < out["median_cold_ms"]
    assert structured_check.compile_latency(lambda s: {"error": "HTTP 400"}, SCHEMA, 1)["failed"] == ["HTTP 400"] * 2


@pytest.mark.slow
def test_the_demo_model_under_a_small_schema_passes(live_server, tmp_path, monkeypatch, capsys):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    monkeypatch.setenv("BLINK_API_KEY", live_server.api_key)
    out = tmp_path / "check.json"
    code = structured_check.main(["--url", live_server.base_url, "--schema", str(schema), "--num-requests", "2",
                                  "--max-tokens", "32", "--compile-repeats", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().out
    assert report["ended"] == report["valid"] == 2 and not report["invalid"]
    assert report["compile"]["failed"] == [] and report["compile"]["median_cold_ms"] > 0


def test_the_corpus_checks_each_answer_against_its_own_constraint():
    items = structured_check.corpus()
    assert len(items) >= 200
    kinds = [next(iter(fields)) for fields, _ in items]
    assert kinds.count("response_format") >= 200 and "structured_outputs" in kinds
    regex = next(i for i, (f, _) in enumerate(items) if f.get("structured_outputs", {}).get("regex") == "(yes|no)")
    choice = next(i for i, (f, _) in enumerate(items)
                  if f.get("structured_outputs", {}).get("choice") == ["spam", "ham"])
    answers = [{"finish_reason": "length", "content": ""}] * len(items)
    answers[regex] = {"finish_reason": "stop", "content": "yes"}
    answers[choice] = {"finish_reason": "stop", "content": "eggs"}
    answers[0] = {"finish_reason": "stop", "content": "not json"}
    report = structured_check.check(answers, validators=[v for _, v in items])
    assert report["ended"] == 3 and report["valid"] == 1 and report["length"] == len(items) - 3
    assert sorted(x["content"] for x in report["invalid"]) == ["eggs", "not json"]
