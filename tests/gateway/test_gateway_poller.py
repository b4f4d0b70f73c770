"""The request path meets the pollers at the steps `gateway.streaming.poller.CHECKPOINTS` lists, and nowhere
else: a checkpoint added or dropped anywhere in gateway/ must show in that one list."""
from __future__ import annotations

import ast
from pathlib import Path

from gateway.streaming.poller import CHECKPOINTS

ROOT = Path(__file__).resolve().parents[2]


def checkpoint_callers(root: Path) -> set[tuple[str, str]]:
    """(module, function) of every call of `poll_checkpoint` under `root`/gateway."""
    callers = set()
    for path in sorted((root / "gateway").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) \
                        == "poll_checkpoint":
                    callers.add((module, fn.name))
    return callers


def test_every_checkpoint_is_one_of_the_listed_steps():
    callers = checkpoint_callers(ROOT)
    assert set(CHECKPOINTS) <= callers, f"listed but not taken: {set(CHECKPOINTS) - callers}"
    assert callers <= set(CHECKPOINTS), f"not in gateway.streaming.poller.CHECKPOINTS: {callers - set(CHECKPOINTS)}"


def test_the_scan_finds_a_checkpoint(tmp_path):
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "x.py").write_text("async def step():\n    poll_checkpoint()\n")
    assert checkpoint_callers(tmp_path) == {("gateway.x", "step")}
