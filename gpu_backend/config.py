"""The backend's configuration: one frozen dataclass, built once from the flags and the config file.

    blink backend --config backend.yaml --mode host      # flags win over the file

The file (YAML; `--config FILE`, or $BLINK_BACKEND_CONFIG) is a mapping of `BackendConfig` fields, e.g.

    mode: host
    model: /models/Llama-3.1-8B-Instruct
    max_num_seqs: 128
    sampling_extensions: false

A flag given on the command line overrides the file; a flag left at its default does not (so a flag set
explicitly to its default value cannot undo a file's setting). `gpu_backend/main.py` builds the config
once and hands it down; the engines get the parts they need (`engine_config`, `gpu_runner_config`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpu_backend import env
from protocols.shm import stable_ring_name

MODES = ("cpu", "host", "persistent")
TRANSPORTS = ("shm", "tcp", "rdma")
# flags that turn a field off (flag dest -> field)
_NEGATED = {"no_graphs": "use_graphs", "no_sampling_extensions": "sampling_extensions"}


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True)
class BackendConfig:
    mode: str = "cpu"                      # engine: cpu (torch on the CPU), host, persistent
    model: str = "demo"                    # Hugging Face folder, random:<preset>, or demo
    model_name: str | None = None          # name clients pass as `model` (default: the folder name)
    ring: str | None = None                # shared-memory ring name (default: from control, see ring_name)
    control: str = "127.0.0.1:50051"       # control-plane gRPC address
    context_len: int = 0                   # tokens per sequence; 0: the model's, at most 8192
    num_slots: int = 256                   # ring slots: requests in flight at most
    max_output_len: int = 1024             # per-slot response buffer, in tokens
    block_size: int = 16                   # tokens per KV block
    quantization: str | None = None        # fp8 or fp8-partial: FP8 projection weights (models/fp8.py)
    kv_cache_dtype: str = "auto"           # auto (the model's dtype) or fp8 (e4m3, host and persistent modes)
    kv_cache_mb: int = 1024                # KV cache size (cpu mode)
    tensor_parallel_size: int = 1          # GPUs the model is split over (host, persistent): cuda:0..N-1
    gpu_memory_fraction: float = 0.9       # share of the GPU for weights, activations and KV cache
    use_graphs: bool = True                # host mode: False runs steps eagerly (debugging)
    sampling_extensions: bool = True       # penalties, logit_bias, logprobs (host and persistent modes)
    enable_prefix_caching: bool = True     # reuse cached prompt blocks (--no-prefix-caching, $BLINK_PREFIX_CACHING)
    num_kv_blocks: int = 0                 # KV blocks (overrides kv_cache_mb); 0: derived
    max_num_batched_tokens: int = 0        # per-step token budget = the largest bucket; 0: 256 cpu, 512 GPU
    max_num_seqs: int = 0                  # running sequences at most; 0: 64 cpu, 256 GPU
    threads: int = 0                       # torch CPU threads; 0: all cores
    transport: str = "shm"                 # how gateways reach the ring: shm, tcp, rdma
    listen: str = "127.0.0.1:50053"        # tcp: where the agent listens
    advertise: str | None = None           # tcp: the agent address Describe announces (default: listen)
    rdma_device: str | None = None         # rdma: device name (default: the first)
    rdma_gid_index: int = 0                # rdma: GID table index (RoCE v2: often 3)
    # TLS on the control plane and the tcp agent (gpu_backend/control_tls.py; one set of files for both):
    # certificate chain + key (PEM; no keyfile: the key is in the certfile), and the CA gateways' client
    # certificates must chain to, checked as control_ssl_cert_reqs says (0 none, 1 optional, 2 required).
    control_ssl_certfile: str | None = None
    control_ssl_keyfile: str | None = None
    control_ssl_ca_certs: str | None = None
    control_ssl_cert_reqs: int = 2
    # The persistent loop's knobs (idle sleep, heartbeat interval, ...) are compiled into or read by
    # kernels/csrc/persistent_loop.cu today; once kernels/persistent_loop.py takes an options struct,
    # its fields go here and PersistentEngine hands them to blink_loop_create.

    def __post_init__(self) -> None:
        self._check(self.mode in MODES, "mode", f"{self.mode!r} is not one of {', '.join(MODES)}")
        self._check(self.quantization in (None, "fp8", "fp8-partial"), "quantization",
                    f"{self.quantization!r} is not fp8 or fp8-partial")
        self._check(self.kv_cache_dtype in ("auto", "fp8"), "kv_cache_dtype", f"{self.kv_cache_dtype!r} is not auto or fp8")
        self._check(self.kv_cache_dtype == "auto" or self.mode != "cpu", "kv_cache_dtype",
                    "fp8 is for the GPU modes (host, persistent); the cpu engine keeps a float32 cache")
        self._check(self.tensor_parallel_size in (1, 2, 4, 8), "tensor_parallel_size",
                    f"{self.tensor_parallel_size} is not 1, 2, 4 or 8")
        self._check(self.tensor_parallel_size == 1 or self.mode != "cpu", "tensor_parallel_size",
                    "splitting a model across GPUs is for the GPU modes (host, persistent)")
        self._check(self.transport in TRANSPORTS, "transport", f"{self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        self._check(0.05 <= self.gpu_memory_fraction <= 0.99, "gpu_memory_fraction",
                    f"{self.gpu_memory_fraction} is outside 0.05..0.99")
        for name in ("num_slots", "max_output_len", "block_size", "kv_cache_mb"):
            self._check(getattr(self, name) >= 1, name, f"{getattr(self, name)} must be at least 1")
        for name in ("context_len", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "threads", "rdma_gid_index"):
            self._check(getattr(self, name) >= 0, name, f"{getattr(self, name)} must not be negative")
        self._check_control_tls()
        self._check(self.context_len != 1, "context_len", "1 leaves no room for a generated token")
        self._check(self.mode == "cpu" or self.num_seqs <= self.batched_tokens, "max_num_seqs",
                    f"{self.num_seqs} is over max_num_batched_tokens {self.batched_tokens}: a GPU step buffer has a "
                    f"row per sequence and at most one sequence per token")

    def _check_control_tls(self) -> None:
        """No half TLS configuration: a key needs its certificate, a client check its CA."""
        self._check(self.control_ssl_cert_reqs in (0, 1, 2), "control_ssl_cert_reqs",
                    f"{self.control_ssl_cert_reqs!r} is not 0 (none), 1 (optional) or 2 (required)")
        if self.control_ssl_certfile is None:
            for name in ("control_ssl_keyfile", "control_ssl_ca_certs"):
                self._check(getattr(self, name) is None, name, "needs control_ssl_certfile (the backend's TLS "
                            "certificate): set it too, or neither")
            return
        self._check(self.control_ssl_cert_reqs == 0 or self.control_ssl_ca_certs is not None, "control_ssl_ca_certs",
                    f"control_ssl_cert_reqs {self.control_ssl_cert_reqs} checks the gateways' client certificates "
                    f"against this CA: set it (or control_ssl_cert_reqs 0 for TLS without client certificates)")

    @staticmethod
    def _check(ok: bool, name: str, problem: str) -> None:
        if not ok:
            raise ConfigError(f"{name}: {problem}")

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return "cpu" if self.mode == "cpu" else "cuda"

    @property
    def batched_tokens(self) -> int:
        return self.max_num_batched_tokens or (256 if self.mode == "cpu" else 512)

    @property
    def num_seqs(self) -> int:
        if self.max_num_seqs:
            return self.max_num_seqs
        return 64 if self.mode == "cpu" else min(256, self.batched_tokens)

    @property
    def control_tls(self) -> bool:
        """The control plane (and a tcp agent) serve TLS."""
        return self.control_ssl_certfile is not None

    @property
    def ring_name(self) -> str:
        """`ring`, else a name stable across restarts derived from the control address (blink-<host>-<port>):
        a restarted backend then reclaims the ring a crashed one left. Control port 0 (a free one) has no
        stable name: blink-<pid>."""
        if self.ring:
            return self.ring
        return f"blink-{os.getpid()}" if self.control.endswith(":0") else stable_ring_name(self.control)

    def context_len_for(self, max_position_embeddings: int) -> int:
        return self.context_len or min(max_position_embeddings, 8192)

    def engine_config(self):
        from gpu_backend.engine.loop import EngineConfig

        return EngineConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, kv_cache_mb=self.kv_cache_mb,
                            max_num_batched_tokens=self.batched_tokens, max_num_seqs=self.num_seqs,
                            enable_prefix_caching=self.enable_prefix_caching)

    def gpu_runner_config(self, context_len: int):
        from gpu_backend.engine.gpu_runner import GpuRunnerConfig

        return GpuRunnerConfig(
            max_num_batched_tokens=self.batched_tokens, max_num_seqs=self.num_seqs, block_size=self.block_size,
            context_len=context_len, gpu_memory_fraction=self.gpu_memory_fraction, num_kv_blocks=self.num_kv_blocks,
            use_graphs=self.use_graphs or self.mode == "persistent", sampling_extensions=self.sampling_extensions,
            kv_cache_dtype=self.kv_cache_dtype)

    # ---- building it --------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace, defaults: argparse.Namespace | None = None) -> BackendConfig:
        """The file's settings (args.config, else $BLINK_BACKEND_CONFIG), then the environment's
        ($BLINK_PREFIX_CACHING), then every flag that differs from its default (`defaults`: the parser's
        defaults; None: every flag counts)."""
        path = getattr(args, "config", None) or env.get("BACKEND_CONFIG")
        settings = read_config_file(path) if path else {}
        settings.update(_env_settings())
        try:
            caching = env.get_bool("PREFIX_CACHING")
        except ValueError as exc:
            raise ConfigError(f"enable_prefix_caching: {exc}") from None
        if caching is not None:
            settings["enable_prefix_caching"] = caching
        for dest, value in vars(args).items():
            if dest == "config" or (defaults is not None and getattr(defaults, dest, object()) == value):
                continue
            name = _NEGATED.get(dest, dest)
            if name not in _FIELDS or (value is None and _FIELDS[name].type == "bool"):
                continue  # other commands' flags (serve's --host, --port) share the namespace; None: not given
            settings[name] = (not value) if dest in _NEGATED else value
        return cls(**settings)


_FIELDS = {f.name: f for f in dataclasses.fields(BackendConfig)}
# Fields that BLINK_<NAME> sets (over the config file, under flags): the TLS files, as on the gateway.
ENV_FIELDS = ("control_ssl_certfile", "control_ssl_keyfile", "control_ssl_ca_certs", "control_ssl_cert_reqs")


def _env_settings() -> dict:
    settings = {}
    for name in ENV_FIELDS:
        value = env.get(name.upper())
        if value is not None and _FIELDS[name].type == "int":
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"{env.PREFIX}{name.upper()}: {value!r} is not an integer") from None
        if value is not None:
            settings[name] = value
    return settings


def read_config_file(path: str | Path) -> dict:
    """`BackendConfig` fields from a YAML mapping; unknown keys and wrong types are named."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the backend config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{path}: unknown settings {', '.join(map(str, unknown))} (known: {', '.join(_FIELDS)})")
    for key, value in data.items():
        want = _FIELDS[key].type
        kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
        base = want.split(" |")[0]
        if value is None and "None" in want:
            continue
        ok = isinstance(value, kinds[base]) and not (base in ("int", "float") and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{path}: {key}: {value!r} is not a {base}")
    return dict(data)
