"""A moto S3 server in a process of its own, for the benchmarks (the tests use conftest's
threaded one): a separate process keeps its CPU out of the measured process."""

from __future__ import annotations

import socket
import subprocess
import sys

from harvest.cli.redisproc import free_port
from tests.support.wait import wait_for


def moto_server() -> tuple[subprocess.Popen, str]:
    """Start `python -m moto.server` on a free port; returns the process and its endpoint URL."""
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            return False

    wait_for(up, timeout=10, what="moto's server to start", poll=0.05)
    return p, f"http://127.0.0.1:{port}"
