"""A byte range of a shard file read once for the several samples it holds.

A reader that coalesces the samples it expects to be asked for (harvest.read.coalesce) registers
one `HeldRead` on each of them; the first sample asked for reads it, concurrent askers wait for that
read, and a failed read leaves each sample to read its own range and fail as it would alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Held = tuple[memoryview, int]  # bytes of a shard file and the file offset they start at


class HeldRead:
    """Bytes [begin, end) of a shard file, read once, by the first sample that needs them (the
    others wait for that read), for the samples registered on it in their reader."""

    def __init__(self, begin: int, end: int, raw: bytes | None = None) -> None:
        self.begin, self.end = begin, end
        self._raw = None if raw is None else memoryview(raw)
        self._state = "new" if raw is None else "done"
        self._cond = threading.Condition()

    def get(self, read: Callable[[int, int], bytes | bytearray]) -> Held | None:
        """The bytes (reading them unless another thread did or does); None where that read failed:
        each sample then reads its own range, and fails there exactly as it would have alone."""
        with self._cond:
            if self._state == "new":
                self._state = "reading"
            else:
                while self._state == "reading":
                    self._cond.wait()
                return None if self._raw is None else (self._raw, self.begin)
        raw = None
        try:
            raw = memoryview(read(self.begin, self.end))
        except Exception:  # noqa: BLE001, S110 - each sample's own read raises it (see above)
            pass
        finally:
            with self._cond:
                self._raw, self._state = raw, "done"
                self._cond.notify_all()
        return None if raw is None else (raw, self.begin)
