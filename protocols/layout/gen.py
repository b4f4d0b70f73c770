"""Write (or check) every generated layout file from its declaration.

    python -m protocols.layout.gen            # regenerate the committed files
    python -m protocols.layout.gen --check    # exit 1 naming each file that differs from its declaration
    python -m protocols.layout.gen --out DIR  # write under DIR instead of the repository (CI diffs that)
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from protocols.layout import Layout, Struct
from protocols.layout.compute import lay_out_all
from protocols.layout.render_c import render_c
from protocols.layout.render_py import render_py

COMMAND = "python -m protocols.layout.gen"
ROOT = Path(__file__).resolve().parents[2]
# Each module defines LAYOUT (a protocols.layout.Layout), next to the code that owns the layout.
DECLARATIONS = ("protocols.ring_decl", "kernels.loop_decl", "kernels.step_decl", "kernels.sched_decl",
                "gateway.streaming.stream_round_decl")


def layouts() -> list[Layout]:
    out = []
    for name in DECLARATIONS:
        layout = importlib.import_module(name).LAYOUT
        out.append(Layout(**{**layout.__dict__, "source": name.replace(".", "/") + ".py"}))
    return out


def render(layout: Layout) -> dict[str, str]:
    """{path from the repository root: text} of the layout's two generated files."""
    laid = lay_out_all([i for i in layout.items if isinstance(i, Struct)])
    return {layout.py_out: render_py(layout, laid, COMMAND), layout.c_out: render_c(layout, laid, COMMAND)}


def generated_files() -> dict[str, str]:
    files: dict[str, str] = {}
    for layout in layouts():
        files.update(render(layout))
    return files


def stale(root: Path = ROOT) -> list[str]:
    """The generated files under `root` that are missing or differ from their declarations."""
    return [path for path, text in generated_files().items()
            if not (root / path).is_file() or (root / path).read_text() != text]


def write(root: Path = ROOT) -> list[str]:
    written = []
    for path, text in generated_files().items():
        target = root / path
        if target.is_file() and target.read_text() == text:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a file differs")
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write under (default: the repository)")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        for path in bad:
            print(f"{path}: differs from its declaration; run `{COMMAND}`", file=sys.stderr)
        return 1 if bad else 0
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
