"""The backend's environment variables: every one declared and documented here, read through `get`.

One prefix, BLINK_. Nothing else under gpu_backend/ reads os.environ; flags and the config file
(`gpu_backend/config.py`) are the way to set everything else. (kernels/ sits below gpu_backend/ and reads its
own build variables, BLINK_CACHE included, with the same meaning; the CLI reads BLINK_LOG_LEVEL.)
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX = "BLINK_"


@dataclass(frozen=True)
class EnvVar:
    name: str  # without the prefix
    doc: str
    default: str | None = None


VARS = {v.name: v for v in (
    EnvVar("CACHE", "where the demo model, random-model tokenizers and compiled kernels are cached",
           "~/.cache/blink"),
    EnvVar("BACKEND_CONFIG", "the backend's YAML config file when --config is not given (gpu_backend/config.py)"),
    EnvVar("CONTROL_SSL_CERTFILE", "TLS certificate of the control plane and tcp agent, PEM (--control-ssl-certfile)"),
    EnvVar("CONTROL_SSL_KEYFILE", "its private key, PEM (--control-ssl-keyfile)"),
    EnvVar("CONTROL_SSL_CA_CERTS", "CA that signs gateways' client certificates, PEM (--control-ssl-ca-certs)"),
    EnvVar("CONTROL_SSL_CERT_REQS", "gateways' client certificates: 0 none, 1 optional, 2 required "
           "(--control-ssl-cert-reqs; default 2)"),
    EnvVar("PREFIX_CACHING", "0 or 1: the backend's enable_prefix_caching over its config file (a flag wins)"),
    EnvVar("L2_PREFETCH", "0, 1 or 2: one-token steps read each layer's o-projection weights into L2 on a side "
           "stream while the attention runs (1), and an MoE layer's next qkv while it routes (2) (kernels/prefetch.py, "
           "engine/gpu_ops.py); read when a runner builds its graphs", "0"),
    EnvVar("LOOP_STATS_S", "persistent mode, a diagnostic: every N seconds log what the GPU loop's counters moved by "
           "(steps, tokens, step time, speculation; engine/persistent.py LoopStatsLog); unset or 0: off"),
)}


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """BLINK_<name> if set (and not empty), else its declared default. Unknown names are a bug: KeyError."""
    var = VARS[name]
    value = (os.environ if environ is None else environ).get(PREFIX + name)
    return value if value else var.default


def get_bool(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """BLINK_<name> as a boolean (1/true/yes/on, 0/false/no/off), None when unset; anything else: ValueError."""
    value = get(name, environ)
    if value is None:
        return None
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{PREFIX}{name}={value!r} is not a boolean (use 1 or 0)")


def cache_dir() -> Path:
    return Path(get("CACHE")).expanduser()


def describe() -> str:
    """One line per variable, for --help texts and docs."""
    return "\n".join(f"{PREFIX}{v.name}: {v.doc}" + (f" (default {v.default})" if v.default else "")
                     for v in VARS.values())


def use_eager_module_loading() -> None:
    """Load every CUDA kernel up front (CUDA's own variables, set for this process and its children): a
    spinning loop kernel and lazy module loading can deadlock."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    os.environ.setdefault("CUDA_MODULE_DATA_LOADING", "EAGER")
