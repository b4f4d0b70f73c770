"""`blink backend`: load a model, create the ring, serve the control plane, run an engine until stopped.

The flags (and the config file) become one frozen `BackendConfig` (gpu_backend/config.py) here, once; every
part below gets that, or the engine-level configs derived from it, never the argparse namespace.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from gpu_backend import env
from gpu_backend.config import MODES, BackendConfig, ConfigError
from gpu_backend.control_tls import add_control_tls_args, agent_tls_argv, control_tls
from protocols.ring import RingGeometry
from protocols.shm import SHM_DIR, RingInUseError, check_ring_free, create_ring, remove_stale_ring

log = logging.getLogger("blink.backend")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="backend config file (YAML: BackendConfig fields; default $BLINK_BACKEND_CONFIG); "
                        "flags given here override it")
    p.add_argument("--mode", choices=MODES, default="cpu", help="engine: cpu (torch on the CPU), host, persistent")
    p.add_argument("--model", default="demo", help="Hugging Face folder, random:<preset>, or 'demo' (default)")
    p.add_argument("--model-name", default=None, help="name clients pass as 'model' (default: the folder name)")
    p.add_argument("--ring", default=None, help="shared-memory ring name (default: blink-<host>-<port> of "
                   "--control, so that a restart reclaims the ring a crashed backend left)")
    p.add_argument("--control", default="127.0.0.1:50051", help="control-plane gRPC address (HOST:PORT)")
    p.add_argument("--context-len", type=int, default=0, help="tokens per sequence (default: the model's, at most 8192)")
    p.add_argument("--num-slots", type=int, default=256, help="ring slots: requests in flight at most")
    p.add_argument("--max-output-len", type=int, default=1024, help="per-slot response buffer, in tokens")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--quantization", choices=("fp8", "fp8-partial"), default=None,
                   help="FP8 e4m3 weights, one scale per channel, quantized at load (models/fp8.py). fp8: the four "
                        "projections, activations scaled per token: half the bytes (an FP8 compressed-tensors "
                        "checkpoint implies it). fp8-partial: the o and gate/up weights only, activations "
                        "unquantized: ~70%% of the bytes, fewer flipped tokens")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="fp8: an FP8 e4m3 KV cache (host and persistent modes): twice the tokens in the same memory")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache size (cpu mode)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N GPUs of this host (1, 2, 4, 8; the first N visible ones; host and "
                        "persistent modes): heads and MLP columns per GPU, all-reduces over NVLink, one ring")
    p.add_argument("--gpu-memory-utilization", "--gpu-memory-fraction", dest="gpu_memory_fraction", type=float,
                   default=0.9, help="share of the GPU's memory for weights, activations and KV cache (host and "
                                     "persistent modes; vLLM's name): the KV cache gets what the rest leaves")
    p.add_argument("--no-graphs", action="store_true", help="host mode: run steps eagerly (debugging)")
    p.add_argument("--no-sampling-extensions", action="store_true",
                   help="host and persistent modes: no presence/frequency/repetition penalties, logit_bias or "
                        "logprobs (refused with a 400). Saves what they cost on the GPU: a logits buffer of "
                        "max-num-seqs x vocab x 4 bytes (persistent: twice that), one more CUDA graph per bucket "
                        "(persistent: six more per bucket, two of them large) and memory for their "
                        "temporaries, taken from the KV cache")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of prompt prefixes the engine already holds (the gateway's block hashes); "
                        "on by default ($BLINK_PREFIX_CACHING=0 turns it off)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="the same as --no-enable-prefix-caching")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks (overrides --kv-cache-mb)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="per-step token budget = the largest graph bucket (default: 256 cpu, 512 host)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="running sequences at most (default: 64 cpu, 256 host)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: all cores)")
    p.add_argument("--transport", choices=("shm", "tcp", "rdma"), default="shm",
                   help="how gateways reach the ring: shm (same host), tcp (through a `blink agent`), "
                        "rdma (one-sided verbs; untested on hardware)")
    p.add_argument("--listen", default="127.0.0.1:50053", metavar="HOST:PORT",
                   help="tcp transport: where the agent listens")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="tcp transport: the agent address Describe announces (default: --listen)")
    p.add_argument("--rdma-device", default=None, help="rdma transport: device name (default: the first)")
    p.add_argument("--rdma-gid-index", type=int, default=0, help="rdma transport: GID table index (RoCE v2: often 3)")
    add_control_tls_args(p)


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [V6]:PORT) -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def listen_error(host: str, port: int) -> OSError | None:
    """Why nothing could listen on host:port now (taken, or not this host's address), or None.

    SO_REUSEADDR so that connections of an earlier server in TIME_WAIT do not count; a listener (with
    or without SO_REUSEPORT, which this probe does not set) still does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            return exc
    return None


def config_from_args(args: argparse.Namespace) -> BackendConfig:
    """The one BackendConfig of this process: the config file, then the flags that differ from their defaults."""
    probe = argparse.ArgumentParser(add_help=False)
    add_backend_args(probe)
    return BackendConfig.from_args(args, probe.parse_args([]))


def run_backend(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"blink backend: {exc}", file=sys.stderr)
        return 2
    host, port = split_address(config.control)
    if port and (exc := listen_error(host, port)):  # before the model loads: fail in a second, not a minute
        log.error("the control plane cannot listen on %s (%s); choose another address with --control",
                  config.control, exc.strerror or exc)
        return 2
    try:
        check_ring_free(config.ring_name)  # likewise: a live backend's ring is not stale
        tls = control_tls(config)  # likewise: a bad TLS file, named, before the model loads
    except (RingInUseError, OSError) as exc:
        log.error("%s", exc)
        return 2
    return serve_backend(config, tls)


def serve_backend(config: BackendConfig, tls=None) -> int:
    """Load, create the ring, serve until stopped. `tls`: the control plane's loaded files (`control_tls`)."""
    if config.mode == "persistent":
        env.use_eager_module_loading()
    import torch

    if config.device == "cuda" and not torch.cuda.is_available():
        log.error("--mode %s needs a CUDA GPU and none is visible; use --mode cpu", config.mode)
        return 2
    from gpu_backend.control_server import ControlServer, Description
    from gpu_backend.engine.loop import EngineLoop, prefix_caching_on
    from gpu_backend.models import load_model, model_fingerprint
    from gpu_backend.models.demo import default_cache_dir, ensure_demo_model
    from gpu_backend.models.random_tokenizer import ensure_random_tokenizer
    from protocols.shm_consumer import RingConsumer

    if config.threads:
        torch.set_num_threads(config.threads)
    spec = str(ensure_demo_model()) if config.model == "demo" else config.model
    if config.tensor_parallel_size > 1:
        cfg, models, model_dir = _load_sharded(spec, config)
    else:
        cfg, model, model_dir = load_model(spec, device=config.device, progress=True, quantization=config.quantization)
        models = [model.eval()]
    context_len = config.context_len_for(cfg.max_position_embeddings)
    fingerprint = model_fingerprint(model_dir or cfg, models[0].quantization, config.tensor_parallel_size)
    runner = _make_runner(config, models, cfg, context_len)
    # token masks (constrained requests) for every vocabulary token, where the runner has the extended path
    mask_words = -(-cfg.vocab_size // 32) if getattr(runner, "sampling_extensions", True) else 0
    geometry = RingGeometry(config.num_slots, context_len, config.max_output_len, kv_block_size=config.block_size,
                            mask_words=mask_words)
    try:
        if remove_stale_ring(config.ring_name):
            log.warning("removed the stale ring %r that a backend which died left in %s", config.ring_name, SHM_DIR)
        ring = create_ring(config.ring_name, geometry, fingerprint)
    except RingInUseError as exc:
        log.error("%s", exc)
        return 2
    if config.mode == "persistent":
        from gpu_backend.engine.persistent import PersistentEngine

        engine = PersistentEngine(runner, cfg, ring, config.engine_config(), context_len,
                                  tp=runner if config.tensor_parallel_size > 1 else None)
    else:
        engine = EngineLoop(runner, cfg, RingConsumer(ring), config.engine_config(), context_len)
    name = config.model_name or (Path(model_dir).name if model_dir else spec)
    tokenizer_dir = model_dir or ensure_random_tokenizer(cfg, default_cache_dir())
    endpoint = (config.advertise or config.listen) if config.transport == "tcp" else ""
    desc = Description(name, str(tokenizer_dir), fingerprint, context_len, cfg.vocab_size,
                       tuple(cfg.eos_token_ids), config.mode, config.transport, endpoint,
                       sampling_extensions=getattr(runner, "sampling_extensions", True),
                       prefix_caching=prefix_caching_on(config.engine_config(), geometry.kv_block_size))
    rdma = _export_rdma(ring, config) if config.transport == "rdma" else None
    agent = _start_agent(ring.name, config, engine.stop_event) if config.transport == "tcp" else None
    try:
        control = ControlServer(config.control, desc, ring, rdma=rdma, tls=tls)
    except OSError as exc:  # taken since the check in run_backend
        log.error("%s; choose another address with --control", exc)
        if agent is not None:
            agent.terminate()
        ring.close()
        return 2
    control.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: engine.stop_event.set())
    signal.signal(signal.SIGHUP, lambda *_: _reload_tls(tls, agent))
    host = split_address(config.control)[0]
    print(f"backend ready: model={name} mode={config.mode} ring={ring.name} control={host}:{control.port} "
          f"kv_blocks={runner.num_blocks}", file=sys.stderr, flush=True)
    try:
        engine.run()
        if engine.failed:
            return 1  # the GPU loop died: exit non-zero so that a supervisor restarts the backend
    finally:
        control.stop()
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=10)
        ring.close()
    return 0


def _load_sharded(spec: str, config: BackendConfig):
    """(whole model's config, one model per GPU, folder or None) for --tensor-parallel-size N."""
    import torch

    from gpu_backend.parallel.shard import load_rank_models

    n = config.tensor_parallel_size
    if torch.cuda.device_count() < n:
        raise SystemExit(f"--tensor-parallel-size {n} needs {n} GPUs; {torch.cuda.device_count()} visible "
                         f"(CUDA_VISIBLE_DEVICES picks them)")
    return load_rank_models(spec, [torch.device("cuda", i) for i in range(n)], config.quantization)


def _make_runner(config: BackendConfig, models: list, cfg, context_len: int):
    engine = config.engine_config()
    model = models[0]
    if config.mode == "cpu":
        from gpu_backend.engine.cpu_runner import CpuRunner

        return CpuRunner(model, cfg, engine.num_blocks_for(cfg, context_len), engine.block_size,
                         context_len=context_len, max_num_batched_tokens=engine.max_num_batched_tokens,
                         max_num_seqs=engine.max_num_seqs)
    from gpu_backend.engine.gpu_runner import GpuRunner

    keep = config.mode == "persistent"
    if config.tensor_parallel_size > 1:
        from gpu_backend.parallel.runner import TpRunner
        from gpu_backend.parallel.shard import local_config

        runner = TpRunner(models, local_config(cfg, config.tensor_parallel_size), config.gpu_runner_config(context_len),
                          [next(m.parameters()).device for m in models], keep_graphs=keep)
    else:
        runner = GpuRunner(model, cfg, config.gpu_runner_config(context_len), keep_graphs=keep)
    print(f"GPU runner: {config.tensor_parallel_size} GPU(s), {runner.num_blocks} KV blocks of {engine.block_size} tokens "
          f"({runner.num_blocks * runner.kv_block_bytes / 2**30:.1f} GiB), {len(runner.graphs)} graphs "
          f"captured in {runner.capture_s:.1f} s", file=sys.stderr, flush=True)
    return runner


def _export_rdma(ring, config: BackendConfig):
    from gpu_backend.rdma_export import export_shm_ring
    from protocols.rdma_verbs import RdmaUnavailable

    try:
        return export_shm_ring(ring, config.rdma_device, config.rdma_gid_index)
    except RdmaUnavailable as exc:
        ring.close()
        raise SystemExit(f"blink backend: --transport rdma: {exc}")


def _reload_tls(tls, agent: subprocess.Popen | None) -> None:
    """SIGHUP: the control plane's TLS files again (new connections), and the tcp agent's likewise."""
    if tls is None:
        log.info("SIGHUP: no TLS files to reload (no --control-ssl-certfile)")
        return
    tls.reload()
    if agent is not None and agent.poll() is None:
        agent.send_signal(signal.SIGHUP)


def _start_agent(ring_name: str, config: BackendConfig, stop_event: threading.Event) -> subprocess.Popen:
    """The tcp agent as a child process (its own interpreter: it never contends with the engine's), with
    the control plane's TLS files.

    A backend whose agent died is unreachable: it stops, so that its supervisor restarts both."""
    cmd = [sys.executable, "-m", "blink.cli", "agent", "--ring", ring_name, "--listen", config.listen,
           "--parent-pid", str(os.getpid()), *agent_tls_argv(config)]
    agent = subprocess.Popen(cmd)

    def watch() -> None:
        code = agent.wait()
        if not stop_event.is_set():
            log.error("the tcp agent exited with code %s; stopping the backend", code)
            stop_event.set()
    threading.Thread(target=watch, name="agent-watch", daemon=True).start()
    return agent
