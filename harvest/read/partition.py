"""The training feed's sample order, pure: which sample each rank and DataLoader worker reads in an
epoch, in what order, and where a resumed epoch picks up. No I/O and no torch, so every rule
here is tested on plain lists (tests/unit/test_feed_partition.py).

**Order.** An epoch's view is a list of shards (by id) and the samples each commits, as packed.
Without a seed the order is storage order. With one, `Random(f"{seed}:{epoch}")` shuffles the
shard order, then cuts it into windows of `window` consecutive shards and shuffles the samples
within each window: every sample moves, but a reader's next samples always lie in a few shards,
so reads stay ranged and close together (the py1b idea of mosaicml-streaming, without its nodes).

**Partition.** The order is cut into `parts` = world_size x DataLoader workers contiguous spans.
Span sizes differ by at most one: the first `n % parts` spans hold one more. Spans are numbered
worker-major (`part_of(rank, worker, ...)` = worker * world_size + rank), so those extra samples go
one to each rank before any rank gets a second: every rank's count is within one of every other's
(rank-major numbering would give all of rank 0's workers one more: 68, 66, 66 for 200 samples over
3 ranks of 2 workers, and the rank with more batches waits forever in its last collective).
Nothing is dropped or repeated by default, so the union over ranks is every sample once per
epoch; equal to within one sample is the best that allows. Padding
(mosaicml's choice) repeats samples and so breaks once per epoch; dropping loses samples. Both
are worse defaults for a dataset whose every row cost a forward pass. Where a trainer needs
exactly equal step counts on every rank, `drop=True` gives every span exactly `n // parts`
(at most `parts - 1` samples left out of that epoch, others each epoch as the order changes).

**Delivery and resume.** A DataLoader with W workers hands its loop batch t of worker 0, then
batch t of worker 1, ..., skipping a worker whose samples are spent (torch's in-order delivery).
So after `batches` steps every rank knows exactly how many samples each of its workers gave
(`delivered`). A resumed epoch is the epoch's order less every part's delivered prefix
(`remainder`), partitioned again over the ranks and workers of the resumed job: exact (nothing
twice, nothing skipped) even when the world size or the worker count changed. A state saved
inside a resumed epoch adds a stage; the stages replay in order.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def sample_order(shards: Sequence[tuple[str, Sequence[str]]], seed: int | None, epoch: int, window: int) -> list[str]:
    """Every sample of `shards` ((shard id, samples as packed), in shard-id order) once, in the
    epoch's order: storage order without a seed, else shards shuffled and samples shuffled
    within windows of `window` shards (see the module's docstring)."""
    if seed is None:
        return [s for _, samples in shards for s in samples]
    if window < 1:
        raise ValueError(f"the shuffle window is {window} shards; it must be at least 1")
    rng = random.Random(f"{seed}:{epoch}")
    order = list(shards)
    rng.shuffle(order)
    out: list[str] = []
    for i in range(0, len(order), window):
        mixed = [s for _, samples in order[i : i + window] for s in samples]
        rng.shuffle(mixed)
        out.extend(mixed)
    return out


def span_sizes(n: int, parts: int, drop: bool = False) -> list[int]:
    """Samples of each of `parts` contiguous spans of `n`: within one of each other (the first
    `n % parts` one more), or all `n // parts` with `drop`."""
    if parts < 1:
        raise ValueError(f"{parts} parts: there must be at least one")
    q, r = divmod(n, parts)
    return [q + (0 if drop else int(p < r)) for p in range(parts)]


def part_of(rank: int, worker: int, world_size: int, workers: int) -> int:
    """The span a rank's DataLoader worker reads (`workers` >= 1: a DataLoader without workers is one):
    worker-major, so `span_sizes`' extra samples go to distinct ranks first and every rank's total is
    within one of every other's."""
    if not (0 <= rank < world_size and 0 <= worker < workers):
        raise ValueError(f"rank {rank} of {world_size}, worker {worker} of {workers}: out of range")
    return worker * world_size + rank


def spans(order: Sequence[str], parts: int, drop: bool = False) -> list[list[str]]:
    """`order` cut into `parts` contiguous spans (`span_sizes`)."""
    out, at = [], 0
    for size in span_sizes(len(order), parts, drop):
        out.append(list(order[at : at + size]))
        at += size
    return out


def batch_count(size: int, batch_size: int) -> int:
    return -(-size // batch_size)


def delivered(sizes: Sequence[int], batch_size: int, batches: int) -> list[int]:
    """Samples each worker (of `sizes` samples each) has handed to the training loop once the loop
    took `batches` batches of `batch_size` from a DataLoader (round robin by worker, spent workers
    skipped, each worker's last batch possibly short). Raises ValueError past the end."""
    if batch_size < 1 or batches < 0:
        raise ValueError(f"batch size {batch_size} and {batches} batches: need a positive size, batches >= 0")
    out = [0] * len(sizes)
    left, t = batches, 0
    rounds = max((batch_count(s, batch_size) for s in sizes), default=0)
    while left and t < rounds:
        for w, size in enumerate(sizes):
            if left and t < batch_count(size, batch_size):
                out[w] += min(batch_size, size - t * batch_size)
                left -= 1
        t += 1
    if left:
        total = sum(batch_count(s, batch_size) for s in sizes)
        raise ValueError(f"{batches} batches of {batch_size}, but the epoch holds {total} here")
    return out


@dataclass(frozen=True)
class Stage:
    """One pass over an epoch's (remaining) order: its partition and how far each part got."""

    parts: int
    drop: bool
    consumed: tuple[int, ...]  # samples delivered from each part's span

    def to_json(self) -> dict[str, Any]:
        return {"parts": self.parts, "drop": self.drop, "consumed": list(self.consumed)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Stage:
        return cls(int(doc["parts"]), bool(doc["drop"]), tuple(int(c) for c in doc["consumed"]))


def remainder(order: Sequence[str], stage: Stage) -> list[str]:
    """What `stage` left of `order`: each part's span less its delivered prefix, in part order."""
    parts = spans(order, stage.parts, stage.drop)
    if len(stage.consumed) != stage.parts or any(
        not 0 <= c <= len(p) for c, p in zip(stage.consumed, parts, strict=True)
    ):
        raise ValueError(f"consumed {list(stage.consumed)} does not fit spans of {[len(p) for p in parts]}")
    return [s for c, p in zip(stage.consumed, parts, strict=True) for s in p[c:]]


def replay(order: Sequence[str], stages: Sequence[Stage]) -> list[str]:
    """The epoch's order after every earlier stage: what is left to deal now."""
    out = list(order)
    for st in stages:
        out = remainder(out, st)
    return out


def digest(order: Sequence[str]) -> str:
    """A short fingerprint of an order: a resumed epoch refuses a view that changed under it."""
    return hashlib.blake2b("\n".join(order).encode(), digest_size=16).hexdigest()


def owner(sample_id: str, parts: int) -> int:
    """The part that reads `sample_id` when it arrives after the epoch began (a followed run's
    tail): a function of the id alone, so readers that list the output at different moments
    still deal every late sample to exactly one of them, and every copy of it to the same one."""
    return int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "big") % parts
