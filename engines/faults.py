"""Test-only fault switches for the reference engine.

The reliability suite needs an engine that misbehaves the way real ones do, on demand:
`HARVEST_ENGINE_FAULTS="http500:2,nan:1"` makes the next two /generate calls answer 500 and
puts a NaN into the next `hv-` request's dump. Each entry is `kind[:count]`; without a count
the fault hits every time (a permanent fault), with one it hits that many times and then the
engine behaves (a transient fault, which a retry must get past). Nothing is faulted unless
the variable is set, and production engines (SGLang) never read it.

Three kinds are wrong numbers rather than broken files, for `harvest audit` to catch: every
check the worker makes (tokens, coverage, capture points, finiteness) passes them, as it would
pass the bugs they imitate (misaligned rows under chunked prefill, a capture hook on the wrong
module, batch-variant kernels):

- `shift-chunk`: a request spanning several prefill chunks gets the rows of its second chunk
  shifted by one position (row i holds position i-1's states; the chunk's first row is right);
- `wrong-layer`: a request's first capture point is taken from the next layer (HF index p+1);
- `perturb`: a request that shares its /generate call with others gets a relative 1e-3 of noise
  on its rows from position T//2 on (alone, it is computed right).
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
SHIFT_CHUNK, WRONG_LAYER, PERTURB = "shift-chunk", "wrong-layer", "perturb"  # plausible numbers, wrong
PERTURB_SCALE = 1e-3  # of each row's RMS: invisible to the worker, 10x the audit's fp32 tolerance
# A request gets at most one, the first that applies (shift-chunk only to a request over one
# chunk, perturb only to one sharing its call: a count is not spent on a request it cannot hit).
DUMP_KINDS = (DROP_CHUNK, BAD_IDS, NAN, CACHED, SHIFT_CHUNK, WRONG_LAYER, PERTURB)
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
