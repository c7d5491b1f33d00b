"""The crc32s that travel with a sample's bytes from the engine to the reader.

A dump file (engine -> worker) and a spool file (worker -> collector) record, in their
safetensors metadata, the crc32 (zlib's) of each tensor's bytes as one JSON object keyed by
tensor name (`FIELD`); the shard index records the same sums per sample (`crc32`,
harvest.formats.index), which for a spool file's tensors are the very numbers its worker wrote.
`combine` gives the crc32 of a concatenation from its parts' crc32s and lengths (zlib's
`crc32_combine`, which Python's zlib does not expose), so a worker derives a sample's
hidden-states sum from the dump chunks' verified sums instead of reading the bytes again.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FIELD = "crc32"
_POLY = 0xEDB88320  # the reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (bit-reflected; `a` nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^n) modulo the polynomial


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of A + B from crc32(A), crc32(B) and len(B)."""
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2): the bits B shifts A by
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def combine_all(parts: Iterable[tuple[int, int]]) -> int:
    """The crc32 of the concatenation of parts given as (crc32, length), in order."""
    crc = 0
    for c, n in parts:
        crc = combine(crc, c, n)
    return crc


def tensor_crc32(t: torch.Tensor) -> int:
    """The crc32 of a tensor's bytes as a safetensors file holds them."""
    from harvest.formats.stformat import tensor_bytes

    return zlib.crc32(tensor_bytes(t))


def encode_sums(sums: Mapping[str, int]) -> str:
    """The metadata value: {tensor name: crc32}, keys sorted (same sums, same bytes)."""
    return json.dumps({k: int(sums[k]) for k in sorted(sums)}, separators=(",", ":"))


def parse_sums(meta: Mapping[str, str], names: Iterable[str]) -> dict[str, int]:
    """The sums a file's metadata records for each of `names`; ValueError naming what is wrong
    when the field is missing, not JSON, or lacks a tensor."""
    raw = meta.get(FIELD)
    if raw is None:
        raise ValueError(f"no {FIELD} in its metadata")
    try:
        sums = json.loads(raw)
        out = {n: int(sums[n]) for n in names}
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"its {FIELD} metadata {raw[:200]!r} is not a crc32 of each tensor ({type(e).__name__}: {e})"
        ) from None
    if any(not 0 <= v < 1 << 32 for v in out.values()):
        raise ValueError(f"its {FIELD} metadata {raw[:200]!r} holds a value that is not a crc32")
    return out


def check_sums(meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor], writer: str) -> dict[str, int]:
    """The recorded sums of `tensors` once each tensor's bytes match them; ValueError naming the
    tensor and both sums when one does not (the file changed after `writer` wrote it), or what is
    wrong with the recorded field (`parse_sums`)."""
    sums = parse_sums(meta, tensors)
    for name, t in tensors.items():
        if (found := tensor_crc32(t)) != sums[name]:
            raise ValueError(
                f"{name} has crc32 {found}, {writer} recorded {sums[name]}: the file changed after "
                f"{writer} wrote it (a disk or memory fault on this node?)"
            )
    return sums
