"""`harvest worker`: an RQ worker bound to one run and one engine on this node."""

from __future__ import annotations

import logging
import os
import shutil
import socket

import redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from harvest.keys import Keys
from harvest.runstore import load_run
from workers.engine_client import EngineClient
from workers.job import WorkerContext, install

log = logging.getLogger("harvest.worker")


def private_dir(path: str) -> str:
    """Create (0700) a directory that holds files others trust; refuse a symlink in its place."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.path.islink(path):
        raise RuntimeError(f"{path} is a symlink; refusing to use it")
    return path


def run_worker(
    redis_url: str,
    run: str,
    engine_url: str,
    dump_dir: str,
    spool_dir: str,
    burst: bool = False,
    dump_timeout: float = 60.0,
    max_spool_bytes: int = 64 << 30,
) -> None:
    conn = redis.Redis.from_url(redis_url)
    cfg = load_run(conn, run)
    name = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
    claim_dir = private_dir(os.path.join(private_dir(dump_dir), f".claimed-{name}"))
    ctx = WorkerContext(
        conn=conn,
        cfg=cfg,
        engine=EngineClient(engine_url),
        dump_dir=dump_dir,
        spool_dir=private_dir(spool_dir),
        claim_dir=claim_dir,
        dump_timeout=dump_timeout,
        max_spool_bytes=max_spool_bytes,
    )
    install(ctx)
    queue = Queue(Keys(run).queue_name, connection=conn, serializer=JSONSerializer)
    worker = SimpleWorker([queue], connection=conn, serializer=JSONSerializer, name=name)
    log.info("worker %s: run %s, engine %s", name, run, engine_url)
    try:
        worker.work(burst=burst, logging_level="WARNING")
    finally:
        shutil.rmtree(claim_dir, ignore_errors=True)
        ctx.engine.close()
