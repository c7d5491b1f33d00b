"""tests.support.ports: the reservation that keeps a restarting test server's port its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.support import ports
from tests.support.cli import REPO


def test_reserved_ports_are_below_the_ephemeral_range_and_held_from_other_processes():
    block = ports.reserve_ports(3)
    try:
        assert block.ports == [block.first, block.first + 1, block.first + 2]
        assert block.first >= ports.LOWEST and block.first + 2 < ports._ephemeral_start()
        held = block.first + 1
        code = f"from tests.support import ports; print(ports._lock({held}) is None)"
        other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        assert other.stdout.strip() == "True"  # another process cannot take it while we hold it
    finally:
        block.close()
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == "False"  # released: the next one gets it


def test_a_port_something_listens_on_is_not_bindable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not ports._bindable(s.getsockname()[1])


def test_a_reservation_ends_with_its_process():
    code = "from tests.support import ports; b = ports.reserve_ports(1); print(b.first)"
    first = int(
        subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    )
    fd = ports._lock(first)  # the process exited without close(): the kernel dropped its lock
    assert fd is not None
    os.close(fd)
