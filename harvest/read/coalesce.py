"""Coalescing reads: which of a shard's samples to fetch together, in one ranged read.

A shard stores its samples' hidden states back to back, in the order it packed them. One ranged
GET a sample pays the store's per-request cost (a round trip and the first byte; moto's server
even copies the whole object for each range) once per sample; a plain sequential read pays it
once per shard. So readers group the samples they are about to read (the training feed: a window
of its order; `RunReader`: a shard's samples not yet asked for, once requests stay local) by
shard, sort them in storage order and read each run of adjacent ones (`gap` bytes between them
allowed: an excluded sample, say, is read over rather than asked around) as one range of at most
`cap` bytes, then check and slice every sample out of that buffer, each against its own crc32.
Pure: no I/O.

Only for object stores: a local file's ranged read costs a system call, not a round trip, and a
buffer of many samples leaves the CPU's cache between the read and the crc32 and copies (slower
than a read a sample). So local readers coalesce nothing unless told to (`cap_for`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

K = TypeVar("K")

COALESCE_BYTES = 64 << 20  # the most bytes one coalesced ranged read asks for
GAP_BYTES = 1 << 20  # bytes of samples not asked for that a coalesced read may span between two that are
WHOLE_FILE = (
    0.75  # a shard at most COALESCE_BYTES long whose samples wanted hold this share of its tokens is read whole
)


SHUFFLED_COALESCE_BYTES = 256 << 20  # the same for a shuffled feed, whose runs of adjacent samples are short


def cap_for(is_local: bool, cap: int | None = None, shuffled: bool = False) -> int:
    """The coalescing cap a reader uses: `cap` where given, else 0 (none) for a local folder and
    COALESCE_BYTES for an object store, SHUFFLED_COALESCE_BYTES for a shuffled order there: its
    window of the order spans a few shards sparsely, and only a larger window gathers enough of a
    shard to read it in few requests (bench/feed.py measures both)."""
    if cap is not None:
        return cap
    if is_local:
        return 0
    return SHUFFLED_COALESCE_BYTES if shuffled else COALESCE_BYTES


def runs(
    positions: Iterable[int], offsets: Sequence[int], row_bytes: int, cap: int = COALESCE_BYTES, gap: int = GAP_BYTES
) -> list[list[int]]:
    """`positions` (samples of one shard, by row in its index; any order, repeats ignored) cut into
    runs to read with one ranged read each: ascending in storage order; a sample joins the run
    before it when at most `gap` bytes lie between them and the run, gaps included, stays within
    `cap` bytes (a sample longer than `cap` is a run alone); `cap` 0: every sample alone.
    `offsets`: the shard's token offsets (sample i is rows [offsets[i], offsets[i+1]));
    `row_bytes`: bytes a row (token) of the tensor read."""
    out: list[list[int]] = []
    for p in sorted(set(positions)):
        if out and cap > 0:
            run = out[-1]
            between = (offsets[p] - offsets[run[-1] + 1]) * row_bytes
            if between <= gap and (offsets[p + 1] - offsets[run[0]]) * row_bytes <= cap:
                run.append(p)
                continue
        out.append([p])
    return out


def windows(
    keys: Sequence[K], nbytes: Callable[[K], int], budget: int, group: Callable[[K], object] = lambda key: None
) -> list[list[K]]:
    """`keys` cut, in order, into consecutive windows of at most `budget` bytes (by `nbytes`), at
    least one key each: what a reader fetches together; `budget` 0: one key a window. A stretch
    of consecutive keys of one `group` (a shard) that fits in a window is not cut across two: it
    starts a new window where the current one cannot take all of it, so a shard read in storage
    order is one window, read whole in one request (`read_whole`), not its ends in two windows."""
    sizes = [nbytes(key) for key in keys]
    stretch = [0] * len(keys)  # bytes from each key to the end of its group's stretch
    for j in range(len(keys) - 1, -1, -1):
        same = j + 1 < len(keys) and group(keys[j + 1]) == group(keys[j])
        stretch[j] = sizes[j] + (stretch[j + 1] if same else 0)
    out: list[list[K]] = []
    held = 0
    for j, key in enumerate(keys):
        n = sizes[j]
        starts = j > 0 and group(keys[j - 1]) != group(key)
        fits = held + (stretch[j] if starts and stretch[j] <= budget else n) <= budget
        if out and budget > 0 and fits:
            out[-1].append(key)
            held += n
        else:
            out.append([key])
            held = n
    return out


def read_whole(wanted_tokens: int, total_tokens: int, file_bytes: int | None, cap: int = COALESCE_BYTES) -> bool:
    """Whether to fetch a shard file whole, in the one read that opens it (its header, the wanted
    samples, the small tensors at its end): when it is at most `cap` bytes and the samples wanted
    from it hold at least WHOLE_FILE of its tokens. One request instead of three or more."""
    return (
        file_bytes is not None
        and 0 < file_bytes <= cap
        and total_tokens > 0
        and wanted_tokens >= WHOLE_FILE * total_tokens
    )
