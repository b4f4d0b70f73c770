"""Gateway configuration: one frozen dataclass (its environment variables: `gateway/env.py`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from protocols.messages import STALL_AFTER_OTHER_S, STALL_AFTER_S

MiB = 1 << 20
# Seconds of an unchanged heartbeat, with work pending, before ejection; per engine mode (see GatewayConfig).
HEARTBEAT_TIMEOUTS_S = {**STALL_AFTER_S, "default": STALL_AFTER_OTHER_S}  # protocols/messages.py
BACKEND_TLS_FIELDS = ("backend_ssl_certfile", "backend_ssl_keyfile", "backend_ssl_ca_certs")
ROUTING_POLICIES = ("least_outstanding_tokens", "most_free_kv", "prefix_affinity", "prefix_cache")  # gateway/backends/route.py
WORKER_BALANCES = ("connections", "kernel")  # --worker-balance (gateway/balance.py): the first is the default


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50052  # the gRPC inference API (protocols/inference.proto); 0 turns it off
    backend_addrs: tuple[str, ...] = ("127.0.0.1:50051",)  # control-plane gRPC addresses
    # The ring the one backend must announce (`blink serve` sets the name its backend created): a control
    # address answered by another instance's backend is refused instead of adopted. None: any ring.
    expect_ring: str | None = None
    # Secrets stay out of repr (and so out of logs and tracebacks that print a config).
    api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)  # empty: no authentication
    admin_keys: frozenset[str] = field(default_factory=frozenset, repr=False)  # plain admin keys (--admin-key)
    keys_file: str | None = None  # hashed client/admin keys with limits (gateway/policy/keys.py)
    workers: int = 1  # gateway processes sharing the port (SO_REUSEPORT)
    # how --workers spread the HTTP port's connections: "connections" (the supervisor accepts and passes each to
    # the worker with the fewest open: gateway/balance.py) or "kernel" (SO_REUSEPORT's hash)
    worker_balance: str = "connections"
    worker_index: int = 0  # which of them this one is (it owns ring slots i, i + workers, ...)
    accept_fd: int | None = None  # a worker under "connections": where its connections come from (the supervisor's)
    limits_table: str | None = None  # the workers' shared per-key usage file (set by the supervisor)
    max_body_bytes: int = 4 * MiB
    # Slow clients (slowloris): a connection must deliver a whole request head within header_timeout_s
    # of opening (or of its previous request's end: this also bounds idle keep-alive), and a request's
    # whole body within body_timeout_s of its head; otherwise it is closed (the body with a 408 first).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # For requests that set no max_tokens, on every endpoint. None: the API's own default (completions
    # and gRPC 16, as OpenAI and vLLM; chat what the context leaves after the prompt, as vLLM).
    default_max_tokens: int | None = None
    slot_wait_s: float = 30.0  # how long a request waits for a free ring slot before a 503
    connect_timeout_s: float = 300.0  # how long startup waits for a backend to answer Describe
    # Poller sleep while requests are in flight. Event-loop timers tick in whole milliseconds: under
    # 1 ms uvloop rounds the sleep to zero and the poller spins on its core (right for a dedicated DPU
    # core, wrong beside a CPU engine).
    poll_active_s: float = 0.001
    # ... except within poll_spin_s of the last news: then the poller polls again as soon as the readers
    # it woke have run (no timer), so tokens that keep flowing wait for no millisecond tick. Long enough to
    # ride out an engine's pause of a few ms: a sleep begun in one costs the tokens that end it ~1.2 ms
    # (uvloop's tick; bench/RESULTS.md, stream3). A `cpu` engine computes on this host's cores, so a
    # poller of one spins at most CPU_ENGINE_SPIN_S (gateway/backends/backend.py). 0: always sleep.
    poll_spin_s: float = 0.02
    # While a request is set up or ended (parsing, tokenizing, submitting, its response head, metrics), the
    # pollers get a round at each step of that work once their last began this long ago, so that open
    # streams' tokens wait for one step of another request's work rather than for all of it
    # (`backends.poll_checkpoint`). 0: only the poller's own rounds.
    poll_checkpoint_s: float = 0.0001
    # Plain streams (one choice, no stop strings, no logprobs) on shared-memory rings are delivered by the
    # poller's round in C once their first chunk is out (gateway/streaming/stream_round.py): a token costs a table
    # lookup, a JSON escape and its socket write instead of ~20-35 us of Python. False: the Python path only.
    native_stream: bool = True
    # The cyclic garbage collector (gateway/gc_policy.py): every gc_freeze_s what survived is frozen out of
    # its sight, so that no collection walks the open requests' objects (a 7-52 ms stall at 512 streams);
    # a full collection once the process has grown by gc_full_growth_blocks small-object blocks.
    # gc_freeze_s 0: Python's own collector (young threshold 20,000).
    gc_freeze_s: float = 0.1
    # Structured outputs' token masks a worker computes at once (gateway/structured/mask_loop.py: its pool has 8
    # threads, so grammars slow on a step hold up no one; this many compute at a time). 0: the cores this process
    # may run on shared among the workers, less one for the worker's event loop, 1 to 8 (more cost every mask:
    # bench/RESULTS.md).
    grammar_concurrency: int = 0
    gc_full_growth_blocks: int = 1_000_000
    heartbeat_check_s: float = 1.0  # how often the poller looks at the engine heartbeat
    stall_timeout_s: float = 60.0  # heartbeat unchanged this long with requests in flight: fail them
    # Heartbeat unchanged this long while the backend has work (requests in flight or waiting for a slot):
    # ejected from routing until it moves (gateway/pool.py). Per engine mode: a GPU loop beats every few
    # microseconds, while a cpu engine computes on cores it shares and one step on a busy host can take
    # seconds. "default" covers other modes. heartbeat_timeout_s, when set, is one value for every mode.
    heartbeat_timeouts_s: Mapping[str, float] = field(default_factory=lambda: dict(HEARTBEAT_TIMEOUTS_S))
    tcp_idle_timeout_s: float = 3.0  # tcp transport: no frame from the agent this long = connection lost
    rdma_device: str | None = None  # rdma transport: local device name (None: the first one)
    tokenizer_threads: int = 2
    # One request set-up per event-loop pass, so that a burst of arrivals does not hold up the tokens of
    # open streams (gateway/streaming/pacing.py). False: every ready set-up runs at once (for measuring).
    setup_pacing: bool = True
    shutdown_timeout_s: float = 5.0  # on SIGTERM, how long open streams may finish before they are cut
    access_log: bool = True
    log_format: str = "text"  # or "json": one object per line, with request ids as fields
    # Many backends (gateway/backends/pool.py, gateway/backends/route.py).
    config_file: str | None = None  # YAML file of backends and settings, read again on SIGHUP
    routing: str = "least_outstanding_tokens"  # or most_free_kv, prefix_affinity, prefix_cache
    heartbeat_timeout_s: float | None = None  # every mode's heartbeat_timeouts_s at once (None: per mode)
    health_check_s: float = 0.2  # how often the pool looks at heartbeats (ejection within timeout + this)
    probe_interval_s: float = 0.5  # how often the pool asks each backend's control plane whether it lives
    affinity_prefix_len: int = 64  # prefix_affinity: leading prompt tokens hashed (in whole 16-token blocks)
    affinity_max_extra_tokens: int = 2048  # prefix_affinity: leave the chosen backend when this much busier
    # prefix_cache (gateway/backends/prefix_index.py): leave the backend holding the longest prefix for the least
    # loaded one when its outstanding tokens are over ratio x that one's and slack more; index cap per backend
    # in blocks (None: the backend's total KV blocks)
    prefix_cache_balance_ratio: float = 1.5
    prefix_cache_balance_slack_tokens: int = 4096
    prefix_cache_max_blocks: int | None = None
    # TLS (gateway/tls.py), with vLLM's names: HTTPS and the gRPC API on certfile + keyfile (PEM; no keyfile:
    # the key is in the certfile); clients' certificates checked against ca_certs as ssl_cert_reqs says
    # (Python's ssl.CERT_*: 0 none, 1 optional, 2 required). Re-read on SIGHUP.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # A listener of its own for /metrics and /admin/* (then 404 on the public port). admin_port None: no
    # such listener; 0: a free port. admin_host None: `host`.
    admin_host: str | None = None
    admin_port: int | None = None
    metrics_key: str | None = field(default=None, repr=False)  # /metrics then needs `Bearer <metrics_key>`
    # Mutual TLS toward the backends (their gRPC control planes and tcp agents; gateway/tls.py): their
    # certificates are checked against backend_ssl_ca_certs (and must name the address dialled), and the
    # gateway presents backend_ssl_certfile + keyfile (no keyfile: the key is in the certfile). Files are
    # read at each new connection. None: plaintext, as backends without --control-ssl-* serve.
    backend_ssl_certfile: str | None = None
    backend_ssl_keyfile: str | None = None
    backend_ssl_ca_certs: str | None = None
    # Per backend (the config file's `backends: [{addr, ssl_certfile, ssl_keyfile, ssl_ca_certs}]`): these
    # backend_ssl_* fields for that address instead (`for_backend`), e.g. a backend of another site and CA.
    backend_tls_by_addr: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_listeners()
        self._check_backend_tls()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [0, 65535] (0: no gRPC API), got {self.grpc_port}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be 'text' or 'json', got {self.log_format!r}")
        if not self.backend_addrs:
            raise ValueError("at least one backend address is needed")
        if self.expect_ring is not None and len(self.backend_addrs) != 1:
            raise ValueError(f"expect_ring names the ring of one backend; {len(self.backend_addrs)} are configured")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not 0 <= self.worker_index < self.workers:
            raise ValueError(f"worker_index must be in [0, workers={self.workers}), got {self.worker_index}")
        if self.worker_balance not in WORKER_BALANCES:
            raise ValueError(f"worker_balance must be one of {', '.join(WORKER_BALANCES)}, got {self.worker_balance!r}")
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 needs a fixed port (with port 0 each worker would pick its own)")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError(f"header_timeout_s and body_timeout_s must be positive, got "
                             f"{self.header_timeout_s:g} and {self.body_timeout_s:g}")
        if self.slot_wait_s <= 0 or self.poll_active_s <= 0 or self.poll_spin_s < 0 or self.poll_checkpoint_s < 0:
            raise ValueError("slot_wait_s and poll_active_s must be positive, poll_spin_s and poll_checkpoint_s "
                             "not negative")
        if self.gc_freeze_s < 0 or self.gc_full_growth_blocks < 1:
            raise ValueError(f"gc_freeze_s must not be negative and gc_full_growth_blocks must be >= 1, got "
                             f"{self.gc_freeze_s:g} and {self.gc_full_growth_blocks}")
        if not 0 <= self.grammar_concurrency <= 64:
            raise ValueError(f"grammar_concurrency must be 0 (automatic: the worker's share of the cores less one, "
                             f"1 to 8) or 1..64, got {self.grammar_concurrency}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        self._check_prefix_cache()
        timeouts = [*self.heartbeat_timeouts_s.values()] + [t for t in (self.heartbeat_timeout_s,) if t is not None]
        if min(*timeouts, self.health_check_s, self.probe_interval_s) <= 0:
            raise ValueError("heartbeat timeouts, health_check_s and probe_interval_s must be positive")
        if "default" not in self.heartbeat_timeouts_s:
            raise ValueError("heartbeat_timeouts_s needs a 'default' entry (for modes it does not name)")

    def _check_backend_tls(self) -> None:
        """Backend TLS needs the CA that signs the backends' certificates; a key needs its certificate."""
        if self.backend_ssl_keyfile is not None and self.backend_ssl_certfile is None:
            raise ValueError("backend_ssl_keyfile needs backend_ssl_certfile (the client certificate it belongs to)")
        if self.backend_ssl_certfile is not None and self.backend_ssl_ca_certs is None:
            raise ValueError("backend_ssl_certfile needs backend_ssl_ca_certs: the CA that signs the backends' "
                             "certificates (the gateway trusts no other for them)")
        for addr, fields in self.backend_tls_by_addr.items():
            unknown = set(fields) - set(BACKEND_TLS_FIELDS)
            if unknown:
                raise ValueError(f"backend {addr}: unknown TLS settings {', '.join(sorted(unknown))}")
            try:
                self.for_backend(addr)
            except ValueError as exc:
                raise ValueError(f"backend {addr}: {exc}") from None

    def _check_prefix_cache(self) -> None:
        if not self.prefix_cache_balance_ratio >= 1 or self.prefix_cache_balance_slack_tokens < 0:
            raise ValueError(f"prefix_cache_balance_ratio must be >= 1 and prefix_cache_balance_slack_tokens >= 0, got "
                             f"{self.prefix_cache_balance_ratio} and {self.prefix_cache_balance_slack_tokens}")
        if self.prefix_cache_max_blocks is not None and self.prefix_cache_max_blocks < 1:
            raise ValueError(f"prefix_cache_max_blocks must be >= 1 (or unset), got {self.prefix_cache_max_blocks}")

    def _check_listeners(self) -> None:
        """A key needs its certificate, a client check its CA; the admin listener has a port of its own."""
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ssl_keyfile needs ssl_certfile (the certificate chain it belongs to)")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required), "
                             f"got {self.ssl_cert_reqs!r}")
        if self.ssl_certfile is None and (self.ssl_ca_certs is not None or self.ssl_cert_reqs):
            raise ValueError("ssl_ca_certs and ssl_cert_reqs need TLS on: set ssl_certfile and ssl_keyfile")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("ssl_cert_reqs 1 or 2 checks client certificates: set ssl_ca_certs "
                             "(the CA that signs them)")
        if self.admin_port is None and self.admin_host is not None:
            raise ValueError("admin_host needs admin_port (the admin listener's port; 0 picks a free one)")
        if self.admin_port is not None and not 0 <= self.admin_port < 65536:
            raise ValueError(f"admin_port must be in [0, 65535], got {self.admin_port}")
        if self.admin_port and self.admin_port in (self.port, self.grpc_port):
            raise ValueError(f"admin_port {self.admin_port} is taken by port or grpc_port: choose another")
        if self.metrics_key is not None and not self.metrics_key.strip():
            raise ValueError("metrics_key must not be empty (unset it to leave /metrics open)")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def for_backend(self, addr: str) -> GatewayConfig:
        """This config with the backend's own TLS settings, when the config file gives it some."""
        fields = self.backend_tls_by_addr.get(addr)
        return self if not fields else dataclasses.replace(self, backend_tls_by_addr={}, **fields)

    @property
    def backend_tls(self) -> bool:
        """Backends are dialled over TLS (control planes and tcp agents)."""
        return self.backend_ssl_ca_certs is not None

    @property
    def separate_admin(self) -> bool:
        """/metrics and /admin/* on a listener of their own (not on the public port)."""
        return self.admin_port is not None

    def heartbeat_timeout_for(self, engine_mode: str) -> float:
        """How long a backend of `engine_mode` with work may leave its heartbeat unchanged before ejection."""
        if self.heartbeat_timeout_s is not None:
            return self.heartbeat_timeout_s
        return self.heartbeat_timeouts_s.get(engine_mode, self.heartbeat_timeouts_s["default"])

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def replace(self, **changes) -> GatewayConfig:
        return dataclasses.replace(self, **changes)

