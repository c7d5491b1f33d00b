"""A worker's tally (harvest.state.tally): what its jobs add is written by one flush, exactly once,
into the run's stats, the current rate bucket and the histograms. A flush whose connection fails
gives it all back and the next one writes it once; one Redis refuses drops it (its script may have
written part of it)."""

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from harvest.cli.redisproc import free_port
from harvest.ops.metrics import read_histogram
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.tally import Tally, bucket_of

RUN = "tl"


def test_one_flush_writes_what_the_jobs_added_and_a_failed_one_gives_it_back(conn):
    tally, led = Tally(conn, RUN), Ledger(conn, RUN)
    assert not tally.flush()  # nothing added: no call
    for took in (0.004, 0.3, 0.3, 700.0):
        tally.add({"samples_spooled": 32, "tokens_spooled": 1000, "dump_bytes": 0})
        tally.observe("job_seconds", took)
    tally.observe("engine_seconds", 0.02)

    tally.conn = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))  # no Redis there: nothing ran
    with pytest.raises(redis.ConnectionError):
        tally.flush()
    tally.conn = conn
    assert tally.flush() and not tally.flush()

    assert led.stats() == {"samples_spooled": 128, "tokens_spooled": 4000}  # a zero adds no field
    assert led.rates()[0] == {"samples_spooled": 128, "tokens_spooled": 4000}
    buckets, total, count = read_histogram(conn, RUN, "job_seconds")
    assert (count, total) == (4, pytest.approx(700.604))
    assert [n for _, n in buckets] == [1] * 5 + [3] * 10 + [4]  # cumulative: 0.004 | 0.3, 0.3 in 0.5 | 700 past 600
    assert conn.hgetall(Keys(RUN).histogram("engine_seconds")) == {b"0.025": b"1", b"count": b"1", b"sum": b"0.02"}
    assert [bucket_of(v) for v in (0.01, 0.0100001, 600.0, 601.0)] == ["0.01", "0.025", "600.0", "+Inf"]


def test_a_flush_redis_refuses_is_dropped_not_sent_again(conn):
    tally, led = Tally(conn, RUN), Ledger(conn, RUN)
    tally.add({"samples_spooled": 5})
    conn.set(Keys(RUN).histogram("job_seconds"), "not a hash")  # the stats land, then the histogram fails
    tally.observe("job_seconds", 1.0)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        tally.flush()
    assert not tally.flush()  # dropped: sent again, the stats would count twice
    assert led.stats() == {"samples_spooled": 5}
