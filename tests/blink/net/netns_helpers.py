"""Network namespaces for tests: created and deleted by the test itself; a clear skip where that is impossible."""
from __future__ import annotations

import itertools
import os
import subprocess

import pytest

_counter = itertools.count()


def make_netns(prefix: str) -> str:
    """Create a namespace (skips the test when not root or the kernel refuses); delete with `drop_netns`."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root); skipping")
    name = f"{prefix}-{os.getpid()}-{next(_counter)}"
    res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {res.stderr.strip() or res.returncode}")
    return name


def drop_netns(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def kernel_has_vlan(netns: str) -> bool:
    """8021q support: some kernels (minimal VM kernels) have none."""
    ns = ["ip", "-n", netns]
    subprocess.run(ns + ["link", "add", "vprobe0", "type", "veth", "peer", "name", "vprobe1"], capture_output=True)
    ok = subprocess.run(ns + ["link", "add", "link", "vprobe0", "name", "vprobe0.5", "type", "vlan", "id", "5"],
                        capture_output=True).returncode == 0
    subprocess.run(ns + ["link", "del", "vprobe0"], capture_output=True)
    return ok


@pytest.fixture
def netns_pair():
    names = [make_netns("blink-a")]
    try:
        names.append(make_netns("blink-b"))
    except BaseException:
        drop_netns(names[0])
        raise
    yield names
    for name in names:
        drop_netns(name)
