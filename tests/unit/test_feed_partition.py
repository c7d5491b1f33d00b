"""The training feed's sample order, on plain lists (harvest.read.partition): a seeded order that
keeps shard locality, spans equal to within one, the DataLoader's delivery order, and resumes
that replay to exactly what was not yet handed out."""

from __future__ import annotations

import itertools
import random

import pytest

from harvest.read.partition import (
    Stage,
    delivered,
    digest,
    owner,
    part_of,
    remainder,
    replay,
    sample_order,
    span_sizes,
    spans,
)

SIZES = [1, 7, 2, 5, 3, 9, 4, 6]  # uneven shards


def shards(sizes=SIZES):
    return [(f"s{k:02d}", [f"s{k:02d}-{i}" for i in range(n)]) for k, n in enumerate(sizes)]


def test_without_a_seed_the_order_is_storage_order():
    assert sample_order(shards(), None, 5, 2) == [s for _, ss in shards() for s in ss]


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_seeded_order_is_every_sample_once_shuffled_by_epoch_within_windows_of_shards(window):
    order = sample_order(shards(), 11, 0, window)
    every = [s for _, ss in shards() for s in ss]
    assert sorted(order) == sorted(every) and len(order) == len(every)
    assert order == sample_order(shards(), 11, 0, window)  # deterministic
    assert order != sample_order(shards(), 11, 1, window) and order != sample_order(shards(), 12, 0, window)
    # locality: the order is a run of blocks, each block all the samples of `window` shards
    shard_of = {s: s.split("-")[0] for s in every}
    size = dict((k, len(v)) for k, v in shards())
    at, blocks = 0, []
    while at < len(order):
        first = shard_of[order[at]]
        members: set[str] = set()
        n = 0
        # grow the block until it holds exactly the samples of its shards
        while not members or n < sum(size[m] for m in members):
            members.add(shard_of[order[at + n]])
            n += 1
        blocks.append(members)
        assert first in members
        at += n
    assert all(len(b) <= window for b in blocks) and sum(len(b) for b in blocks) == len(SIZES)
    if window == 1:  # shard order shuffled, each shard's samples shuffled in place
        assert [shard_of[s] for s in order] != sorted(shard_of[s] for s in order)


def test_spans_are_contiguous_and_equal_to_within_one_or_exactly_equal_with_drop():
    order = [str(i) for i in range(37)]
    for parts in (1, 2, 3, 4, 6, 37, 40):
        got = spans(order, parts)
        assert [s for sp in got for s in sp] == order  # contiguous, every sample once
        sizes = [len(sp) for sp in got]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        dropped = span_sizes(37, parts, drop=True)
        assert set(dropped) == {37 // parts} and 37 - sum(dropped) == 37 % parts


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_rank_reads_the_same_number_of_samples_to_within_one(world_size):
    """Every world size 1-8 x DataLoader workers 0-4 (0: none, one part) x sample counts: the ranks'
    totals differ by at most one and together they read every sample once."""
    for workers, n in itertools.product(range(5), [0, 1, 2, 5, 7, 33, 100, 200, 201, 1000]):
        w = max(workers, 1)
        dealt = spans([str(i) for i in range(n)], world_size * w)
        ranks = [[s for k in range(w) for s in dealt[part_of(r, k, world_size, w)]] for r in range(world_size)]
        counts = [len(r) for r in ranks]
        assert max(counts) - min(counts) <= 1, (world_size, workers, n, counts)
        every = [s for r in ranks for s in r]
        assert sorted(every, key=int) == [str(i) for i in range(n)], (world_size, workers, n)
    assert sorted({part_of(r, k, world_size, 3) for r in range(world_size) for k in range(3)}) == list(
        range(3 * world_size)
    )  # one span per (rank, worker)
    with pytest.raises(ValueError, match=f"rank {world_size} of {world_size}, worker 0 of 2: out of range"):
        part_of(world_size, 0, world_size, 2)


def brute_delivery(sizes, batch_size):
    """What a DataLoader hands its loop, by worker: one batch of each worker per round."""
    batches = [[(w, b) for b in range(-(-n // batch_size))] for w, n in enumerate(sizes)]
    out = []
    for rnd in itertools.zip_longest(*batches):
        out += [x for x in rnd if x is not None]
    return out


@pytest.mark.parametrize("sizes,batch_size", [([5, 5], 2), ([6, 5, 5], 3), ([1, 0, 4], 2), ([9], 4), ([3, 3], 1)])
def test_delivered_counts_each_workers_samples_after_any_number_of_batches(sizes, batch_size):
    seq = brute_delivery(sizes, batch_size)
    for k in range(len(seq) + 1):
        want = [0] * len(sizes)
        for w, b in seq[:k]:
            want[w] += min(batch_size, sizes[w] - b * batch_size)
        assert delivered(sizes, batch_size, k) == want
    with pytest.raises(ValueError, match=f"{len(seq) + 1} batches of {batch_size}, but the epoch holds {len(seq)}"):
        delivered(sizes, batch_size, len(seq) + 1)


def test_a_remainder_is_exactly_what_no_part_handed_out_and_stages_replay_in_order():
    rng = random.Random(3)
    order = [f"x{i}" for i in range(50)]
    taken: list[str] = []
    stages: list[Stage] = []
    current = order
    for parts in (6, 4, 5):  # a job resumed twice, each time with another shape
        cut = spans(current, parts)
        consumed = tuple(rng.randint(0, len(sp)) for sp in cut)
        taken += [s for c, sp in zip(consumed, cut, strict=False) for s in sp[:c]]
        stages.append(Stage(parts, False, consumed))
        current = remainder(current, stages[-1])
        assert replay(order, stages) == current
    assert sorted(taken + current) == sorted(order) and len(taken) + len(current) == len(order)
    assert Stage.from_json(stages[0].to_json()) == stages[0]
    with pytest.raises(ValueError, match="does not fit"):
        remainder(order, Stage(2, False, (26, 0)))


def test_digest_and_owner_are_functions_of_their_input_alone():
    assert digest(["a", "b"]) == digest(["a", "b"]) != digest(["b", "a"])
    ids = [f"{i:032x}" for i in range(3000)]
    got = [owner(s, 6) for s in ids]
    assert got == [owner(s, 6) for s in ids] and set(got) == set(range(6))
    assert max(got.count(p) for p in range(6)) < 1.2 * 3000 / 6  # spread, not balanced to one
