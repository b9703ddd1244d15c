"""Free TCP ports on this machine, for servers started by tests, benchmarks and `BackgroundServer`."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (from its ephemeral range)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def quiet_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range and above Ray's worker ports (10002-19999).

    A port from :func:`free_port` can be handed to someone else before it is bound: Ray's head,
    raylet and agents take ephemeral ports while they start, so a Serve proxy told to listen on
    one may find it gone. No program asks the kernel for a port in this band."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(20000, max(low, 20001)))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)
