"""Free TCP ports for loopback servers and rendezvous, chosen below the kernel's ephemeral range.

Why not bind(0): the port it finds lies in the ephemeral range, where the kernel also picks the local port of
every outgoing connection (to PostgreSQL, Redis, another gRPC server) and may hand the same number out again, so
between finding a port and binding it something else can take it. Ports from here come from below that range,
which outgoing connections never use, are never handed out twice by one process, and are checked free by a bind.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FLOOR = 10_000
TORCH_RANGE = range(29_500, 30_000)  # where torch.distributed's customary ports sit: left to it

_lock = threading.Lock()
_given: set[int] = set()
_rng = random.Random(os.getpid() ^ time.time_ns())


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(host: str, port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, port))
    except OSError:
        return False
    return True


def free_port(host: str = "127.0.0.1", block: int = 1) -> int:
    """A port free on `host` now, outside the ephemeral range, and never before returned in this process; with
    `block` > 1 the first of that many consecutive such ports (executor agents take executor_port + i)."""
    high = ephemeral_low() - block
    with _lock:
        for _ in range(2_000):
            first = _rng.randrange(FLOOR, high) if high > FLOOR + 1_000 else _ephemeral(host)
            span = range(first, first + block)
            if any(p in _given or p in TORCH_RANGE or not _bindable(host, p) for p in span):
                continue
            _given.update(span)
            return first
    raise OSError(f"no {block} free port(s) on {host} between {FLOOR} and {high + block}")


def _ephemeral(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
