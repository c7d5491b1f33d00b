"""Whether a producer finished its pass over the run's dataset: what tells a node (`harvest node`)
that an empty queue is the end of the run rather than a pause before more samples are enqueued.

The producer deletes `Keys.produced` when a pass starts and sets it (to Redis's time) when the
pass ended on the server it began on (harvest.producer.producer.produce). A Redis that came back without
the key holds the run as unfinished until a producer passes over the dataset again.
"""

from __future__ import annotations

import redis

from harvest.state.keys import Keys


def pass_started(conn: redis.Redis, run: str) -> None:
    conn.delete(Keys(run).produced)


def pass_finished(conn: redis.Redis, run: str) -> None:
    seconds, _ = conn.time()
    conn.set(Keys(run).produced, str(seconds))


def produced(conn: redis.Redis, run: str) -> bool:
    """A producer finished a pass over the run's dataset, and none started since."""
    return bool(conn.exists(Keys(run).produced))
