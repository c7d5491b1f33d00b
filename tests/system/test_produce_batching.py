"""`harvest produce --batch-samples/--batch-tokens` size the jobs without changing the run."""

from __future__ import annotations

import json

from rq import Queue
from rq.serializers import JSONSerializer

from harvest.state.keys import Keys
from harvest.state.payload import decode_batch
from tests.support.cli import harvest_cli


def test_job_sizes_follow_the_flags(conn, redis_server, tiny_model, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((10, 10, 10, 10, 30))]  # distinct samples
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    res = harvest_cli(
        "produce",
        str(data),
        "--run",
        "b",
        "--redis",
        redis_server.url,
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "out"),
        "--batch-samples",
        "3",
        "--batch-tokens",
        "25",
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    q = Queue(Keys("b").queue_name, connection=conn, serializer=JSONSerializer)
    sizes = [[s.num_tokens for s in decode_batch(job.args[0])[1]] for job in q.get_jobs()]
    assert sizes == [[10, 10], [10, 10], [30]]  # 25 tokens cut the first two jobs; a longer sample goes alone
    stored = json.loads(conn.get(Keys("b").config))
    assert (stored["max_batch_samples"], stored["max_batch_tokens"]) == (32, 16384)  # the run itself is unchanged
