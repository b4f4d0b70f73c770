"""Programmatic dependent launch in the decode step's Triton kernels (kernels/_common.pdl_on) changes when a
kernel starts, never what it computes: on a tiny Llama and a tiny Qwen3-MoE, the host engine's and the persistent
loop's tokens with it on in every step (`BLINK_PDL=1`) and in the 1-token steps only (the default, "auto") equal
those with it off (`BLINK_PDL=0`), bit for bit; so do they with each layer's o weights prefetched into L2 on a side
stream of the one-token graphs (`BLINK_L2_PREFETCH=1`; 2: an MoE layer's next qkv too, kernels/prefetch.py). Each side runs in a child process (the
switches are read once per process). GPU only; PDL needs Hopper or later."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

HERE = Path(__file__).resolve().parent


def _tokens_here(kind: str) -> dict:
    """In the child: the host engine's, then the persistent loop's tokens for test_gpu_runner's specs, and how many
    L2 prefetches the runners launched or captured."""
    import kernels.prefetch
    from kernels._common import pdl_mode
    prefetches, real = [0], kernels.prefetch.l2_prefetch

    def counted(w):
        prefetches[0] += 1
        real(w)
    kernels.prefetch.l2_prefetch = counted  # the runner takes it from the module when it is built
    from test_gpu_runner import _drive, _peaky_model, _specs
    from test_moe_gpu import _loop_moe
    from test_persistent import CONFIG, serve_to_end
    from test_persistent import _runner as _loop_runner

    if kind == "moe":
        cfg, runner = _loop_moe()
    else:
        cfg, model = _peaky_model()
        runner = _loop_runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    host, _, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    persistent, _ = serve_to_end(runner, cfg, _specs())
    return {"pdl": pdl_mode(), "host": host, "persistent": persistent, "prefetches": prefetches[0]}


def _tokens(kind: str, pdl: str, l2_prefetch: str = "0") -> dict:
    env = {**os.environ, "BLINK_PDL": pdl, "BLINK_L2_PREFETCH": l2_prefetch,
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE), os.environ.get("PYTHONPATH", "")])}
    code = f"import json, test_pdl_gpu as t; print('RESULT', json.dumps(t._tokens_here({kind!r})))"
    res = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_pdl_gives_the_same_tokens_in_host_and_persistent_modes(kind):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    off, on, auto = _tokens(kind, "0"), _tokens(kind, "1"), _tokens(kind, "auto")
    assert (off["pdl"], on["pdl"], auto["pdl"]) == ("0", "1", "auto")
    for run in (on, auto):  # "auto": on in the 1-token steps only, so a step graph mixes both launches
        assert run["host"] == off["host"] and run["persistent"] == off["persistent"]
    assert on["persistent"] == on["host"]
    assert off["prefetches"] == on["prefetches"] == auto["prefetches"] == 0


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_l2_prefetch_gives_the_same_tokens_in_host_and_persistent_modes(kind):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the one-token graphs' PDL edges beside the prefetch branch need sm_90 or later")
    off, on, more = _tokens(kind, "auto", "0"), _tokens(kind, "auto", "1"), _tokens(kind, "auto", "2")
    assert off["prefetches"] == 0 and on["prefetches"] > 0  # one a layer in each one-token step built
    # 2: an MoE layer also prefetches the next layer's qkv (its experts' loads evict-first); a dense model as 1
    assert (more["prefetches"] > on["prefetches"]) == (kind == "moe")
    for run in (on, more):
        assert run["host"] == off["host"] and run["persistent"] == off["persistent"]
