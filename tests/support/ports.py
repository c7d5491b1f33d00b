"""Ports for servers that a test kills and starts again at the same address.

`harvest.cli.redisproc.free_port` (bind to port 0) suits a server started once. A server that
restarts on its port cannot take it from there: the kernel hands out the ephemeral range to every
bind to port 0 and to every outgoing connection, so while the server is down another process may
take its port, and a parallel test's workers then talk to our engine. CI saw exactly that: a chaos
trial's engine (then at 32000 + a pid hash, inside the ephemeral range) wrote dumps for another
test's requests, which the trial counted as leftovers.

So these ports come from below the ephemeral range, and each is reserved by an `flock` on a file in
one folder that every pytest-xdist worker and bench process shares. The lock lives as long as the
reserving process's file descriptor: `PortBlock.close`, or the kernel at the process's exit, so a
killed test leaks no reservation.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile

LOWEST = 20000  # below: ports that well-known services use
_DIR = os.path.join(tempfile.gettempdir(), "harvest-test-ports")


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortBlock:
    """`n` consecutive ports, reserved until `close`."""

    def __init__(self, first: int, fds: list[int]) -> None:
        self.first, self._fds = first, fds

    @property
    def ports(self) -> list[int]:
        return list(range(self.first, self.first + len(self._fds)))

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def _lock(port: int) -> int | None:
    fd = os.open(os.path.join(_DIR, str(port)), os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def reserve_ports(n: int, tries: int = 500) -> PortBlock:
    """`n` consecutive ports below the ephemeral range that no other reserving process holds and
    nothing listens on now."""
    os.makedirs(_DIR, exist_ok=True)
    high = _ephemeral_start() - n
    if high <= LOWEST:
        raise RuntimeError(f"no room for {n} ports between {LOWEST} and the ephemeral range")
    rng = random.Random()  # seeded from the OS: parallel processes start apart
    for _ in range(tries):
        first = rng.randrange(LOWEST, high)
        fds: list[int] = []
        for port in range(first, first + n):
            fd = _lock(port)
            if fd is None or not _bindable(port):
                if fd is not None:
                    os.close(fd)
                break
            fds.append(fd)
        if len(fds) == n:
            return PortBlock(first, fds)
        for fd in fds:
            os.close(fd)
    raise RuntimeError(f"no {n} free consecutive ports between {LOWEST} and {high + n} after {tries} tries")
