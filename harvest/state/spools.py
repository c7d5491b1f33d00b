"""Spool leases: which node spools are alive, and which were given up for lost.

Who owns what. A spool is a spool dir with its random id (harvest.node.spooldir.spool_identity),
shared by one node's workers and collector. It owns the samples the ledger holds in state `s`
with it as owner, for as long as its lease lives: every worker and collector that uses the
spool renews the lease at each heartbeat (`renew`, stamped with Redis's clock, so nodes'
clocks do not matter). A spool whose lease was not renewed for the run's grace period
(`RunConfig.spool_grace_s`) is lost, and the janitor reclaims it (harvest.ops.reclaim): it
revokes the id for good, then puts the spool's samples back on the queue.

What fences a late return. A revoked id owns nothing again: the ledger refuses to mark a
sample spooled for it, the commit fence (`Ledger.fence_commit`) refuses its collector, and
`renew` answers False, upon which the spool's processes take a new id
(harvest.node.spooldir.rotate_spool_identity) and carry on as a fresh spool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from harvest.node.spooldir import rotate_spool_identity
from harvest.state import scripts
from harvest.state.keys import Keys

log = logging.getLogger("harvest.spool")


def redis_time(conn: redis.Redis) -> float:
    sec, usec = conn.time()
    return sec + usec / 1e6


class SpoolLeases:
    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn, self.keys = conn, Keys(run)

    def renew(self, spool: str, node: str) -> bool:
        """Renew `spool`'s lease; False when it was revoked (its processes must take a new id)."""
        return bool(scripts.renew_spool(self.keys, spool, node).run(self.conn))

    def renew_or_rotate(self, spool_dir: str, spool: str, node: str) -> str:
        """Renew the lease of `spool_dir`'s spool `spool` and return the id to go on with: `spool`,
        or, if it was revoked (reclaimed while the node was silent), the dir's new id."""
        if self.renew(spool, node):
            return spool
        new = rotate_spool_identity(spool_dir, spool)
        log.warning("spool %s was reclaimed while this node was silent: it goes on as spool %s", spool, new)
        self.renew(new, node)
        return new

    def is_revoked(self, spool: str) -> bool:
        return bool(self.conn.sismember(self.keys.revoked_spools, spool))

    def revoke(self, spool: str) -> bool:
        """Give `spool` up for good; True if this call revoked it (False: it already was)."""
        return bool(self.conn.sadd(self.keys.revoked_spools, spool))

    def silent_since(self, grace_s: float) -> list[str]:
        """Spools not revoked whose lease was last renewed more than `grace_s` ago (by Redis's clock)."""
        cutoff = redis_time(self.conn) - grace_s
        ids = [v.decode() for v in self.conn.zrangebyscore(self.keys.spool_leases, "-inf", cutoff)]
        revoked = self.revoked(ids)
        return [s for s in ids if s not in revoked]

    def revoked(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        flags = self.conn.smismember(self.keys.revoked_spools, ids)
        return {s for s, f in zip(ids, flags, strict=False) if f}

    def node_of(self, spool: str) -> str:
        """The node that last renewed `spool`'s lease ("?" if none ever did)."""
        return (self.conn.hget(self.keys.spool_nodes, spool) or b"?").decode()

    def sample_counts(self) -> dict[str, int]:
        """Spool -> samples in state s that it owns, for every spool owning any."""
        return {k.decode(): int(v) for k, v in self.conn.hgetall(self.keys.spool_counts).items()}

    def of_node(self, node: str) -> list[str]:
        return sorted(k.decode() for k, v in self.conn.hgetall(self.keys.spool_nodes).items() if v.decode() == node)

    def list(self) -> list[SpoolView]:
        """Every spool the run has seen, for `harvest status`."""
        now = redis_time(self.conn)
        leases = [(m.decode(), score) for m, score in self.conn.zrange(self.keys.spool_leases, 0, -1, withscores=True)]
        ids = [s for s, _ in leases]
        nodes = dict(zip(ids, self.conn.hmget(self.keys.spool_nodes, ids), strict=False)) if ids else {}
        counts = dict(zip(ids, self.conn.hmget(self.keys.spool_counts, ids), strict=False)) if ids else {}
        revoked = self.revoked(ids)
        return [
            SpoolView(
                spool=s,
                node=(nodes[s] or b"?").decode(),
                seen_seconds_ago=round(now - t, 1),
                samples=int(counts[s] or 0),
                revoked=s in revoked,
            )
            for s, t in leases
        ]


@dataclass
class SpoolView:
    spool: str
    node: str
    seen_seconds_ago: float
    samples: int  # in state s, owned by this spool
    revoked: bool
