"""Installs per role (pyproject.toml): the base dependencies plus the `gateway` extra hold every package the
gateway's code imports, and none of the backend's (torch and its kin stay in the `backend` extra)."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import names of distributions whose names differ from them.
IMPORT_NAMES = {"grpcio": "grpc", "grpcio-health-checking": "grpc_health", "grpcio-reflection": "grpc_reflection",
                "protobuf": "google", "pyyaml": "yaml", "prometheus-client": "prometheus_client"}
PROJECT = {"blink", "gateway", "gpu_backend", "kernels", "protocols"}
GATEWAY_CODE = ("gateway", "protocols", "blink/net", "blink/ctl.py", "blink/admin_client.py", "blink/cli.py")
# Imported only inside functions of the rdma transport: rdma-core's bindings (apt, not PyPI), and cuda-python on
# the backend side of protocols/rdma_verbs.py (a GPU host exporting its ring memory).
OUTSIDE_THE_EXTRAS = {"pyverbs", "cuda"}


def extras() -> dict[str, set[str]]:
    """'base' and each extra -> the import names of its distributions."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"base": project["dependencies"], **project["optional-dependencies"]}
    def name(requirement: str) -> str:
        dist = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower()
        return IMPORT_NAMES.get(dist, dist.replace("-", "_"))
    return {group: {name(r) for r in reqs} for group, reqs in groups.items()}


def third_party_imports(paths: tuple[str, ...]) -> dict[str, str]:
    """Top-level import name -> a file importing it (imports inside functions included)."""
    found: dict[str, str] = {}
    files = [f for p in paths for f in ([ROOT / p] if p.endswith(".py") else sorted((ROOT / p).rglob("*.py")))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            for top in (n.partition(".")[0] for n in names):
                if top not in sys.stdlib_module_names and top not in PROJECT:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_the_gateway_extra_covers_what_the_gateway_imports():
    groups = extras()
    have = groups["base"] | groups["gateway"] | OUTSIDE_THE_EXTRAS
    missing = {name: where for name, where in third_party_imports(GATEWAY_CODE).items() if name not in have}
    assert not missing, f"imported by the gateway but in neither the base dependencies nor the gateway extra: {missing}"


def test_the_backend_packages_are_only_in_the_backend_extra():
    groups = extras()
    assert {"torch", "safetensors", "gguf"} <= groups["backend"]
    assert not ({"torch", "safetensors", "gguf", "triton"} & (groups["base"] | groups["gateway"]))


def test_no_other_installed_distribution_ships_one_of_our_top_level_packages():
    # Two distributions with one import name overwrite each other in site-packages, and whichever comes first on
    # sys.path wins every import: transformers 5.25 requires Hugging Face's `kernels` and then imported this
    # project's kernels/ as it (pyproject.toml pins the test extra's transformers below 5.25 for that reason).
    import importlib.metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    owners = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(owners.get(name, ())) - {project}) for name in sorted(PROJECT)}
    clashes = {name: dists for name, dists in clashes.items() if dists}
    assert not clashes, (f"installed distributions that ship a top-level package of this project's name: {clashes} "
                         "(uninstall them from this environment, e.g. `pip uninstall kernels`)")
