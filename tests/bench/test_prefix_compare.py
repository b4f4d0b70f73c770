"""bench/prefix_compare.py: caching on/off ratios, prefill against the workload's minimum, backend balance."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import prefix_compare  # noqa: E402


def _doc(label, ttft_p50, tok_s, prompt, cached, reusable):
    return {"label": label, "workload": {"name": "multi-turn", "total_prompt_len": prompt,
                                         "reusable_prompt_tokens": reusable},
            "metrics": {"ttft_ms": {"median": ttft_p50}, "output_throughput_tok_s": tok_s, "failed": 0,
                        "total_input_tokens": prompt,
                        "prefix_cache": {"prompt_tokens": prompt, "cached_tokens": cached,
                                         "hit_rate": cached / prompt}}}


def test_on_off_ratios_and_prefill_over_the_minimum(tmp_path, capsys):
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    on.write_text(json.dumps(_doc("on", 20.0, 3000.0, 10000, 7000, 8000)))
    off.write_text(json.dumps(_doc("off", 200.0, 1500.0, 10000, 0, 8000)))
    assert prefix_compare.main(["--on", str(on), "--off", str(off)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["on_vs_off"] == {"ttft_p50_lower_x": 10.0, "output_throughput_higher_x": 2.0}
    assert report["on"]["prefilled_tokens"] == 3000 and report["on"]["unavoidable_tokens"] == 2000
    assert report["on"]["prefill_over_minimum"] == 1.5 and report["off"]["prefill_over_minimum"] == 5.0


def test_load_balance_averages_outstanding_tokens_per_backend(tmp_path):
    samples = [{"backends": [{"addr": "a", "outstanding_tokens": 100, "requests": 1},
                             {"addr": "b", "outstanding_tokens": 300, "requests": 2}]},
               {"backends": [{"addr": "a", "outstanding_tokens": 300, "requests": 5},
                             {"addr": "b", "outstanding_tokens": 300, "requests": 4}]}]
    path = tmp_path / "loads.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in samples) + "\n{\"cut")
    balance = prefix_compare.load_balance(prefix_compare.read_samples(path))
    assert balance["mean_outstanding_tokens"] == {"a": 200.0, "b": 300.0}
    assert balance["imbalance_x"] == 1.5 and balance["requests"] == {"a": 5, "b": 4}
