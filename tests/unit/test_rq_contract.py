"""What harvest relies on in RQ, held against the installed RQ (pyproject.toml bounds it to the
major tested here) and a real redis-server: the methods harvest's worker, queue and job classes
override exist in RQ with the parameters harvest takes, harvest's own helpers do not collide with
RQ's names, the RQ calls harvest makes accept the arguments it passes, and the keys and hash
fields harvest reads or writes directly are where RQ puts them. A new RQ that moves any of them
fails here, not in a fleet."""

from __future__ import annotations

import importlib.metadata as md
import inspect
import os
import tomllib
import zlib

import pytest
from packaging.requirements import Requirement
from rq import Retry, worker_registration
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.registry import BaseRegistry, FailedJobRegistry
from rq.results import Result
from rq.utils import now, parse_composite_key
from rq.worker import SimpleWorker, Worker
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from harvest.state.jobs import JOB_FUNCTION, SERIALIZER, PayloadJob
from harvest.state.keys import rq_execution_key, rq_job_prefix, rq_worker_key
from harvest.workers.rqworker import HarvestWorker
from harvest.workers.safejob import HarvestJob
from tests.support.cli import REPO


def test_rq_is_bounded_to_the_major_tested_here():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        (rq,) = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"] if r.startswith("rq")]
    (upper,) = [s.version for s in rq.specifier if s.operator == "<"]
    (lower,) = [s.version for s in rq.specifier if s.operator == ">="]
    assert upper.isdigit()  # a next major, not a release within one
    assert lower.split(".")[0] == str(int(upper) - 1)  # one major: the one this test runs against
    assert md.version("rq") in rq.specifier


# Per harvest class: its RQ base, the RQ methods and properties it overrides, and its own names
# (which RQ must not define: a later RQ calling one of them would call harvest's).
CLASSES = {
    HarvestWorker: (
        SimpleWorker,
        {
            "__init__",
            "request_force_stop",
            "subscribe",
            "heartbeat",
            "clean_registries",
            "prepare_execution",
            "cleanup_execution",
            "handle_job_retry",
            "handle_job_success",
        },
        {"beat", "_start_of"},
    ),
    PayloadJob: (Job, {"to_dict"}, set()),
    HarvestJob: (
        PayloadJob,
        {"func", "success_callback", "failure_callback", "stopped_callback"},
        {"_refuse_callback"},
    ),
}


def own_names(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) or isinstance(v, (property, classmethod, staticmethod))}


def params(f) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]


def takes_what_rq_passes(ours, theirs) -> bool:
    """`ours` takes every call RQ makes of `theirs`: the same parameters (names, order, kinds), or
    *args and **kwargs with anything more of its own optional."""
    o = inspect.signature(ours).parameters.values()
    kinds = {p.kind for p in o}
    if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
        return all(
            p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in o
            if p.name != "self"
        )
    return params(ours) == params(theirs)


@pytest.mark.parametrize("cls", list(CLASSES), ids=lambda c: c.__name__)
def test_harvest_overrides_exactly_these_rq_methods_with_rqs_parameters(cls):
    base, overrides, own = CLASSES[cls]
    names = own_names(cls) - {"__module__", "__doc__", "__annotations__"}
    assert {n for n in names if hasattr(base, n)} == overrides
    assert {n for n in names if not hasattr(base, n)} == own
    for name in overrides:
        ours, theirs = inspect.getattr_static(cls, name), inspect.getattr_static(base, name)
        if isinstance(ours, property):
            assert isinstance(theirs, property), name
            continue
        assert takes_what_rq_passes(getattr(cls, name), getattr(base, name)), (cls.__name__, name)


# The RQ callables harvest calls, and the parameters it passes them by name or position.
CALLS = [
    (Execution.create, ["job", "ttl", "pipeline", "worker_name"]),
    (Execution.delete, ["self", "job", "pipeline"]),
    (Execution.__init__, ["self", "id", "job_id", "connection", "worker_name"]),
    (Job.prepare_for_execution, ["self", "worker_name", "pipeline"]),
    (Job.set_status, ["self", "status", "pipeline"]),
    (Job.get_status, ["self", "refresh"]),
    (Job.get_result_ttl, ["self", "default_ttl"]),
    (Job.to_dict, ["self", "include_meta", "include_result"]),
    (Job.restore, ["self", "raw_data"]),
    (Job.fetch_many, ["job_ids", "connection", "serializer"]),
    (
        Queue.enqueue_call,
        ["self", "func", "args", "description", "job_id", "timeout", "result_ttl", "failure_ttl", "pipeline"],
    ),
    (Queue.enqueue_job, ["self", "job", "pipeline"]),
    (Queue.dequeue_any, ["queues", "timeout", "connection", "job_class", "serializer", "death_penalty_class"]),
    (FailedJobRegistry.add, ["self", "job", "ttl", "pipeline", "exc_string"]),
    (BaseRegistry.get_job_count, ["self", "cleanup"]),
    (Retry.get_interval, ["count", "intervals"]),
    (Worker.set_state, ["self", "state", "pipeline"]),
    (Worker.heartbeat, ["self", "timeout", "pipeline"]),
    (Worker.cleanup_execution, ["self", "job", "pipeline", "execution"]),
    (Worker.get_heartbeat_ttl, ["self", "job"]),
    (Worker.handle_job_success, ["self", "job", "queue", "started_job_registry", "execution"]),
    (Worker.increment_successful_job_count, ["self", "pipeline"]),
    (Worker.increment_total_working_time, ["self", "job_execution_time", "pipeline"]),
    (Worker.handle_job_retry, ["self", "job", "queue", "retry", "started_job_registry", "execution"]),
    (worker_registration.clean_worker_registry, ["queue"]),
    (Result.get_key, ["job_id"]),
]


@pytest.mark.parametrize("f,passed", CALLS, ids=lambda x: getattr(x, "__qualname__", ""))
def test_the_rq_calls_harvest_makes_take_the_arguments_it_passes(f, passed):
    assert set(passed) <= {name for name, _ in params(f)}, f.__qualname__


def test_the_rq_attributes_harvest_reads_and_sets_exist(conn):
    queue = Queue("contract", connection=conn)
    worker = SimpleWorker([queue], connection=conn, name="contract-w")
    for attr in (
        "_state",
        "executions",
        "worker_ttl",
        "last_cleaned_at",
        "pubsub_channel_name",
        "handle_payload",
        "_pubsub_exception_handler",
        "default_result_ttl",
        "queues",
        "key",
        "log",
        "connection",
        "job_class",
        "serializer",
        "get_redis_server_version",
    ):
        assert hasattr(worker, attr), attr
    job = queue.enqueue_call(JOB_FUNCTION, args=("p",), job_id="contract-j")
    for attr in (
        "_data",
        "_status",
        "repeats_left",
        "has_rate_limit",
        "group_id",
        "execution_registry",
        "key",
        "dependents_key",
        "dependencies_key",
        "number_of_retries",
        "func_name",
        "instance",
        "args",
        "_success_callback_name",
        "_failure_callback_name",
        "_stopped_callback_name",
        "failure_ttl",
    ):
        assert hasattr(job, attr), attr
    for reg in (
        "scheduled_job_registry",
        "canceled_job_registry",
        "deferred_job_registry",
        "finished_job_registry",
        "failed_job_registry",
        "started_job_registry",
    ):
        assert getattr(queue, reg).key.endswith(":contract"), reg


def test_rqs_keys_are_where_harvest_and_rqs_tools_look(conn):
    """Harvest's Lua reads a job's hash at `rq_job_prefix() + id` when it copies it
    (settle.lua); rq info and rq-dashboard list the same keys."""
    queue = Queue("run-x", connection=conn)
    assert rq_job_prefix() == Job.redis_job_namespace_prefix == "rq:job:"
    assert Job.key_for("j1") == "rq:job:j1"
    assert queue.key == "rq:queue:run-x"
    assert queue.intermediate_queue_key == "rq:queue:run-x:intermediate"
    assert (
        queue.started_job_registry.key,
        queue.failed_job_registry.key,
        queue.finished_job_registry.key,
        queue.scheduled_job_registry.key,
    ) == ("rq:wip:run-x", "rq:failed:run-x", "rq:finished:run-x", "rq:scheduled:run-x")
    assert rq_execution_key("j1", "e1") == "rq:execution:j1:e1"
    assert rq_worker_key("w1") == "rq:worker:w1"
    assert (REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY % "run-x") == ("rq:workers", "rq:workers:run-x")


def test_a_job_enqueued_as_harvest_does_is_a_hash_whose_data_the_job_copy_reads(conn):
    """harvest.state.jobcopy reads a copy of the job's hash: field `data`, zlib of the serializer's
    (function, instance, args, kwargs)."""
    queue = Queue("contract", connection=conn, serializer=SERIALIZER, job_class=PayloadJob)
    with conn.pipeline() as pipe:
        queue.enqueue_call(
            JOB_FUNCTION,
            args=('{"v": 2}',),
            description="d",
            job_id="j1",
            timeout=60,
            result_ttl=0,
            failure_ttl=100,
            pipeline=pipe,
        )
        pipe.execute()
    assert conn.lrange(queue.key, 0, -1) == [b"j1"]
    raw = conn.hgetall(rq_job_prefix() + "j1")
    assert (raw[b"origin"], raw[b"description"]) == (b"contract", b"d")
    func, instance, args, kwargs = SERIALIZER.loads(zlib.decompress(raw[b"data"]))
    assert (func, instance, list(args), kwargs) == (JOB_FUNCTION, None, ['{"v": 2}'], {})
    assert list(Job.fetch("j1", connection=conn, serializer=SERIALIZER).args) == ['{"v": 2}']


def test_rqs_dequeue_moves_the_job_to_the_intermediate_list_the_janitor_watches(conn):
    """harvest.ops.liveness puts back a job left in the intermediate list without an execution."""
    queue = Queue("contract", connection=conn, serializer=SERIALIZER, job_class=PayloadJob)
    for j in ("j1", "j2"):
        queue.enqueue_call(JOB_FUNCTION, args=(j,), job_id=j)
    job, _ = Queue.dequeue_any([queue], None, connection=conn, job_class=PayloadJob, serializer=SERIALIZER)
    assert job.id == "j1" and conn.lrange(queue.intermediate_queue_key, 0, -1) == [b"j1"]
    assert (list(job.args), job.func_name) == (["j1"], JOB_FUNCTION)
    assert conn.lrange(queue.key, 0, -1) == [b"j2"]


def test_an_execution_is_a_job_colon_execution_entry_and_a_hash_naming_its_worker(conn):
    """harvest.ops.liveness reads the started registry's entries and each execution's worker."""
    queue = Queue("contract", connection=conn)
    job = queue.enqueue_call(JOB_FUNCTION, args=("p",), job_id="j1")
    with conn.pipeline() as pipe:
        execution = Execution.create(job, 60, pipeline=pipe, worker_name="w1")
        pipe.execute()
    (entry,) = conn.zrange(queue.started_job_registry.key, 0, -1)
    assert entry.decode() == f"j1:{execution.id}" and parse_composite_key(entry.decode()) == ("j1", execution.id)
    assert conn.hget(rq_execution_key("j1", execution.id), "worker_name") == b"w1"
    with conn.pipeline() as pipe:
        Execution(execution.id, "j1", conn, worker_name="w1").delete(job=job, pipeline=pipe)
        pipe.execute()
    assert conn.zcard(queue.started_job_registry.key) == 0 and not conn.exists(rq_execution_key("j1", execution.id))


def test_a_worker_registers_where_the_janitor_forgets_it(conn):
    queue = Queue("contract", connection=conn)
    worker = SimpleWorker([queue], connection=conn, name="w1")
    worker.register_birth()
    try:
        assert conn.exists(rq_worker_key("w1"))
        assert conn.sismember(REDIS_WORKER_KEYS, rq_worker_key("w1"))
        assert conn.sismember(WORKERS_BY_QUEUE_KEY % queue.name, rq_worker_key("w1"))
    finally:
        worker.register_death()


def test_a_failed_job_is_counted_and_a_retry_waits_its_interval(conn):
    queue = Queue("contract", connection=conn)
    job = queue.enqueue_call(JOB_FUNCTION, args=("p",), job_id="j1")
    with conn.pipeline() as pipe:
        FailedJobRegistry(queue=queue).add(job, ttl=100, pipeline=pipe, exc_string="x")
        pipe.execute()
    assert queue.failed_job_registry.get_job_count(cleanup=False) == 1
    assert [Retry.get_interval(n, [5, 10]) for n in (0, 1, 7)] == [5, 10, 10]
    assert Result.get_key("j1") == "rq:results:j1"


def _after_success(conn, cls: type[SimpleWorker]) -> tuple[set[str], dict[bytes, bytes]]:
    """A job of harvest's kind (result_ttl 0, no dependents) run to its success by a worker of
    `cls`: the keys left, with the worker's and its queue's names made alike, and RQ's counters."""
    conn.flushall()
    queue = Queue("contract", connection=conn, serializer=SERIALIZER, job_class=PayloadJob)
    queue.enqueue_call(JOB_FUNCTION, args=("p",), job_id="j1", result_ttl=0)
    worker = cls([queue], connection=conn, serializer=SERIALIZER, job_class=PayloadJob, name="w1")
    worker.register_birth()
    job, _ = worker.dequeue_job_and_maintain_ttl(None)
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    job.started_at = job.ended_at = now()
    worker.handle_job_success(job, queue, queue.started_job_registry, execution)
    counters = {
        k: v
        for k, v in conn.hgetall(worker.key).items()
        if k in (b"successful_job_count", b"failed_job_count", b"total_working_time")
    }
    return {k.decode() for k in conn.keys("*")}, counters


def test_harvests_success_leaves_what_rqs_own_leaves(conn):
    """HarvestWorker.handle_job_success writes RQ's records of a success without RQ's reads: a
    new RQ that records a success elsewhere, or keeps more of it, fails here."""
    theirs, ours = _after_success(conn, SimpleWorker), _after_success(conn, HarvestWorker)
    assert ours == theirs
    assert not any(k.startswith(("rq:job:", "rq:execution")) for k in ours[0])
    assert ours[1][b"successful_job_count"] == b"1"


def _after_start(conn, cls: type[SimpleWorker]) -> tuple[set[str], dict[bytes, bytes], int]:
    """A job dequeued and its execution prepared by a worker of `cls`, then a heartbeat on its
    own: the keys left, the worker's state and whether its heartbeat field is set, the key's TTL."""
    conn.flushall()
    queue = Queue("contract", connection=conn, serializer=SERIALIZER, job_class=PayloadJob)
    queue.enqueue_call(JOB_FUNCTION, args=("p",), job_id="j1", result_ttl=0)
    worker = cls([queue], connection=conn, serializer=SERIALIZER, job_class=PayloadJob, name="w1")
    worker.register_birth()
    conn.persist(worker.key)
    job, _ = worker.dequeue_job_and_maintain_ttl(None)
    worker.prepare_execution(job)
    worker.heartbeat()
    fields = {k: v for k, v in conn.hgetall(worker.key).items() if k == b"state"}
    fields[b"beat"] = b"1" if conn.hget(worker.key, "last_heartbeat") else b"0"
    keys = {k.decode().rsplit(":", 1)[0] if k.startswith(b"rq:execution:") else k.decode() for k in conn.keys("*")}
    return keys, fields, conn.ttl(worker.key) > 0  # an execution's key named without its random id


def test_harvests_execution_start_and_heartbeat_write_what_rqs_do(conn):
    """HarvestWorker.prepare_execution and .heartbeat write RQ's records (the execution, the
    started registry, the worker busy; its heartbeat field and TTL): a new RQ that records them
    elsewhere fails here."""
    assert _after_start(conn, HarvestWorker) == _after_start(conn, SimpleWorker)
