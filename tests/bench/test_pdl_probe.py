"""bench/pdl_probe.py's arithmetic and table on made-up timings (no GPU, no Triton): which rows it runs, us per
kernel against the plain chain run the same way, and refused instantiations kept as rows."""
import ast
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import pdl_probe  # noqa: E402


def test_arguments_default_to_a_300_kernel_chain_and_refuse_an_odd_one(capsys):
    args = pdl_probe.parse_args([])
    assert (args.links, args.reps, args.rounds) == (300, 100, 3)
    with pytest.raises(SystemExit):
        pdl_probe.parse_args(["--links", "301"])
    assert "--links must be an even number" in capsys.readouterr().err


def test_rows_flatten_edges_only_where_there_are_edges_to_flatten():
    keys = pdl_probe.row_keys()
    assert len(keys) == len(set(keys)) == 4 + 3 * (4 + 3)
    assert not any(flat for variant, mech, flat in keys if variant == "plain" or mech == "torch")
    assert ("prefetch", "relaunch", True) in keys


def test_rounds_run_mechanism_by_mechanism_with_the_variants_alternating():
    keys = pdl_probe.row_keys()
    order = pdl_probe.measurement_order(keys, 2)
    assert sorted(order) == sorted(keys * 2)
    mechs = [mech for _, mech, _ in order]
    assert mechs == sorted(mechs, key=list(pdl_probe.MECHANISMS).index)  # device relaunches last
    torch_rows = [variant for variant, mech, _ in order if mech == "torch"]
    assert torch_rows == list(pdl_probe.VARIANTS) * 2


def test_us_per_kernel_is_the_median_chain_over_links_and_compared_within_a_mechanism():
    samples = {("plain", "torch", False): [900e3, 1200e3, 1000e3],        # ns per chain of 100 kernels
               ("plain", "relaunch", False): [1500e3, 1500e3, 1500e3],
               ("wait", "torch", False): [800e3, 700e3, 900e3],
               ("wait", "relaunch", False): ["step 4 (instantiate/upload/launch): cudaErrorInvalidValue (1)"] * 3,
               ("wait", "relaunch", True): [1400e3, 1300e3, 1450e3]}
    rows = {(r["variant"], r["mechanism"], r["plain_edges"]): r for r in pdl_probe.summarize(samples, 100)}
    assert rows[("plain", "torch", False)]["us_per_kernel"] == pytest.approx(10.0)
    assert rows[("wait", "torch", False)]["vs_plain_us"] == pytest.approx(-2.0)
    assert rows[("wait", "relaunch", True)]["vs_plain_us"] == pytest.approx(14.0 - 15.0)
    refused = rows[("wait", "relaunch", False)]
    assert refused["us_per_kernel"] is None and refused["vs_plain_us"] is None
    assert "cudaErrorInvalidValue" in refused["error"]
    table = pdl_probe.format_table(list(rows.values()), {"plain": (299, 0), "wait": (0, 299)})
    lines = table.splitlines()
    assert len(lines) == 1 + len(samples)
    assert "cudaErrorInvalidValue" in next(line for line in lines if line.startswith("wait") and "relaunch" in line
                                           and " no " in line)
    assert "-2.000" in next(line for line in lines if line.startswith("wait") and "torch" in line)
    assert "0/299" in lines[-1]


def test_error_codes_name_the_step_and_the_cuda_error():
    assert pdl_probe.describe_error(4001, "cudaErrorInvalidValue") == \
        "step 4 (instantiate/upload/launch): cudaErrorInvalidValue (1)"
    assert pdl_probe.describe_error(5000, "cudaSuccess") == "step 5 (device relaunch stopped short)"



def test_the_variants_are_the_kernels_module_s():
    """Read from bench/pdl_kernels.py's source: importing it needs Triton, which the CPU tests do without."""
    source = (Path(pdl_probe.__file__).parent / "pdl_kernels.py").read_text()
    assigned = next(node for node in ast.parse(source).body if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) == "VARIANTS")
    assert ast.literal_eval(assigned.value) == pdl_probe.VARIANTS


def test_main_writes_every_row_and_fails_on_outputs_that_differ(tmp_path, monkeypatch, capsys):
    """main's flow with the GPU parts replaced: every row measured --rounds times, a refused device launch kept
    as a row, the JSON written, and exit 1 when the variants' outputs differ."""
    calls = []

    def measure(graph, mech, plain_edges, reps):
        calls.append((graph, mech, plain_edges))
        if mech == "relaunch" and graph != "plain" and not plain_edges:
            return "step 4 (instantiate/upload/launch): cudaErrorInvalidValue (1)"
        return 1000.0 * 20 * (2 if mech == "relaunch" else 1)  # ns per chain of 20 kernels

    monkeypatch.setattr(pdl_probe, "_chain", lambda links: object())
    monkeypatch.setattr(pdl_probe, "_capture", lambda chain, variant: variant)
    monkeypatch.setattr(pdl_probe, "_edges", lambda graph: (19, 0) if graph == "plain" else (0, 19))
    monkeypatch.setattr(pdl_probe, "_same_output", lambda chain, graphs: (False, 0.01))
    monkeypatch.setattr(pdl_probe, "_measure", measure)
    monkeypatch.setattr(pdl_probe, "_environment", lambda: {"gpu": "test GPU"})
    monkeypatch.setenv("OUT", str(tmp_path))
    assert pdl_probe.main(["--links", "20", "--rounds", "2"]) == 1
    assert len(calls) == 2 * len(pdl_probe.row_keys())
    (path,) = tmp_path.glob("pdl_probe-*.json")
    result = json.loads(path.read_text())
    assert result["gpu"] == "test GPU" and result["same_output"] is False
    assert result["edges"]["wait"] == {"plain": 0, "programmatic": 19}
    rows = {(r["variant"], r["mechanism"], r["plain_edges"]): r for r in result["rows"]}
    assert rows[("plain", "relaunch", False)]["us_per_kernel"] == pytest.approx(2.0)
    assert rows[("wait", "relaunch", True)]["vs_plain_us"] == pytest.approx(0.0)
    assert "cudaErrorInvalidValue" in rows[("prefetch", "relaunch", False)]["error"]
    assert "cudaErrorInvalidValue" in capsys.readouterr().out
