"""`bench/results/` holds small summaries that `bench/RESULTS.md` cites; per-request records stay out of git."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from blink.bench.results import read_records, records_path, write_run
from tests.conftest import ROOT

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from slim_results import main as slim_main, sample_summary  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
MAX_FOLDER_BYTES = 3 * 1024 * 1024


def _committed_files() -> list[str]:
    """Files under bench/results/ that git holds or would add (ignored record files left out)."""
    cmd = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "bench/results"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [line for line in out.stdout.splitlines() if line.count("/") == 2 and (ROOT / line).exists()]
    return sorted({p.split("/", 2)[2] for p in paths})


def test_the_folder_is_under_3_mb():
    total_bytes = sum((RESULTS_DIR / name).stat().st_size for name in _committed_files())
    assert total_bytes < MAX_FOLDER_BYTES, f"bench/results/ holds {total_bytes / 1e6:.2f} MB (limit 3 MiB)"


def _cites(text: str, name: str) -> bool:
    """Whether `text` names the file `name` whole (not as part of a longer name)."""
    return re.search(rf"(?<![\w.+-]){re.escape(name)}(?![\w.+-])", text) is not None


def test_every_file_in_the_folder_is_cited_by_results_md():
    text = RESULTS_MD.read_text()
    uncited = [name for name in _committed_files() if not _cites(text, name)]
    assert not uncited, f"bench/results/ files that bench/RESULTS.md does not cite: {uncited}"


def test_every_results_file_that_results_md_cites_exists():
    cited = set(re.findall(r"`(?:bench/results/)?([\w.+-]+\.(?:json|png|txt|log))`", RESULTS_MD.read_text()))
    missing = sorted(name for name in cited if not (RESULTS_DIR / name).exists())
    assert not missing, f"bench/RESULTS.md cites files that are not in bench/results/: {missing}"


def test_no_committed_summary_holds_per_request_records():
    assert slim_main(["--check", *[str(RESULTS_DIR / n) for n in _committed_files() if n.endswith(".json")]]) == 0


def _run_doc() -> dict:
    return {"label": "t", "workload": {"name": "sharegpt"}, "arrivals": {"rate": 8.0}, "interference": None,
            "metrics": {"completed": 2}, "requests": [{"ttft_s": 0.1}, {"ttft_s": 0.2}]}


def test_write_run_puts_records_beside_the_summary(tmp_path):
    path = write_run(tmp_path, _run_doc())
    summary = json.loads(path.read_text())
    assert "requests" not in summary and summary["metrics"] == {"completed": 2}
    assert summary["records_file"] == records_path(path).name and summary["num_records"] == {"requests": 2}
    assert read_records(path) == {"requests": [{"ttft_s": 0.1}, {"ttft_s": 0.2}]}


def test_records_files_are_git_ignored():
    probe = "bench/results/x_sharegpt_r8.0_iso_1.records.json.gz"
    out = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    assert out.returncode == 0, f"{probe} is not ignored by .gitignore"


def test_slim_keeps_aggregates_and_summarizes_sample_lists(tmp_path):
    path = tmp_path / "gateway_ttft-abc.json"
    http_ms = [float(i) for i in range(1, 101)]
    path.write_text(json.dumps({**_run_doc(), "http_ms_p99": 99.0, "http_ms": http_ms, "cores": [0, 1]}))
    assert slim_main(["--check", str(path)]) == 1
    assert slim_main([str(path)]) == 0
    summary = json.loads(path.read_text())
    assert "requests" not in summary and "http_ms" not in summary
    assert summary["http_ms_p99"] == 99.0 and summary["cores"] == [0, 1] and summary["metrics"] == {"completed": 2}
    assert summary["http_ms_summary"] == sample_summary(http_ms) and summary["http_ms_summary"]["p50"] == 50.5
    assert read_records(path)["http_ms"] == http_ms
    assert slim_main(["--check", str(path)]) == 0  # idempotent: nothing left to strip
