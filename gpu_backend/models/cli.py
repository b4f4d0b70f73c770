"""`blink model ...` subcommands. Wire with `add_model_commands(subparsers)`; each parser sets
`func`, called as `args.func(args)` and returning an exit code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_USER_ERRORS = (FileNotFoundError, FileExistsError, ValueError, RuntimeError)


def add_model_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    model = subparsers.add_parser("model", help="import GGUF files and fetch the demo model")
    sub = model.add_subparsers(dest="model_command", metavar="{import,demo}")
    sub.required = True
    imp = sub.add_parser("import", help="convert a llama GGUF file into a Hugging Face model folder")
    imp.add_argument("gguf", type=Path, help="input .gguf file")
    imp.add_argument("out_dir", type=Path, help="output folder (created; must not hold a model)")
    imp.add_argument("--quiet", action="store_true", help="no progress bar")
    imp.set_defaults(func=cmd_model_import)
    demo = sub.add_parser("demo", help="fetch and import SmolLM2-135M-Instruct once; print its folder")
    demo.add_argument("--cache-dir", type=Path, default=None, help="default: $BLINK_CACHE or ~/.cache/blink")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    demo.set_defaults(func=cmd_model_demo)
    return model


def cmd_model_import(args: argparse.Namespace) -> int:
    from .gguf_import import import_gguf
    return _run(lambda: import_gguf(args.gguf, args.out_dir, progress=not args.quiet))


def cmd_model_demo(args: argparse.Namespace) -> int:
    from .demo import ensure_demo_model
    return _run(lambda: ensure_demo_model(args.cache_dir, progress=not args.quiet))


def _run(action) -> int:
    try:
        print(action())
    except _USER_ERRORS as e:
        print(f"blink model: error: {e}", file=sys.stderr)
        return 1
    return 0
