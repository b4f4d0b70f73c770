"""CPU engine throughput at 1/4/16 streams vs transformers `generate`.

    .venv/bin/python bench/cpu_engine.py [--tokens 128] [--out bench/results]

Steps, all on this machine in one run:
1. start `blink backend --mode cpu` on the demo model;
2. submit straight into its ring (no gateway): N concurrent greedy streams of `--tokens` tokens each,
   EOS ignored, so every stream does the same work -> output tokens/s; and batch-1 TTFT (max_tokens=1);
3. stop it, then time transformers `generate` (greedy, static length) at batch 1 on the same weights.
The gateway's added TTFT is `bench/ring_traffic.py ttft`: over a real engine the prefill's own variance
(±15 ms on 2 cores) swamps a sub-millisecond difference.
Writes a JSON file with the commit hash and prints a summary row for bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocols.ring import FinishReason, RequestSpec  # noqa: E402
from protocols.shm import attach_ring  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402
from blink.bench.results import commit, write_summary  # noqa: E402
from tests.conftest import _describe, free_port  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "blink.cli", *cmd], cwd=ROOT, env=env)


def wait_backend(control: str, proc: subprocess.Popen, timeout_s: float = 600) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("backend exited during start-up")
        try:
            return _describe(control)
        except Exception:
            time.sleep(0.5)
    raise TimeoutError("backend did not start")


def run_streams(prod: ShmProducer, prompt_ids: list[int], streams: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    slots = [prod.submit(RequestSpec(i, prompt_ids, tokens, temperature=0.0, ignore_eos=True)) for i in range(streams)]
    got = {s: 0 for s in slots}
    first = {}
    live = set(slots)
    while live:
        for s in list(live):
            upd = prod.poll(s)
            if upd.tokens and s not in first:
                first[s] = time.perf_counter() - t0
            got[s] += len(upd.tokens)
            if upd.finish is not FinishReason.NONE:
                live.discard(s)
                prod.release(s)
        time.sleep(0.0005)
    wall = time.perf_counter() - t0
    total = sum(got.values())
    assert total == streams * tokens, f"expected {streams * tokens} tokens, got {total}"
    return {"streams": streams, "tokens_per_stream": tokens, "wall_s": wall, "output_tok_s": total / wall,
            "mean_ttft_ms": 1e3 * statistics.mean(first.values())}


def direct_ttft_ms(prod: ShmProducer, prompt_ids: list[int], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        slot = prod.submit(RequestSpec(i, prompt_ids, 1, temperature=0.0, ignore_eos=True))
        while True:
            upd = prod.poll(slot)
            if upd.tokens:
                out.append(1e3 * (time.perf_counter() - t0))
            if upd.finish is not FinishReason.NONE:
                break
            time.sleep(0.0001)
        prod.release(slot)
    return out


def hf_generate_tok_s(model_dir: str, prompt_ids: list[int], tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        wall = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == tokens
    return {"streams": 1, "tokens_per_stream": tokens, "wall_s": wall, "output_tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ttft-samples", type=int, default=30, help="1-token requests timed through the ring")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from gpu_backend.models.demo import ensure_demo_model

    model_dir = str(ensure_demo_model())
    prompt_ids = Tokenizer.from_file(f"{model_dir}/tokenizer.json").encode(PROMPT).ids
    control, ring = f"127.0.0.1:{free_port()}", f"blink-bench-{os.getpid()}"
    env = {**os.environ, "BLINK_LOG_LEVEL": "WARNING"}
    backend = start(["backend", "--mode", "cpu", "--model", model_dir, "--ring", ring, "--control", control,
                     "--context-len", "2048"], env)
    try:
        desc = wait_backend(control, backend)
        prod = ShmProducer(attach_ring(ring))
        run_streams(prod, prompt_ids, 1, 8)  # warm-up
        engine = [run_streams(prod, prompt_ids, n, args.tokens) for n in (1, 4, 16)]
        direct = direct_ttft_ms(prod, prompt_ids, args.ttft_samples)
    finally:
        if backend.poll() is None:
            backend.send_signal(signal.SIGTERM)
            backend.wait(timeout=30)
    hf = hf_generate_tok_s(model_dir, prompt_ids, args.tokens)
    import torch

    result = {
        "bench": "cpu_engine", "commit": commit(short=True) or "unknown", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cpu": platform.processor() or "unknown", "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "model": desc.model_name, "prompt_tokens": len(prompt_ids), "engine": engine, "hf_generate_batch1": hf,
        "ttft_direct_ms_median": statistics.median(direct),
    }
    path = write_summary(Path(args.out) / f"cpu_engine-{result['commit']}.json", result, {"ttft_direct_ms": direct})
    print(f"wrote {path}")
    print("| streams | blink cpu tok/s | vs HF generate b1 |")
    for e in engine:
        print(f"| {e['streams']} | {e['output_tok_s']:.1f} | {e['output_tok_s'] / hf['output_tok_s']:.2f}x |")
    print(f"HF generate batch 1: {hf['output_tok_s']:.1f} tok/s")
    print(f"TTFT median (1 token, straight into the ring): {result['ttft_direct_ms_median']:.2f} ms")


if __name__ == "__main__":
    main()
