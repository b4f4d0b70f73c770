"""Bench test helpers: the backend process of the session's live `blink serve`."""
from __future__ import annotations

import pytest

from blink.bench.collectors import child_pids_matching


@pytest.fixture(scope="session")
def backend_pid(live_server) -> int:
    found = child_pids_matching(live_server.proc.pid, "blink.cli backend")
    assert len(found) == 1, f"expected one backend under blink serve, found {found}"
    return found[0]
