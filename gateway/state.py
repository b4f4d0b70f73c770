"""What every front end (HTTP, gRPC) of one gateway shares."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .backends.route import Router
from .config import GatewayConfig
from .gc_policy import GcPolicy
from .metrics import Metrics
from .policy.keys import KeyStore
from .policy.quotas import Quotas
from .request.tokenize import TokenizerService
from .streaming.pacing import SetupPacer


@dataclass
class GatewayState:
    config: GatewayConfig
    router: Router
    tokenizers: dict[str, TokenizerService]  # by model name
    metrics: Metrics = field(default_factory=Metrics)
    # Request ids number requests in this gateway's logs, its replies and the ring's request_id word.
    request_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    started: int = field(default_factory=lambda: int(time.time()))
    keys: KeyStore = field(default_factory=KeyStore)  # who may call what (start_gateway fills it)
    quotas: Quotas = field(default_factory=Quotas)  # per-key usage (shared by the workers of `--workers N`)
    pacer: SetupPacer = field(default_factory=SetupPacer)  # request set-ups take turns with streaming
    gc: GcPolicy | None = None  # the collector's policy, once `serve_forever` started it (None: Python's own)
    open_connections: Callable[[], int] | None = None  # this worker's open HTTP connections (start_gateway sets it)
