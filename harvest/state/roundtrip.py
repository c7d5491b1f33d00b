"""Several harvest scripts (and plain commands) sent in one round trip.

Why. On the fleet's one Redis a round trip costs the server more than most scripts' work: a
read and a write system call, and on a VM the wake-up of the client on another core (bench/fleet.py
measures a PING round trip's Redis CPU). A worker's job made
two pairs of calls that need no answer from each other: the ledger's take and the heartbeat's
job line, then the ledger's `SETTLE` and the heartbeat's end of job. Each pair goes as one
pipeline here (where HarvestWorker runs the job, both heartbeat calls ride in RQ's transactions
instead: harvest.workers.rqworker). A plain read (`Command`: the take's HMGET of the job's states) goes with them the
same way: a read needs no script, and carrying its ids into Lua and its values out cost the
server more than the read (bench/job_cost.py).

What it keeps. The calls go as EVALSHAs (and plain commands) in one non-transactional pipeline:
each call is atomic by itself, as when sent alone, and one's error does not stop the next (both
run, or the pipeline's connection error sends both again, as harvest's client sends any batch
again after an outage: harvest.state.connection, where a script whose reply was lost may run
twice). A NOSCRIPT reply (a restarted Redis has no script cache) means that script did not run:
it is loaded and sent again alone. So only calls whose order does not matter go together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis
from redis.commands.core import Script


@dataclass(frozen=True)
class ScriptCall:
    """One call of a script with its KEYS and ARGV (built by harvest.state.scripts)."""

    script: Script
    keys: list[str] = field(default_factory=list)
    args: list[Any] = field(default_factory=list)

    def run(self, conn: redis.Redis) -> Any:
        """Sent alone (EVALSHA; on NOSCRIPT loaded and sent again): its reply."""
        return self.script(keys=self.keys, args=self.args, client=conn)

    def queue(self, pipe: redis.client.Pipeline) -> None:
        """Queued in a caller's MULTI/EXEC as EVAL, with its text: an EVALSHA there runs only on a
        server that still has the script, and harvest's client (harvest.state.connection) sends the
        batch again to a Redis restarted meanwhile, whose EXEC would fail the call with
        NoScriptError and run the rest of the transaction without it."""
        pipe.eval(self.script.script, len(self.keys), *self.keys, *self.args)


@dataclass(frozen=True)
class Command:
    """A plain command (`args[0]` its name), sent as it is."""

    args: tuple[Any, ...]


def send_together(conn: redis.Redis, calls: list[ScriptCall | Command]) -> list[Any]:
    """Each call's reply, in order, from one round trip. Raises the first call's error, if
    any, after every call ran."""
    if len(calls) == 1 and isinstance(calls[0], ScriptCall):
        c = calls[0]
        return [c.script(keys=c.keys, args=c.args, client=conn)]
    with conn.pipeline(transaction=False) as pipe:
        for c in calls:  # plain EVALSHA: redis-py's Script in a pipeline adds a SCRIPT EXISTS round trip
            if isinstance(c, Command):
                pipe.execute_command(*c.args)
            else:
                pipe.evalsha(c.script.sha, len(c.keys), *c.keys, *c.args)
        replies = pipe.execute(raise_on_error=False)
    out = []
    for c, r in zip(calls, replies, strict=False):
        if isinstance(r, redis.exceptions.NoScriptError) and isinstance(c, ScriptCall):  # not run: loaded, sent alone
            try:
                r = c.script(keys=c.keys, args=c.args, client=conn)
            except redis.ResponseError as e:  # its error reply, raised once the others ran
                r = e
        out.append(r)
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out
