"""The gateway's environment variables live in one registry (`gateway/env.py`) and are read nowhere else."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from gateway import env
from gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]


def environ_reads(path: Path) -> list[int]:
    """Lines that read the environment (`os.environ.get`, `os.environ[...]`, `os.getenv`, `from os import environ`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("getenv", "getenvb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "get" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "environ":
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ" \
                and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name == "environ" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_nothing_but_the_registry_reads_the_environment():
    files = [p for p in sorted((ROOT / "gateway").rglob("*.py")) if p != ROOT / "gateway" / "env.py"]
    files.append(ROOT / "blink" / "cli.py")
    reads = {str(p.relative_to(ROOT)): lines for p in files if (lines := environ_reads(p))}
    assert not reads, f"read the environment outside gateway/env.py: {reads}"


def test_the_scan_sees_each_way_of_reading(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import os\nfrom os import environ\na = os.environ.get('X')\nb = os.getenv('Y')\n"
                    "c = os.environ['Z']\nd = {**os.environ}\n")
    assert sorted(environ_reads(path)) == [2, 3, 4, 5]  # passing the whole environment on is no read


def test_each_variable_is_named_once_and_sets_a_real_field():
    names = [v.name for v in env.VARIABLES]
    assert len(names) == len(set(names))
    fields = {f.name for f in dataclasses.fields(GatewayConfig)}
    assert all(v.field in fields for v in env.VARIABLES if v.field), [v.field for v in env.VARIABLES]
    assert all(v.name.startswith(env.PREFIX) for v in env.VARIABLES if v is not env.CC)


def test_variables_become_config_fields():
    overrides = env.config_overrides({"BLINK_API_KEY": "a, b,", "BLINK_BACKENDS": "h1:1,h2:2", "BLINK_WORKERS": "3",
                                      "BLINK_BODY_TIMEOUT": "2.5", "BLINK_LOG_LEVEL": "DEBUG", "BLINK_CONFIG": ""})
    assert overrides == {"api_keys": frozenset({"a", "b"}), "backend_addrs": ("h1:1", "h2:2"), "workers": 3,
                         "body_timeout_s": 2.5}  # an empty value is unset; LOG_LEVEL sets no field
    GatewayConfig(**overrides)


def test_a_bad_value_names_its_variable():
    with pytest.raises(ValueError, match="BLINK_GATEWAY_PORT='eighty'"):
        env.config_overrides({"BLINK_GATEWAY_PORT": "eighty"})


def test_defaults_apply_when_unset():
    assert env.LOG_LEVEL.get({}) == "INFO"
    assert env.CACHE.value({}) == Path("~/.cache/blink").expanduser()
    assert env.CACHE.value({"BLINK_CACHE": "/tmp/c"}) == Path("/tmp/c")
    assert env.API_KEY.value({}) is None


def test_the_mask_step_limit_defaults_to_5_s_and_is_read_by_the_mask_loop():
    from gateway.structured import mask_loop
    assert env.MASK_STEP_LIMIT_S.value({}) == 5.0
    assert env.MASK_STEP_LIMIT_S.value({"BLINK_MASK_STEP_LIMIT_S": "60"}) == 60.0
    assert mask_loop.MASK_STEP_LIMIT_S == env.MASK_STEP_LIMIT_S.value()
    with pytest.raises(ValueError, match="BLINK_MASK_STEP_LIMIT_S"):
        env.MASK_STEP_LIMIT_S.value({"BLINK_MASK_STEP_LIMIT_S": "soon"})
