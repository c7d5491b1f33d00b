"""`<out>/<run>/dataset.ids`: the sample ids of the dataset the run's last `harvest run` read.

Why. Redis's ledger knows the samples it was told about; a Redis that came back without them
(no persistence, a wipe, a failover that was behind) knows nothing of the samples that were only
queued, and the index files name only what was committed. The dataset is the one place that
knows every sample a run owes, so `harvest run` keeps the ids of the dataset it read beside the
run's index files, where a lost Redis cannot take them: `harvest status --check` compares the
ledger with them, and a rerun that finds them in no state enqueues them again (harvest.ops.coverage).

The object: the sorted, distinct ids as 16 raw bytes each (a sample id is the 32 hex digits of a
blake2b-128, harvest.ids.sample_id), so a run of ten million samples keeps 160 MB, not gigabytes
of Python strings. Written whole or not at all (`Location.write_atomic`) by the runner once its
producer pass has read the whole dataset; one writer: the run's one `harvest run`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from harvest.storage import Location, retry

MANIFEST = "dataset.ids"
_WIDTH = 16  # bytes a sample id: blake2b-128


def _packed(ids: Iterable[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(the 16-byte forms, whether each id has one): an id that is not 32 hex digits is no sample
    id a dataset can hold."""
    raw, ok = [], []
    for i in ids:
        try:
            b = bytes.fromhex(i.decode() if isinstance(i, bytes) else i)
        except ValueError:
            b = b""
        ok.append(len(b) == _WIDTH)
        raw.append(b if len(b) == _WIDTH else bytes(_WIDTH))
    return np.frombuffer(b"".join(raw), dtype=f"S{_WIDTH}"), np.array(ok, dtype=bool)


class SampleIds:
    """A set of sample ids held compactly (16 bytes each): `add` while a dataset is read, then
    `freeze` once (sorts and drops repeats); `contains` and `len` on the frozen set."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._sorted: np.ndarray | None = None

    def add(self, sid: str) -> None:
        self._buf += bytes.fromhex(sid)

    def freeze(self) -> SampleIds:
        new = np.frombuffer(bytes(self._buf), dtype=f"S{_WIDTH}")
        old = self._sorted if self._sorted is not None else new[:0]
        self._sorted, self._buf = np.unique(np.concatenate([old, new])), bytearray()
        return self

    def __len__(self) -> int:
        return 0 if self._sorted is None else len(self._sorted)

    def contains(self, ids: list[str | bytes]) -> np.ndarray:
        """One bool an id of `ids`: in the set."""
        if self._sorted is None or not len(self._sorted) or not ids:
            return np.zeros(len(ids), dtype=bool)
        packed, ok = _packed(ids)
        at = np.minimum(np.searchsorted(self._sorted, packed), len(self._sorted) - 1)
        found: np.ndarray = ok & (self._sorted[at] == packed)
        return found

    def to_bytes(self) -> bytes:
        return b"" if self._sorted is None else self._sorted.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> SampleIds:
        ids = cls()
        ids._buf = bytearray(data[: len(data) - len(data) % _WIDTH])
        return ids.freeze()


def write_manifest(run_loc: Location, ids: SampleIds) -> None:
    """Written only when its bytes change: a rerun of the same dataset leaves the output as it was."""
    data = ids.to_bytes()
    old = read_manifest(run_loc)
    if old is None or old.to_bytes() != data:
        retry(lambda: run_loc.write_atomic(MANIFEST, data), f"writing {run_loc.describe(MANIFEST)}")


def read_manifest(run_loc: Location) -> SampleIds | None:
    """The ids the run's last `harvest run` read, or None where no `harvest run` wrote them (a
    fleet's runs: their producers each read a part of the dataset)."""
    if not retry(lambda: run_loc.exists(MANIFEST), f"looking for {run_loc.describe(MANIFEST)}"):
        return None
    return SampleIds.from_bytes(retry(lambda: run_loc.read_bytes(MANIFEST), f"reading {run_loc.describe(MANIFEST)}"))
