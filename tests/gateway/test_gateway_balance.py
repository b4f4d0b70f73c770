"""gateway/balance.py's supervisor side, with the workers played here: the port refuses connections until a worker
has reported, each connection reaches the worker with the fewest (reported open + passed since), ties go round,
and a worker that closed its end gets none."""

from __future__ import annotations

import socket
import struct

import pytest

from gateway.balance import Listener

REPORT = struct.Struct("<QQ")


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _pass_on(listener: Listener, rounds: int = 5) -> None:
    for _ in range(rounds):
        listener.poll(0.05)


def _taken(theirs: socket.socket) -> int:
    """How many connections a played worker received (each one message with one descriptor)."""
    theirs.setblocking(False)
    n = 0
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(theirs, 16, 4)
        except BlockingIOError:
            return n
        for fd in fds:
            socket.socket(fileno=fd).close()
        n += len(fds)


@pytest.fixture
def listener(pick_free_port):
    lst = Listener("127.0.0.1", pick_free_port(), 64, 3)
    yield lst
    lst.close()


def test_refused_until_a_worker_reports_then_passed_by_fewest_open(listener):
    port = listener.sockets[0].getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        _connect(port)
    workers = [theirs for _, theirs in listener.pairs]
    workers[0].send(REPORT.pack(0, 5))  # worker 0 serves, 5 connections open
    workers[1].send(REPORT.pack(0, 1))  # worker 1 serves, 1 open; worker 2 has not reported: none for it
    _pass_on(listener)
    conns = [_connect(port) for _ in range(6)]
    _pass_on(listener)
    assert [_taken(w) for w in workers] == [1, 5, 0]  # worker 1 to 5 open, then a tie: worker 0 by turn
    workers[2].send(REPORT.pack(0, 0))
    workers[0].close()  # worker 0 exits: its end closes
    _pass_on(listener)
    conns += [_connect(port) for _ in range(4)]
    _pass_on(listener)
    assert [_taken(w) for w in workers[1:]] == [0, 4]  # worker 1 is at 6 by the estimate, worker 2 at 0
    for c in conns:
        c.close()


def test_a_taken_port_fails_at_once(pick_free_port):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError):
            Listener("127.0.0.1", taken.getsockname()[1], 64, 2)
