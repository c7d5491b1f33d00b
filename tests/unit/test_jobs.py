"""The RQ job contract (harvest.state.jobs): JSON payloads, compressed cheaply, read back exactly."""

from __future__ import annotations

import json
import zlib

from harvest.sample import Sample
from harvest.state.jobs import DATA_ZLIB_LEVEL, JOB_FUNCTION, enqueue_samples, fetch_job, run_queue
from harvest.state.payload import decode_batch
from harvest.workers.safejob import HarvestJob


def test_job_data_is_json_compressed_at_level_1_and_a_worker_reads_it_back(conn):
    samples = [Sample.build(list(range(i, i + 300 * (i + 1)))) for i in range(3)]
    q = run_queue(conn, "r")
    with conn.pipeline() as pipe:
        pipe.multi()
        enqueue_samples(q, "r", samples, "job-1", pipe)
        pipe.execute()
    stored = conn.hget("rq:job:job-1", "data")
    data = zlib.decompress(stored)
    assert stored == zlib.compress(data, DATA_ZLIB_LEVEL)  # not RQ's default level 6
    func, instance, args, kwargs = json.loads(data)
    assert (func, instance, kwargs) == (JOB_FUNCTION, None, {})
    run, back = decode_batch(args[0])
    assert run == "r" and [s.input_ids.tolist() for s in back] == [s.input_ids.tolist() for s in samples]
    job = HarvestJob.fetch("job-1", connection=conn, serializer=q.serializer)  # as a worker fetches it
    assert job.func.__name__ == "process_batch" and decode_batch(job.args[0])[0] == "r"
    # RQ's default description is the repr of the call: the payload a second time, in the job hash
    assert job.description == "harvest.workers.job.process_batch: 3 samples of run r"
    assert len(conn.hget("rq:job:job-1", "description")) < 100
    job.save()  # a worker's save keeps the payload whole
    assert decode_batch(fetch_job(conn, "job-1").args[0])[1][2].input_ids.tolist() == samples[2].input_ids.tolist()
