"""Every tunable's default, once: frozen settings, one class per process that takes them (and one
for what every process shares: storage calls, the Redis client).

A default is written here and nowhere else: the CLI's options read theirs from these classes
(`default=WorkerSettings.dump_timeout_s`), the entries take an instance (`run_worker`,
`harvest.collector.service.run_collector`, `harvest.cli.runner.run_all`), and a module-level constant
elsewhere imports its value. tests/unit/test_house.py holds the literals to this module.

What a run must agree on across nodes is not here: that is the run's identity,
`harvest.config.RunIdentity`; only the values a new run's identity takes unless told are
(`IdentityDefaults`). `RunTunables` are the run's own settings, recorded in run.json beside its
identity but never compared (`RunConfig.identity()`).

Imports nothing of harvest: every module may read it, `harvest.config` included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class IdentityDefaults:
    """What a new run's identity is unless told (`--layers`, `--dtype`, `--engine`): the defaults of
    `harvest.config.RunIdentity` and `build_config`, and of the reference engine's capture points."""

    layers: str = "eagle3"  # the EAGLE-3 preset (harvest.config.parse_layers)
    storage_dtype: str = "bf16"
    engine: str = "reference"
    codec: str = "none"  # how a new run codes its hidden states (harvest.formats.codec)


@dataclass(frozen=True)
class RunTunables:
    """A run's settings that change no stored byte: recorded in run.json, not compared."""

    max_batch_samples: int = 32  # samples per job (a producer may choose its own)
    max_batch_tokens: int = 16384  # tokens per job
    shard_bytes: int = 1 << 30  # target shard size (a collector may choose its own)
    # A node spool none of whose processes renewed its lease for this long is lost: its samples are
    # reclaimed and enqueued again (harvest.state.spools, harvest.ops.reclaim).
    spool_grace_s: float = 120.0


@dataclass(frozen=True)
class ProducerSettings:
    """`harvest produce` (and the producer inside `harvest run`)."""

    max_queued: int = 20000  # samples queued or in flight at most; the producer waits beyond
    processes: int = 1  # tokenizer processes
    overlong: str = "skip"  # a sample over its limit: skipped (harvest.producer.rows.OVERLONG_POLICIES)


@dataclass(frozen=True)
class WorkerSettings:
    """`harvest worker` (harvest.workers.worker.run_worker)."""

    dump_timeout_s: float = 60.0  # wait for a request's dump files
    max_spool_bytes: int = 64 << 30  # backpressure while this node's spool holds more
    retries: int = 5  # retries of a job that meets a transient error
    retry_backoff_s: float = 10.0  # before the first retry; x3 each time (capped by the job contract)
    engine_wait_s: float = 0.0  # take no job until the engine is healthy, up to this long
    max_jobs: int | None = None  # exit after this many jobs
    burst: bool = False  # exit when the queue is empty
    node: str | None = None  # node name (None: the host's, harvest.ids.node_name)


@dataclass(frozen=True)
class StorageSettings:
    """Every storage call that may meet a transient failure (harvest.storage.retry)."""

    attempts: int = 5  # attempts of a storage call before a StorageError
    retry_delay_s: float = 0.5  # first delay between those attempts; doubled each time
    max_retry_delay_s: float = 20.0  # ... up to this


@dataclass(frozen=True)
class RedisSettings:
    """Every process's Redis client (harvest.state.connection)."""

    # A Redis that went away is waited for this long (else HARVEST_REDIS_OUTAGE_S, or `--redis-wait`):
    # a Redis restart with a large AOF, or a failover, fits well within it.
    outage_s: float = 300.0


@dataclass(frozen=True)
class CollectorSettings:
    """`harvest collect` (harvest.collector.service.run_collector) and each of its packers."""

    MAX_PACK_WORKERS: ClassVar[int] = 4  # the default packers: the cores, up to this many

    max_wait_s: float = 60.0  # commit a partial shard once its oldest sample is this old
    shard_bytes: int | None = None  # None: the run's (RunTunables.shard_bytes)
    part_bytes: int = 16 << 20  # object storage: multipart part size
    pack_workers: int | None = None  # None: the cores, up to MAX_PACK_WORKERS
    node: str | None = None
    burst: bool = False  # commit what is spooled now, then exit
    storage_retries: int = StorageSettings.attempts  # attempts of a storage call before a StorageError
    retry_delay_s: float = StorageSettings.retry_delay_s  # first delay between those attempts
    orphan_age_s: float = 6 * 3600.0  # a shard file no record names is removed once this old

    def packers(self) -> int:
        return self.pack_workers or min(self.MAX_PACK_WORKERS, os.cpu_count() or 1)


@dataclass(frozen=True)
class EngineSettings:
    """The engines `harvest` starts or prints launch flags for."""

    port: int = 30000  # the reference engine's and SGLang's
    vllm_port: int = 8000
    chunked_prefill_size: int = 0  # the reference engine's prefill chunk (0: whole prompts)
    sglang_chunked_prefill_size: int = 8192
    tp_size: int = 1  # tensor-parallel size (GPUs per server)
    dp_size: int = 1  # data-parallel size (servers per node, each on its own --tp GPUs)
    sglang_version: str = "0.5.23"  # flag spellings follow it (harvest.engines.sglang_launch)
    device: str = "cuda"  # SGLang's (cpu: its CPU engine, as CI runs it)
    dtype: str = "auto"  # SGLang's and vLLM's --dtype (auto: the model's own)
    vllm_kvcache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE


@dataclass(frozen=True)
class AuditSettings:
    """`harvest audit` (harvest.ops.audit)."""

    samples: int = 32  # committed samples recomputed, stratified by length
    # The prefill chunk of the reference engine the audit starts itself: a prime, so its chunk
    # boundaries fall elsewhere than any power-of-two chunking the run may have used.
    chunked_prefill_size: int = 61
    engine_wait_s: float = 300.0  # for the engine it starts to answer /health
    dump_timeout_s: float = 120.0  # for one sample's dump files (one sample alone: it is quick)


@dataclass(frozen=True)
class RunnerSettings:
    """`harvest run` and `harvest demo`: the whole pipeline on this machine (harvest.cli.runner)."""

    workers: int = 2  # with 2, one batch is in the engine while the other worker spools
    redis_url: str | None = None  # None: a private redis-server
    engine_url: str | None = None  # None: start the run's engine
    work_dir: str | None = None  # node-local state (None: harvest.cli.runner.default_work_dir)
    dump_dir: str | None = None  # None: harvest.node.dumpdir.default_dump_dir
    chunked_prefill_size: int = EngineSettings.chunked_prefill_size  # 0: the engine's own (sglang: 8192)
    max_queued: int = ProducerSettings.max_queued
    max_wait_s: float = 5.0  # the collector's: a local run commits partial shards soon
    worker_engine_wait_s: float = 1800.0  # its workers wait this long for the engines it starts (a model load)
    progress: bool = True
    outage_s: float | None = None  # how long Redis may be away (None: harvest.state.connection's)
    # Workers pause while the work dir's filesystem (spool, Redis's append-only file) has less free (0: never)
    min_free_bytes: int = 256 << 20
    prune: bool = False  # drop the queued samples the dataset no longer holds (harvest.ops.coverage)
    tp_size: int = EngineSettings.tp_size  # the started SGLang/vLLM servers' tensor-parallel size
    dp_size: int = EngineSettings.dp_size  # engines started (each with its own workers)

    def node(self) -> NodeSettings:
        """The settings of the run's one node (harvest.cli.node.Node)."""
        return NodeSettings(
            workers=self.workers,
            engine_url=self.engine_url,
            tp_size=self.tp_size,
            dp_size=self.dp_size,
            chunked_prefill_size=self.chunked_prefill_size,
            max_wait_s=self.max_wait_s,
            worker_engine_wait_s=self.worker_engine_wait_s,
            outage_s=self.outage_s,
        )


@dataclass(frozen=True)
class NodeSettings:
    """`harvest node` (and the node inside `harvest run`): one node's engines, workers and collector
    (harvest.cli.node)."""

    workers: int = 2  # per engine: one batch in the engine while the other worker spools
    engine_url: str | None = None  # None: start the node's engines
    tp_size: int = EngineSettings.tp_size
    dp_size: int = EngineSettings.dp_size
    chunked_prefill_size: int = EngineSettings.chunked_prefill_size  # 0: the engine's own (sglang: 8192)
    max_wait_s: float = CollectorSettings.max_wait_s  # the collector's
    worker_engine_wait_s: float = 1800.0  # its workers wait this long for the engines it starts
    engine_start_s: float = (
        1800.0  # an engine it starts must answer /health within this (a large model loads for minutes)
    )
    outage_s: float | None = None  # how long Redis may be away (None: harvest.state.connection's)
    node: str | None = None  # node name (None: the host's, harvest.ids.node_name)
    stop_grace_s: float = 100.0  # SIGTERM: workers, then the collector, then the engines stop within this
    join_wait_s: float = (
        600.0  # wait this long for Redis and for the run to appear in it (and for a Redis that went away)
    )


@dataclass(frozen=True)
class MetricsSettings:
    """`harvest metrics` (harvest.ops.metrics)."""

    port: int = 9108  # the Prometheus exporter's


@dataclass(frozen=True)
class FeedSettings:
    """The training feed, `harvest.read.HiddenStateIterable` (a trainer's process, not harvest's)."""

    shuffle_window: int = 4  # shards whose samples are shuffled together (a reader's next reads stay in these)
    readahead_bytes: int = 256 << 20  # samples read ahead on a thread, at most this many bytes (0: none)
    follow_poll_s: float = 2.0  # a follower lists the run's index files this often while waiting
    follow_wait_s: float = 600.0  # ... and gives up (FeedStalled) when nothing new came for this long
