"""The frozen-collector harness: a collector frozen (SIGSTOP) at a commit step while its spool is
revoked and another collector re-packs and commits its samples, then resumed (SIGCONT), and the
exact end state every such interleaving must leave.

Node A's collector runs in a forked child that stops itself at a named point
(`HARVEST_COLLECTOR_CRASH_AT=point[:n]:stop`, harvest.collector.faults), as a paused VM or a long stall
would. While it is stopped its spool is reclaimed (`reclaim_spool`, what the janitor does once the
spool is silent past its grace), the reclaimed samples are spooled again on node B (copies of
their files, marked spooled by B's spool, as B's worker would), and B's collector starts (its
start tends A's record: `tend_revoked`). The order says when A resumes:

- `first`: before B starts (A's record not yet tended);
- `before-fence`: while B is stopped at its own point (default `uploaded`: its shard visible, not
  yet fenced), then B resumes;
- `after-commit`: after B has committed everything and exited.

A `tend` pass of a third collector may run at a chosen moment too. Used by
tests/system/test_freeze_collector.py and the soak, tests/support/freeze_soak.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import traceback
from collections import Counter

import boto3
import redis
import torch

from harvest.collector.faults import CRASH_ENV
from harvest.collector.packers import Packers
from harvest.collector.records import tend_revoked
from harvest.formats.claims import CLAIMS, claim_file
from harvest.formats.index import INDEX
from harvest.formats.shard import SHARDS, shard_file
from harvest.node.spooldir import list_spooled, spool_identity, spool_path
from harvest.ops.reclaim import reclaim_spool
from harvest.read.reader import RunReader
from harvest.sample import Sample
from harvest.state.ledger import Ledger
from harvest.state.payload import payload_row
from harvest.state.runstore import publish_run
from harvest.storage import Location, retry
from tests.support.synth import make_config, spool_samples
from tests.support.wait import wait_for

FORK = multiprocessing.get_context("fork")
ORDERS = ("first", "before-fence", "after-commit")
TIMEOUT_S = 60.0


def _collect(
    redis_url: str, cfg, spool: str, node: str, freeze: str | None, shard_bytes: int, part_bytes: int | None
) -> None:
    """A node's collector in a forked child: resume, commit everything spooled, exit 0 (3 on an error)."""
    if freeze:
        os.environ[CRASH_ENV] = freeze
    else:
        os.environ.pop(CRASH_ENV, None)
    try:
        c = Packers(
            redis.Redis.from_url(redis_url),
            cfg,
            spool,
            1,
            node=node,
            shard_bytes=shard_bytes,
            part_bytes=part_bytes,
            retry_delay=0.05,
            retries=3,
        )
        c.resume()
        c.drain()
    except BaseException:  # noqa: BLE001 - told on stderr, the exit status says it
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def process_state(pid: int) -> str:
    """The kernel's state letter of `pid` ('T': stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class Node:
    """One node's collector process, which may stop itself at a point."""

    def __init__(self, trial: FreezeTrial, spool: str, name: str, freeze: str | None) -> None:
        self.p = FORK.Process(
            target=_collect, args=(trial.redis_url, trial.cfg, spool, name, freeze, trial.shard_bytes, trial.part_bytes)
        )
        self.p.start()

    def stopped_or_exited(self) -> bool:
        """Wait until it stops itself (True) or exits (False: its point was never reached)."""
        wait_for(
            lambda: not self.p.is_alive() or process_state(self.p.pid) == "T",
            TIMEOUT_S,
            "the collector to stop itself or exit",
        )
        return self.p.is_alive()

    def resume(self) -> None:
        os.kill(self.p.pid, signal.SIGCONT)

    def exit_code(self) -> int:
        self.p.join(TIMEOUT_S)
        assert self.p.exitcode is not None, "collector hung"
        return self.p.exitcode


class FreezeTrial:
    def __init__(
        self,
        conn: redis.Redis,
        redis_url: str,
        root: str,
        out_url: str,
        lengths: list[int],
        hidden: int = 16,
        run: str = "r",
        shard_samples: int = 3,
        part_bytes: int | None = None,
    ) -> None:
        self.conn, self.redis_url, self.root = conn, redis_url, root
        self.cfg = publish_run(conn, make_config(out_url, run=run, hidden=hidden))
        self.part_bytes = part_bytes
        self.spool_a, self.spool_b = os.path.join(root, f"spool-a-{run}"), os.path.join(root, f"spool-b-{run}")
        self.samples = spool_samples(self.spool_a, self.cfg, lengths, seed0=sum(map(ord, run)) % 1000)
        self.order = [sid for sid, _, _ in list_spooled(self.spool_a)]
        self.shard_bytes = sum(size for _, _, size in list_spooled(self.spool_a)[:shard_samples])
        self.ledger = Ledger(conn, run)
        self.rows = {
            s.id: payload_row(run, Sample.build(s.input_ids.numpy(), s.loss_mask.numpy())) for s in self.samples
        }
        ids = [s.id for s in self.samples]
        self.ledger.add_queued(ids)
        self.ledger.mark_spooled(ids, owner=spool_identity(self.spool_a), rows=[self.rows[s] for s in ids])
        self.loc = Location.from_url(out_url).child(run)
        self.frozen_record: dict | None = None  # A's packing record as it stopped
        self.froze = False
        self.codes: dict[str, int] = {}

    def tend(self) -> int:
        """A tend pass of a third collector (every collector runs one every 10 s)."""
        return tend_revoked(
            self.conn, self.cfg.run, self.loc, lambda fn, what: retry(fn, what, base_delay=0.05), frozenset()
        )

    def execute(
        self, point: str, order: str, at: int = 1, b_point: str = "uploaded", tend_at: str | None = None
    ) -> None:
        """A frozen at the `at`-th `point`; its spool reclaimed and re-spooled on B; A resumed per
        `order`; `tend_at` ('frozen', 'resumed'): a third collector's tend pass right after the
        reclaim, or right after A resumed."""
        a = Node(self, self.spool_a, "na", f"{point}:{at}:stop")
        self.froze = a.stopped_or_exited()
        if not self.froze:  # finished before the point: nothing to interleave
            self.codes["a"] = a.exit_code()
            return
        raw = self.conn.get(self.ledger.keys.packing("na"))
        self.frozen_record = None if raw is None else json.loads(raw)
        rep = reclaim_spool(self.conn, self.cfg, spool_identity(self.spool_a))
        self.respool(rep.samples)
        if tend_at == "frozen":
            self.tend()
        if order == "first":
            self._finish(a, tend_at)
            self.codes["b"] = Node(self, self.spool_b, "nb", None).exit_code()
        else:
            b = Node(self, self.spool_b, "nb", f"{b_point}:stop" if order == "before-fence" else None)
            if order == "before-fence" and b.stopped_or_exited():
                self._finish(a, tend_at)
                b.resume()
            self.codes["b"] = b.exit_code()
            if "a" not in self.codes:
                self._finish(a, tend_at)
        # Both collectors carry on, as their run loops would (a burst stops at the first step that
        # commits nothing, such as a shard given up): their next pass removes the copies others
        # committed and commits what a void left.
        self.codes["a-next"] = Node(self, self.spool_a, "na", None).exit_code()
        self.codes["b-next"] = Node(self, self.spool_b, "nb", None).exit_code()

    def _finish(self, a: Node, tend_at: str | None) -> None:
        a.resume()
        if tend_at == "resumed":
            self.tend()
        self.codes["a"] = a.exit_code()

    def respool(self, ids: list[str]) -> None:
        """The reclaimed samples extracted again on node B: their files in B's spool, marked spooled by it."""
        os.makedirs(self.spool_b, exist_ok=True)
        for sid in ids:
            shutil.copyfile(spool_path(self.spool_a, sid), spool_path(self.spool_b, sid))
        moved = self.ledger.mark_spooled(ids, owner=spool_identity(self.spool_b), rows=[self.rows[s] for s in ids])
        assert sorted(moved) == sorted(ids)

    # -- the end state ------------------------------------------------------------------------
    def committed(self) -> dict[str, list[str]]:
        return {
            n.removesuffix(".json"): self.loc.read_json(f"{INDEX}/{n}")["samples"]
            for n in self.loc.list(INDEX, ".json")
        }

    def problems(self) -> dict[str, list]:
        """What the end state gets wrong, by kind (lost, doubled, unreadable, wrong, ...); empty lists when exact."""
        committed = self.committed()
        copies = Counter(s for ids in committed.values() for s in ids)
        holder = {s: shard for shard, ids in committed.items() for s in ids}
        found: dict[str, list] = {
            k: [] for k in ("lost", "doubled", "unreadable", "wrong", "claims", "leftovers", "ledger", "exits")
        }
        found["lost"] = [s for s in self.order if not copies[s]]
        found["doubled"] = [s for s in self.order if copies[s] > 1] + [s for s in copies if s not in self.order]
        reader = RunReader(self.loc.url())
        for s in self.samples:
            if not copies[s.id]:
                continue
            try:
                got = reader.get(s.id)
            except Exception as e:  # noqa: BLE001 - counted, the caller asserts
                found["unreadable"].append(f"{s.id}: {type(e).__name__}: {e}")
                continue
            if not (
                torch.equal(got["input_ids"], s.input_ids)
                and torch.equal(got["loss_mask"], s.loss_mask)
                and torch.equal(got["hidden_states"], s.hidden_states)
            ):
                found["wrong"].append(s.id)
        claims = {n.removesuffix(".json") for n in self.loc.list(CLAIMS, ".json")}
        for s in self.order:
            raw = self.loc.read_bytes(claim_file(s)) if s in claims else None
            if raw is None or json.loads(raw)["shard"] != holder.get(s):
                found["claims"].append(f"{s}: {raw!r}, committed in {holder.get(s)}")
        found["claims"] += sorted(claims - set(self.order))
        found["leftovers"] = [n for n in self.loc.list(SHARDS) if n.removesuffix(".safetensors") not in committed]
        if self.loc.is_local:
            found["leftovers"] += [f for f in os.listdir(self.loc.path(SHARDS)) if f.startswith(".")]
        else:
            bucket, _, prefix = self.loc.root.partition("/")
            s3 = boto3.client("s3", endpoint_url=os.environ["HARVEST_S3_ENDPOINT"], region_name="us-east-1")
            found["leftovers"] += [
                u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
            ]
        for d in (self.spool_a, self.spool_b):
            found["leftovers"] += (
                [os.path.join(d, f) for f in os.listdir(d) if f not in (".spool-id", ".spool-id.lock")]
                if os.path.isdir(d)
                else []
            )
        n = len(self.order)
        counts = self.ledger.counts()
        if counts != {"queued": 0, "spooled": 0, "done": n, "failed": 0, "total": n}:
            found["ledger"].append(counts)
        found["ledger"] += [k.decode() for k in self.conn.scan_iter(match=self.ledger.keys.packing_pattern)]
        found["exits"] = [f"{k}: {v}" for k, v in self.codes.items() if v != 0]
        return found

    def frozen_shard_fate(self) -> tuple[str, bool, bool]:
        """A's shard as it stopped: (its name, whether an index commits it, whether its object exists)."""
        sid = self.frozen_record["shard_id"]
        return sid, sid in self.committed(), self.loc.exists(shard_file(sid))
