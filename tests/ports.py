"""Free local ports for the servers the tests start: each suite has its own range, so two
sessions (or two suites) running at once do not take each other's."""

from __future__ import annotations

import socket


def free_ports(count: int, ports: range) -> list[int]:
    """`count` ports of `ports` that nobody listens on."""
    found = []
    for port in ports:
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
