"""The training feed over a run that is still being committed: each epoch's view is the index
files there when it starts; a follower goes on with the shards committed later (never a shard
before its index, never a second copy of a sample) until the run's settled.json, and says so,
by name, when nothing arrives. And the read-ahead thread: results in order, errors in their
place, memory under its cap."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from harvest.errors import ConfigurationError
from harvest.formats.settled import SETTLED, clear_settled, read_settled, settle, unsettle, write_settled
from harvest.formats.shard import shard_file
from harvest.read.feed import HiddenStateIterable
from harvest.read.follow import FeedStalled
from harvest.read.readahead import ReadAhead
from tests.support.feedrun import FeedRun
from tests.support.wait import wait_for


class Reader(threading.Thread):
    """One rank's feed iterated on a thread, as a trainer's loop would."""

    def __init__(self, run: FeedRun, feed: HiddenStateIterable) -> None:
        super().__init__(daemon=True)
        self.harvest_run, self.feed, self.got, self.error = run, feed, [], None

    def run(self) -> None:  # noqa: D102 - threading's entry
        try:
            for item in self.feed:
                self.got.append(self.harvest_run.sid(item))
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            self.error = e


def test_followers_read_every_sample_committed_until_the_run_settles_once(tmp_path):
    run = FeedRun(tmp_path, 24)
    run.commit_sizes([4, 6])  # 10 samples committed when training starts
    readers = [
        Reader(run, HiddenStateIterable(run.url, seed=1, rank=r, world_size=2, follow=True, poll_s=0.05, wait_s=60))
        for r in range(2)
    ]
    for r in readers:
        r.start()
    wait_for(lambda: sum(len(r.got) for r in readers) == 10, 60, "the view read by both ranks")
    # a shard whose bytes are stored but whose index is not written yet: not committed, not read
    pending = run.commit([20, 21])
    run.loc.delete(f"index/{pending}.json")
    run.commit_sizes([5, 3], start=10)  # samples 10..17
    run.commit([2, 12, 18, 19])  # a second copy of 2 (in the view) and of 12 (in the tail): a reclaim's
    wait_for(lambda: sum(len(r.got) for r in readers) == 20, 60, "the tail read")
    assert all(r.is_alive() for r in readers)  # not settled: they wait
    assert run.loc.exists(shard_file(pending))
    run.commit([20, 21, 22, 23])  # committed at last (in another shard)
    write_settled(run.loc, run.cfg.run, 24, 0)
    for r in readers:
        r.join(60)
        assert not r.is_alive() and r.error is None
    got = readers[0].got + readers[1].got
    assert sorted(got) == sorted(run.ids) and len(got) == 24


def test_each_epoch_sees_the_shards_committed_when_it_starts(tmp_path):
    run = FeedRun(tmp_path, 12)
    run.commit_sizes([3, 2])
    feed = HiddenStateIterable(run.url, seed=4)
    assert len(feed) == 5
    run.commit_sizes([4], start=5)
    assert sorted(run.sid(x) for x in feed) == sorted(run.ids[:5])  # epoch 0's view
    feed.set_epoch(1)
    assert len(feed) == 9 and sorted(run.sid(x) for x in feed) == sorted(run.ids[:9])
    write_settled(run.loc, run.cfg.run, 9, 0)
    follower = HiddenStateIterable(run.url, follow=True, poll_s=0.05, wait_s=0.5)
    assert sorted(run.sid(x) for x in follower) == sorted(run.ids[:9])  # settled: ends after one more listing
    clear_settled(run.loc)
    assert read_settled(run.loc) is None and not run.loc.exists(SETTLED)
    # a position in a follower's tail cannot be saved: its order depends on when shards appeared
    follower = HiddenStateIterable(run.url, follow=True, world_size=2, batch_size=2, num_workers=0)
    assert follower.state_dict(batches=2)["stages"][0]["consumed"] == [4, 4]  # spans 5 and 4: in the view
    with pytest.raises(
        ConfigurationError, match="a rank is past its part of the epoch's view, in a followed run's tail"
    ):
        follower.state_dict(batches=3)  # rank 1's 4 samples are 2 batches: its loop is in the tail


def test_the_settled_marker_is_rewritten_only_when_it_would_say_something_else(tmp_path):
    run = FeedRun(tmp_path, 1)
    path = run.loc.path(SETTLED)
    settle(run.loc, "r", 5, 1)
    first = (open(path, "rb").read(), os.stat(path).st_mtime_ns)
    assert read_settled(run.loc) | {"at": None} == {
        "format": "harvest-settled-1",
        "run": "r",
        "done": 5,
        "failed": 1,
        "at": None,
    }
    settle(run.loc, "r", 5, 1)  # a rerun with nothing to do: not a byte changed
    assert (open(path, "rb").read(), os.stat(path).st_mtime_ns) == first
    settle(run.loc, "r", 6, 0)
    assert (read_settled(run.loc)["done"], read_settled(run.loc)["failed"]) == (6, 0)
    unsettle(run.loc)
    unsettle(run.loc)  # nothing to remove: fine
    assert read_settled(run.loc) is None


def test_a_follower_that_waits_in_vain_says_so_by_name(tmp_path):
    run = FeedRun(tmp_path, 3)
    run.commit([0, 1, 2])
    feed = HiddenStateIterable(run.url, follow=True, poll_s=0.05, wait_s=0.3)
    got = []
    t0 = time.monotonic()
    with pytest.raises(FeedStalled) as e:
        for x in feed:
            got.append(run.sid(x))
    assert sorted(got) == sorted(run.ids) and time.monotonic() - t0 >= 0.3
    assert re.fullmatch(
        re.escape(f"{run.loc.url()}: no new index file for ")
        + r"\d+"
        + re.escape(
            "s and the run is not settled (no settled.json); 3 samples committed so far this epoch. Is the run still "
            "going? (`harvest status --run r`) Pass wait_s= to wait longer, or follow=False to read only what is "
            "committed"
        ),
        str(e.value),
    )


def test_read_ahead_keeps_order_hands_errors_over_in_place_and_stays_under_its_cap():
    fetched: list[int] = []

    def fetch(k: int) -> bytes:
        fetched.append(k)
        if k == 3:
            raise ValueError("bad 3")
        return bytes(10)

    ahead = ReadAhead(range(8), fetch, len, cap_bytes=25)
    out = []
    for k, v in ahead:
        wait_for(lambda k=k: len(fetched) >= min(8, k + 4), 10, "the thread ahead of the consumer")
        time.sleep(0.01)  # the consumer's step: the thread, capped, fetches no further meanwhile
        out.append((k, v if isinstance(v, bytes) else str(v)))
    assert out == [(k, bytes(10)) if k != 3 else (3, "bad 3") for k in range(8)]
    assert 20 <= ahead.peak <= 30  # the cap (25) plus the one sample fetched past it at most
    stopped = ReadAhead(range(10**6), lambda k: bytes(10), len, cap_bytes=100)
    for k, _ in stopped:
        if k == 2:
            break
    assert stopped._thread is not None and not stopped._thread.is_alive()  # leaving the loop stopped it
    assert list(ReadAhead(range(3), lambda k: k * 2, lambda v: 1, cap_bytes=0)) == [(0, 0), (1, 2), (2, 4)]
