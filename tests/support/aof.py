"""Redis's AOF cut back in time: what `appendfsync everysec` may lose on a kill or a power cut.

Redis fsyncs its AOF once a second; the page cache holds the rest, and a SIGKILL of the server
alone loses nothing of it. To lose what a power cut would, the harness keeps the AOF's size as
it grows, SIGKILLs the server, truncates the file to its size `lag` seconds earlier and starts
the server again (it loads a truncated AOF: `aof-load-truncated yes`, Redis's default, and drops
a MULTI cut in the middle). Used by tests/support/chaos.py (the `rollback` fault).
"""

from __future__ import annotations

import os
import time

from harvest.cli.redisproc import RedisServer


class AofHistory:
    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.sizes: list[tuple[float, str, int]] = []  # (monotonic time, AOF file, its size then)

    def _aof(self) -> str | None:
        """The AOF file Redis appends to now (Redis 7: the newest `*.incr.aof` of its appendonlydir)."""
        d = os.path.join(self.server.data_dir, "appendonlydir")
        if not os.path.isdir(d):
            return None
        incr = sorted((f for f in os.listdir(d) if f.endswith(".incr.aof")), key=lambda f: int(f.split(".")[-3]))
        return os.path.join(d, incr[-1]) if incr else None

    def note(self) -> None:
        """Record the AOF's size now (call it often: a rollback is as precise as these notes)."""
        aof = self._aof()
        if aof:
            self.sizes.append((time.monotonic(), aof, os.path.getsize(aof)))
            del self.sizes[:-100]

    def rollback(self, lag: float) -> str:
        """Kill the server, cut its AOF back by `lag` seconds, start it again; returns what was cut."""
        self.note()
        self.server.kill()
        cut = time.monotonic() - lag
        current = self.sizes[-1][1]
        then = [n for t, f, n in self.sizes if t <= cut and f == current]
        size = then[-1] if then else 0
        before = os.path.getsize(current)
        os.truncate(current, size)
        self.server.start()
        return f"AOF {before} -> {size} bytes"
