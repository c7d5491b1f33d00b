"""The lossless codec a run may store its hidden states with (`--codec`, fixed when the run is made).

`none`: the values as they are. `blosc2-zstd`: each sample's hidden states, `[T, K, H]` in the
storage dtype, coded on their own with blosc2: its byte shuffle (the bytes of each value split
into planes; the sign and exponent byte of a bf16 has little entropy, the mantissa byte has
much) then zstd level 1 (bench/codec.py measures it and the candidates it was chosen over). The
coded bytes of a sample are a run of blosc2 chunks (their own format: a 32-byte header that
holds each chunk's raw and coded sizes, then its blocks), one per `PIECE_BYTES` of raw bytes at
most, so that no sample comes near blosc2's 2 GiB limit on a chunk. blosc2 (and numpy) are
imported on first use: a process that only publishes a run does not pay for them.

The codec works on bytes and is pure: it knows nothing of shards (harvest.formats.shard lays the
coded bytes out, harvest.read.shard_reader decodes them). A sample's crc32 is always over its
raw bytes, so the same sum checks it from the engine to the reader with or without a codec.
"""

from __future__ import annotations

import zlib
from typing import BinaryIO

from harvest.errors import InputError

NONE = "none"
BLOSC2_ZSTD = "blosc2-zstd"
CODECS = (NONE, BLOSC2_ZSTD)
PIECE_BYTES = 16 << 20  # raw bytes one blosc2 chunk holds at most
_HEADER = 32  # a blosc2 chunk's header (BLOSC_EXTENDED_HEADER_LENGTH): it gives the chunk's sizes


class CodecError(InputError, ValueError):
    """Coded bytes that do not decode to what they should (damaged, or cut short)."""


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise ValueError(f"codec {name!r}: choose one of {', '.join(CODECS)}")
    return name


def encode_piece(raw: memoryview | bytes | bytearray, itemsize: int) -> bytes:
    """One chunk of at most PIECE_BYTES raw bytes (values `itemsize` bytes wide), coded."""
    import blosc2

    coded: bytes = blosc2.compress2(
        raw, typesize=itemsize, clevel=1, codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE], filters_meta=[0]
    )
    return coded


def encode_file(src: BinaryIO, length: int, itemsize: int, out: BinaryIO) -> tuple[int, int]:
    """`length` raw bytes read from `src` (at its position) coded into `out`, a chunk per
    PIECE_BYTES; returns (coded bytes written, crc32 of the raw bytes). Raises EOFError where
    `src` ends first."""
    piece = PIECE_BYTES - PIECE_BYTES % itemsize
    buf = memoryview(bytearray(min(piece, length)))
    crc, coded, left = 0, 0, length
    while left:
        n = min(left, piece)
        got = 0
        while got < n:
            k = src.readinto(buf[got:n])  # type: ignore[attr-defined]  # BinaryIO lacks readinto; files have it
            if not k:
                raise EOFError(f"ends {left - got} bytes short")
            got += k
        crc = zlib.crc32(buf[:n], crc)
        chunk = encode_piece(buf[:n], itemsize)
        out.write(chunk)
        coded += len(chunk)
        left -= n
    return coded, crc


def decode(coded: memoryview | bytes | bytearray, raw_bytes: int) -> bytearray:
    """The raw bytes of one sample's coded bytes; CodecError where they do not decode to exactly
    `raw_bytes` bytes."""
    import blosc2
    import numpy as np

    out = bytearray(raw_bytes)
    dst = np.frombuffer(out, dtype=np.uint8) if raw_bytes else None
    view, pos, at = memoryview(coded), 0, 0
    try:
        while pos < len(view):
            if len(view) - pos < _HEADER:
                raise CodecError(f"{len(view) - pos} stray bytes after its chunks")
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(view[pos : pos + _HEADER])
            if cbytes < _HEADER or pos + cbytes > len(view) or at + nbytes > raw_bytes:
                raise CodecError(
                    f"a chunk header at coded byte {pos} gives sizes ({nbytes} raw, {cbytes} coded) "
                    f"that do not fit {len(view)} coded and {raw_bytes} raw bytes"
                )
            if nbytes and dst is not None:
                blosc2.decompress2(view[pos : pos + cbytes], dst=dst[at : at + nbytes])
            pos, at = pos + cbytes, at + nbytes
    except CodecError:
        raise
    except (RuntimeError, ValueError, BufferError, OverflowError) as e:
        raise CodecError(f"blosc2 cannot decode it ({type(e).__name__}: {e})") from None
    if at != raw_bytes:
        raise CodecError(f"decodes to {at} bytes, {raw_bytes} expected")
    return out
