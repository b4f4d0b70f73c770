"""Shared libraries built from C sources on first use, cached by a hash of their sources and flags.

The one such helper: the gateway's native stream round and kernels/ (the host scheduler, the GPU loop) both
use it (neither side may import the other's code); no dependency beyond the standard library."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path


def find_compiler(candidates: Iterable[str | None]) -> str | None:
    """The path of the first of `candidates` (None entries skipped) found on PATH; None when there is none."""
    for name in candidates:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cached_build(stem: str, sources: tuple[Path, ...], argv: list[str], cache_dir: Path) -> Path:
    """Run `argv + ["-o", <lib>]` unless a library built from these exact sources and flags is in `cache_dir`.
    Raises RuntimeError with the compiler's output when the build fails."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(argv).encode())
    out = cache_dir / f"{stem}-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        res = subprocess.run([*argv, "-o", str(tmp_so)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {sources[0].name} failed:\n{res.stderr}")
        os.replace(tmp_so, out)  # atomic: a concurrent build loads either copy
    return out
