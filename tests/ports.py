"""Free local ports for the servers the tests start: each suite has its own range, so two
sessions (or two suites) running at once do not take each other's."""

from __future__ import annotations

import os
import socket


def in_worker_order(ports: range) -> list[int]:
    """The range, started at a different place by each xdist worker: two workers scanning for a
    free port at the same moment then seldom pick the same one (nothing reserves it between the
    check and the server's bind)."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    shift = (index * len(ports)) // max(count, 1)
    return [*ports[shift:], *ports[:shift]]


def free_ports(count: int, ports: range) -> list[int]:
    """`count` ports of `ports` that nobody listens on."""
    found = []
    for port in in_worker_order(ports):
        with socket.socket() as s:
            # SO_REUSEADDR, as gunicorn and redis bind: closing connections of a past run do not
            # count as taken.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"fewer than {count} free ports in {ports.start}..{ports.stop - 1}")


def free_port(ports: range) -> int:
    return free_ports(1, ports)[0]
