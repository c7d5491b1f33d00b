"""Test-only fault switches for the reference engine.

The reliability suite needs an engine that misbehaves the way real ones do, on demand:
`HARVEST_ENGINE_FAULTS="http500:2,nan:1"` makes the next two /generate calls answer 500 and
puts a NaN into the next `hv-` request's dump. Each entry is `kind[:count]`; without a count
the fault hits every time (a permanent fault), with one it hits that many times and then the
engine behaves (a transient fault, which a retry must get past). Nothing is faulted unless
the variable is set, and production engines (SGLang) never read it.
"""

from __future__ import annotations

import os
import threading

ENV = "HARVEST_ENGINE_FAULTS"
ENV_HANG_S = "HARVEST_ENGINE_HANG_S"
# per HTTP call
HTTP500, HANG = "http500", "hang"
# per hv- request in a call
DROP_CHUNK, BAD_IDS, NAN, CACHED = "drop-chunk", "bad-ids", "nan", "cached"
DUMP_KINDS = (DROP_CHUNK, BAD_IDS, NAN, CACHED)  # a request gets at most one, the first that applies
KINDS = (HTTP500, HANG, *DUMP_KINDS)


class Faults:
    def __init__(self, spec: str = "") -> None:
        self._left: dict[str, int | None] = {}
        self._lock = threading.Lock()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, count = part.partition(":")
            if kind not in KINDS:
                raise ValueError(f"{ENV}: unknown fault {kind!r}; known: {', '.join(KINDS)}")
            try:
                self._left[kind] = int(count) if count else None
            except ValueError:
                raise ValueError(f"{ENV}: {part!r}: the count must be an integer") from None
        self.hang_s = float(os.environ.get(ENV_HANG_S, "3600"))

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get(ENV, ""))

    def __bool__(self) -> bool:
        return bool(self._left)

    def take(self, kind: str) -> bool:
        """True if this occurrence of `kind` is to be faulted (and counts it)."""
        with self._lock:
            if kind not in self._left:
                return False
            left = self._left[kind]
            if left is None:
                return True
            if left <= 0:
                return False
            self._left[kind] = left - 1
            return True
