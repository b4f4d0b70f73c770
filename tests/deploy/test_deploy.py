"""deploy/: network profiles validate against the schema, every YAML file parses, units (with their drop-ins)
pass systemd-analyze, the Kubernetes overlays render with kustomize where kubectl is installed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from blink.net.profile import load_profile

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROFILES = sorted((DEPLOY / "net").glob("*.yaml"))
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
OVERLAYS = sorted((DEPLOY / "k8s-mtls").glob("*.yaml"))  # mutual TLS between gateways and backends
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
DROP_INS = sorted((DEPLOY / "systemd").glob("*.service.d/*.conf"))


def test_there_is_something_to_check():
    assert len(PROFILES) >= 3 and len(MANIFESTS) >= 3 and len(UNITS) >= 2
    assert (DEPLOY / "containers" / "Dockerfile.gateway").exists() and (DEPLOY / "containers" / "Dockerfile.backend").exists()


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_network_profiles_validate(path):
    profile = load_profile(path)
    assert profile.links or profile.addresses or profile.routes


@pytest.mark.parametrize("path", MANIFESTS + OVERLAYS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kubernetes_manifests_parse(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all("apiVersion" in d and "kind" in d for d in docs)


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in MANIFESTS if p.name != "kustomization.yaml"}


def test_the_mtls_overlay_names_its_patches_and_renders():
    kustomization = yaml.safe_load((DEPLOY / "k8s-mtls" / "kustomization.yaml").read_text())
    assert {p["path"] for p in kustomization["patches"]} == {p.name for p in OVERLAYS if p.name != "kustomization.yaml"}
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here; the overlay was not rendered")
    res = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s-mtls")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rendered = {d["kind"]: d for d in yaml.safe_load_all(res.stdout)}
    backend = rendered["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    gateway = rendered["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"] for e in backend["env"]} >= {"BLINK_CONTROL_SSL_CERTFILE", "BLINK_CONTROL_SSL_CA_CERTS", "NODE_IP"}
    assert {e["name"] for e in gateway["env"]} >= {"BLINK_BACKEND_SSL_CERTFILE", "BLINK_BACKEND_SSL_CA_CERTS"}
    assert "grpc" not in backend["readinessProbe"]  # kubelet's gRPC probes cannot speak TLS


def test_drop_in_variables_are_real():
    """The BLINK_* variables the systemd drop-ins set are ones the gateway or the backend reads."""
    from gateway import env as gateway_env
    from gpu_backend import env as backend_env
    known = {v.name for v in gateway_env.VARIABLES} | {backend_env.PREFIX + n for n in backend_env.VARS}
    assert DROP_INS
    for path in DROP_INS:
        for line in path.read_text().splitlines():
            if line.startswith("Environment="):
                name = line.split("=", 2)[1]
                assert name in known, f"{path}: {name} is read by nobody"


def test_env_files_name_real_flags():
    """Every --flag in the example configs exists on the command it is passed to."""
    from gpu_backend.main import add_backend_args
    import argparse
    parser = argparse.ArgumentParser()
    add_backend_args(parser)
    known = {s for a in parser._actions for s in a.option_strings}
    for env in (DEPLOY / "configs").glob("*/backend.env"):
        for line in env.read_text().splitlines():
            if line.startswith("BLINK_BACKEND_ARGS="):
                flags = {w for w in line.split("=", 1)[1].split() if w.startswith("--")}
                assert flags <= known, f"{env}: unknown flags {flags - known}"


def test_systemd_units_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here; the units were not verified")
    stub = tmp_path / "bin"
    stub.mkdir()
    for name in ("blink", "blinkctl"):  # the units name the installed commands; stand-ins for the check
        (stub / name).write_text("#!/bin/sh\n")
        (stub / name).chmod(0o755)
    for unit in UNITS:
        (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/blink/venv/bin/", f"{stub}/"))
    for drop_in in DROP_INS:  # next to the unit, where systemd-analyze looks for them
        (tmp_path / drop_in.parent.name).mkdir(exist_ok=True)
        (tmp_path / drop_in.parent.name / drop_in.name).write_text(drop_in.read_text())
    res = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / u.name) for u in UNITS)],
                         capture_output=True, text=True, timeout=60)
    if res.returncode != 0 and "Failed to" in res.stderr and "bus" in res.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {res.stderr.strip()[:200]}")
    assert res.returncode == 0, res.stderr
    assert "Unknown" not in res.stderr and "tls.conf" not in res.stderr, res.stderr  # a drop-in's keys were read
    assert "CPUAffinity=" in (DEPLOY / "systemd" / "blink-gateway.service").read_text()
