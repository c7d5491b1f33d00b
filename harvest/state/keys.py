"""Every Redis key harvest uses, in one place, so the layout of a run in Redis can be read here.

Harvest's own keys start with `harvest:`; RQ's keys that harvest touches directly (the janitor's
repairs of RQ's bookkeeping) are named at the end, through RQ's own prefixes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from harvest.ids import check_id

RATE_BUCKET_S = 10  # throughput buckets (`Keys.rate`): small enough for a one-minute rate, few enough keys
RATE_TTL_S = 300  # a bucket expires this long after its last write


@dataclass(frozen=True)
class Keys:
    run: str

    def __post_init__(self) -> None:
        check_id(self.run, "run name")

    @property
    def prefix(self) -> str:
        return f"harvest:{self.run}"

    @property
    def queue_name(self) -> str:
        """The RQ queue of the run (RQ stores it under `rq:queue:<name>`)."""
        return f"harvest:{self.run}"

    @property
    def config(self) -> str:
        """JSON RunConfig, written once when the run starts."""
        return f"{self.prefix}:config"

    @property
    def state(self) -> str:
        """Hash sample_id -> state: one letter, and for a spooled sample its owner and the ref to its
        row, `s:<spool id>[@<job id>#<index>]` (see harvest/state/lua/lib/state_value.lua)."""
        return f"{self.prefix}:state"

    @property
    def counts(self) -> str:
        """Hash state letter -> number of samples in that state, kept by the same script that moves states."""
        return f"{self.prefix}:counts"

    @property
    def failed(self) -> str:
        """Hash sample_id -> JSON {reason, message} for samples in state f."""
        return f"{self.prefix}:failed"

    @property
    def failed_reasons(self) -> str:
        """Hash failure reason -> samples now in state f with it, kept by the ledger's scripts (status
        and metrics count failures from it, not by scanning `failed`)."""
        return f"{self.prefix}:failed-reasons"

    @property
    def failed_examples(self) -> str:
        """Hash failure reason -> `<sample>: <message>` of the latest sample failed with it (status's example)."""
        return f"{self.prefix}:failed-examples"

    @property
    def packing_index(self) -> str:
        """Set of the keys of the run's packing records (harvest.state.packing): listed without a SCAN."""
        return f"{self.prefix}:packing-index"

    @property
    def spool_owner(self) -> str:
        """Hash sample_id -> id of the spool dir that holds its accepted copy, for a sample whose state
        is a bare `s` (written by a harvest before owners moved into the state value): read and
        cleared as such samples move on, never written."""
        return f"{self.prefix}:spool_owner"

    @property
    def stats(self) -> str:
        """Hash of throughput counters (tokens_done, bytes_done, shards)."""
        return f"{self.prefix}:stats"

    @property
    def spooled_payload(self) -> str:
        """Hash sample_id -> payload row of a sample in state s whose job was gone to copy (the others
        keep a ref in their state value, harvest.state.jobcopy), so a lost spool's samples can be
        enqueued again."""
        return f"{self.prefix}:spooled-payload"

    @property
    def job_copies_match(self) -> str:
        """The SCAN pattern of every `job_copy` of the run (the ledger check's, harvest.ops.ledgercheck)."""
        return f"{self.spooled_payload}:*"

    @property
    def job_copy_prefix(self) -> str:
        """The prefix of every `job_copy` (the ledger's scripts add the job id to it)."""
        return f"{self.spooled_payload}:"

    def job_copy(self, job_id: str) -> str:
        """Hash: a copy of RQ's hash of job `job_id`, for the refs to it in spooled samples' state values
        (harvest.state.jobcopy)."""
        return f"{self.job_copy_prefix}{check_id(job_id, 'job id')}"

    @property
    def spool_damaged(self) -> str:
        """Hash sample_id -> times a collector found its spool file damaged and sent it back to the
        queue (harvest.collector.integrity); bounded, and removed when the sample fails for it."""
        return f"{self.prefix}:spool-damaged"

    @property
    def spool_counts(self) -> str:
        """Hash spool id -> samples in state s that spool owns (kept by the ledger's transition script)."""
        return f"{self.prefix}:spool-counts"

    @property
    def spool_leases(self) -> str:
        """Sorted set spool id -> Redis time (s) of the last renewal by one of its workers or collectors."""
        return f"{self.prefix}:spool-leases"

    @property
    def spool_nodes(self) -> str:
        """Hash spool id -> node name of the process that renewed its lease last (for status and --node)."""
        return f"{self.prefix}:spool-nodes"

    @property
    def revoked_spools(self) -> str:
        """Set of spool ids whose samples were reclaimed: never an owner or a committer again."""
        return f"{self.prefix}:revoked-spools"

    @property
    def audit(self) -> str:
        """JSON summary of the run's last `harvest audit` (the output's audits/latest.json holds it too)."""
        return f"{self.prefix}:audit"

    @property
    def failed_payload(self) -> str:
        """Hash sample_id -> JSON payload row (harvest.state.payload.payload_row) of a failed sample, so requeue can rebuild its job."""
        return f"{self.prefix}:failed-payload"

    def rate(self, bucket: int) -> str:
        """Hash of the stats counters added during one RATE_BUCKET_S-second bucket (expires): throughput.
        The bucket is Redis's TIME // RATE_BUCKET_S, taken by the script that writes it."""
        return f"{self.rate_prefix}{int(bucket)}"

    @property
    def rate_prefix(self) -> str:
        """`rate(bucket)` less the bucket: the ledger's scripts append the server's bucket."""
        return f"{self.prefix}:rate:"

    def histogram(self, name: str) -> str:
        """Hash bucket upper bound -> count, plus `sum` and `count`: a Prometheus histogram kept by workers."""
        return f"{self.prefix}:hist:{check_id(name, 'histogram name')}"

    @property
    def workers(self) -> str:
        """Set of the names of workers that announced themselves for this run (alive or not: see worker_key)."""
        return f"{self.prefix}:workers"

    @property
    def collectors(self) -> str:
        """Set of the node names whose collectors announced themselves for this run."""
        return f"{self.prefix}:collectors"

    def collector(self, node: str) -> str:
        """Hash: a collector's heartbeat (spool backlog, shards committed); expires when it stops beating."""
        return f"{self.prefix}:collector:{check_id(node, 'node name')}"

    @property
    def enqueues(self) -> str:
        """Counter every producer transaction increments and WATCHes (harvest.producer.enqueue): two producers
        racing on the same samples abort one another instead of enqueueing a sample twice."""
        return f"{self.prefix}:enqueues"

    @property
    def reaped(self) -> str:
        """Hash job_id -> times the janitor took the job back from a dead worker (bounded)."""
        return f"{self.prefix}:reaped"

    @property
    def janitor_lock(self) -> str:
        """Short lock so one janitor pass at a time does the run-wide work."""
        return f"{self.prefix}:janitor-lock"

    def packing(self, host: str, packer: int = 0) -> str:
        """JSON {shard_id, sample_ids, spool} of the shard packer `packer` of a node's collector is
        committing; survives its crash. Packer 0's key is the node's plain key."""
        base = f"{self.prefix}:packing:{check_id(host, 'host name')}"
        return base if packer == 0 else f"{base}:{int(packer)}"

    def packing_extra_pattern(self, host: str) -> str:
        """SCAN pattern matching the records of a node's packers other than packer 0."""
        return f"{self.prefix}:packing:{check_id(host, 'host name')}:*"

    @property
    def ledger_id(self) -> str:
        """A random id this ledger takes when first used: its claims in storage name it
        (harvest.formats.claims), so a collector tells its own ledger's commits in flight from
        another ledger's (a second runner on the same output). A collector that knew the id writes
        it back if Redis lost it (`Ledger.identity`)."""
        return f"{self.prefix}:ledger-id"

    @property
    def produced(self) -> str:
        """Redis time (s) at which a producer finished a pass over its dataset; deleted when a pass
        starts (harvest.state.passes). A node exits done only while it is set."""
        return f"{self.prefix}:produced"

    @property
    def ledger_epoch(self) -> str:
        """The `run_id` of the Redis server instance whose ledger was last reconciled from storage
        (harvest.ops.recovery): a restarted, rolled-back or failed-over Redis has another run_id, so
        every process sees that the ledger may have forgotten writes and reconciles before going on."""
        return f"{self.prefix}:ledger-epoch"

    @property
    def reap_after(self) -> str:
        """Redis time (s) before which no janitor takes a worker for dead because its heartbeat is
        missing (harvest.ops.liveness): a Redis that came back without the latest beats (a restart,
        a rollback, a failover) holds live workers without heartbeats until they beat again.
        Written by the process that reconciles the ledger for a new server (harvest.ops.recovery)."""
        return f"{self.prefix}:reap-after"

    @property
    def reconcile_lock(self) -> str:
        """Lock held by the one process reconciling the ledger from storage (harvest.ops.recovery)."""
        return f"{self.prefix}:reconcile-lock"

    @property
    def stranded(self) -> str:
        """Sorted set sample_id -> Redis time (s) a janitor first saw it queued with no live job
        (harvest.ops.stranded): re-enqueued once it stays so for a grace period. Two reserved
        members, `~check` and `~sweep` (sample ids are hex, so never these), hold the Redis time
        of the fleet's last cheap check and last sweep."""
        return f"{self.prefix}:stranded"

    @property
    def suspect_executions(self) -> str:
        """Hash `job_id:execution_id` -> Redis time (s) a janitor first saw a started execution whose
        live worker's heartbeat names another job (a ledger rolled back under a running fleet);
        fields `<job_id>:dequeued` stamp a job dequeued with no execution (harvest.ops.liveness)."""
        return f"{self.prefix}:suspect-executions"

    @property
    def packing_pattern(self) -> str:
        """SCAN pattern matching every collector's packing record of the run."""
        return f"{self.prefix}:packing:*"


# SCAN pattern of every run's config key, and the run name of a key it matched.
RUN_CONFIG_PATTERN = "harvest:*:config"

# Never set: harvest.state.refusal's probe of whether Redis takes writes is `SET` it `XX`.
WRITES_PROBE = "harvest:probe:writes"


def run_of_config_key(key: str) -> str:
    return key.split(":")[1]


def worker_key(name: str) -> str:
    """Hash: a worker's heartbeat (run, host, engine, current job); expires when the worker stops beating.
    Not per run: a janitor deciding whether a `.claimed-<name>` dir in a shared dump dir is orphaned
    must see workers of every run."""
    return f"harvest:worker:{check_id(name, 'worker name')}"


def rq_execution_key(job_id: str, execution_id: str) -> str:
    """RQ's hash of one execution of a job (it names the worker running it)."""
    from rq.executions import Execution

    return Execution(execution_id, job_id, connection=None).key  # type: ignore[arg-type]


def rq_worker_key(name: str) -> str:
    """RQ's hash of a worker, as RQ's worker registry lists it."""
    from rq.worker import Worker

    return Worker.redis_worker_namespace_prefix + name


@functools.cache
def rq_job_prefix() -> str:
    """RQ's prefix of a job's hash (`rq:job:`), as RQ's Job class names it: the ledger's scripts
    copy the hash of the job a worker runs (harvest.state.jobcopy), and the dequeue reads it."""
    from rq.job import Job

    return Job.redis_job_namespace_prefix
