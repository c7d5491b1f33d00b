"""A shard's hidden states coded by the run's codec (harvest.formats.codec), ahead of its layout.

The collector codes each sample's hidden states once, straight from its spool file into one
scratch file beside the spool, summing the raw bytes (crc32) on the way; the shard's layout is
then fixed from the coded sizes (harvest.formats.shard.encode_shard) and its writers copy each
sample's coded bytes from the scratch file as they copy the other tensors from the spool files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harvest.formats.codec import encode_file
from harvest.formats.spool import SpoolEntry, truncated, unreadable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Coded:
    """One sample's hidden states as coded: bytes [begin, begin + nbytes) of the scratch file
    `path`, and the crc32 of the raw bytes they decode to (its worker's, unless the spool file
    changed: the shard's `damaged` check compares them)."""

    path: str
    begin: int
    nbytes: int
    crc32: int


def encode_samples(entries: Sequence[SpoolEntry], dtype: torch.dtype, path: str) -> tuple[Coded, ...]:
    """Each entry's hidden states coded into the file `path` (written afresh; the caller removes
    it once the shard is stored), in order. SpoolDamaged where a spool file is unreadable or ends
    first; an OSError writing `path` is raised as it is."""
    import torch

    itemsize = torch.empty(0, dtype=dtype).element_size()
    coded, at = [], 0
    with open(path, "wb") as out:
        for e in entries:
            span = e.spans["hidden_states"]
            try:
                f = open(e.path, "rb", buffering=0)
            except OSError as err:
                raise unreadable(e.path, err) from None
            with f:
                try:
                    f.seek(span.begin)
                    n, crc = encode_file(f, span.end - span.begin, itemsize, out)
                except EOFError:
                    raise truncated(e.path, "hidden_states") from None
                except OSError as err:
                    if err.filename not in (None, e.path):
                        raise
                    raise unreadable(e.path, err) from None
            coded.append(Coded(path, at, n, crc))
            at += n
    return tuple(coded)
