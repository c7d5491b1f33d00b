"""Producer: row kinds, bad rows with file and line, idempotent and bounded enqueue on real Redis."""

import json
import zlib

import numpy as np
from rq import Queue
from rq.serializers import JSONSerializer

from harvest.config import RunConfig
from harvest.ids import sample_id
from harvest.producer.producer import produce
from harvest.producer.rows import BadRow, Row
from harvest.producer.tokenize import RowTokenizer
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.payload import PAYLOAD_VERSION, decode_batch
from tests.support.wait import wait_for


def _cfg(tiny_model, tmp_path, **kw):
    return RunConfig(run="p", model=tiny_model, capture_points=[2, 4], hidden_size=64, out_url=str(tmp_path), **kw)


def test_row_kinds(tokenizer):
    t = RowTokenizer(tokenizer)
    s = t.one(Row({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, "f:1"))
    assert s.input_ids.tolist() == [5, 6, 7] and s.loss_mask.tolist() == [0, 1, 1]
    assert s.id == sample_id(np.array([5, 6, 7]), np.array([0, 1, 1]))
    s = t.one(Row({"text": "the model"}, "f:2"))
    assert s.input_ids.tolist() == tokenizer("the model")["input_ids"] and s.loss_mask.all()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the data"}]
    s = t.one(Row({"messages": msgs}, "f:3"))
    enc = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert s.input_ids.tolist() == enc["input_ids"] and s.loss_mask.tolist() == enc["assistant_masks"]
    # the mask is the assistant content and its end-of-turn token, not the header
    masked = tokenizer.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=False) if m])
    assert masked == "the data<|im_end|>"


def test_bad_rows_name_file_and_line(tokenizer):
    t = RowTokenizer(tokenizer)
    cases = [
        ({"input_ids": [1, 99999]}, "f:1: token id 99999 ('input_ids'[1]) outside the vocabulary [0, 512)"),
        ({"input_ids": "1 2"}, "f:1: 'input_ids' must be a list of integers (token ids), got str"),
        (
            {"foo": 1},
            "f:1: no usable field: expected one of input_ids, messages, conversations, prompt, text; got ['foo']",
        ),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "f:1: 'messages'[0] has role 'robot'; expected one of system, user, assistant, tool",
        ),
        ({"text": ""}, "f:1: empty sample (0 tokens)"),
        ([1, 2], "f:1: row is a list, expected an object"),
    ]
    for data, msg in cases:
        r = t.one(Row(data, "f:1"))
        assert isinstance(r, BadRow) and str(r) == msg, str(r)


def test_produce_reports_bad_rows_and_enqueues_the_rest_once(conn, tiny_model, tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"text": "the model reads"}\n'
        b"{broken\n"
        b"\n"
        b'{"text": "\xff\xfe"}\n'
        b'{"input_ids": [5, 6, 7]}\n'
        b'{"input_ids": [5, 6, 7]}\n'
    )
    cfg = _cfg(tiny_model, tmp_path, max_batch_samples=1)
    s = produce(conn, cfg, str(path), tokenizer=tokenizer, progress=False)
    assert (s.rows, s.enqueued, s.skipped, s.bad, s.jobs) == (5, 2, 1, 2, 2)
    assert s.bad_rows[0] == f"{path}:2: invalid JSON (Expecting property name enclosed in double quotes at column 2)"
    assert s.bad_rows[1].startswith(f"{path}:4: not UTF-8")
    q = Queue(Keys("p").queue_name, connection=conn, serializer=JSONSerializer)
    assert q.count == 2
    # Job data is JSON (no pickle) and decodes to the samples.
    job = q.jobs[0]
    raw = zlib.decompress(conn.hget(job.key, "data"))  # RQ compresses job data
    assert json.loads(raw)[2][0]["v"] == PAYLOAD_VERSION  # JSON: [func, instance, args, kwargs]
    assert decode_batch(job.args[0])[0] == "p"
    s2 = produce(conn, cfg, str(path), tokenizer=tokenizer, progress=False)
    assert (s2.enqueued, s2.skipped, s2.jobs) == (0, 3, 0)
    assert q.count == 2
    assert Ledger(conn, "p").counts()["queued"] == 2


def test_enqueue_waits_while_queue_is_full(conn, tiny_model, tokenizer, tmp_path):
    import threading
    import time

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [5, i + 6]}) + "\n" for i in range(10)))
    cfg = _cfg(tiny_model, tmp_path, max_batch_samples=2)
    led = Ledger(conn, "p")
    peak = []
    done = threading.Event()

    def drain():  # a stand-in worker: marks queued samples done, slowly
        q = Queue(Keys("p").queue_name, connection=conn, serializer=JSONSerializer)
        while not done.is_set():
            peak.append(led.counts()["queued"])
            job = q.dequeue_any([q], None, connection=conn, serializer=JSONSerializer) if q.count else None
            if job:
                _, samples = decode_batch(job[0].args[0])
                time.sleep(0.05)
                led.mark_done([x.id for x in samples])
            time.sleep(0.01)

    th = threading.Thread(target=drain)
    th.start()
    s = produce(conn, cfg, str(path), tokenizer=tokenizer, progress=False, max_queued=4)
    wait_for(lambda: led.counts()["done"] == 10 or not th.is_alive(), 30, "the stand-in worker draining the queue")
    done.set()
    th.join()
    assert s.enqueued == 10
    assert max(peak) <= 4
    assert led.counts()["done"] == 10


def test_prefetch_keeps_order_raises_errors_and_stops_early():
    import threading

    from harvest.producer.prefetch import prefetch

    assert list(prefetch(iter(range(100)), depth=3)) == list(range(100))

    def broken():
        yield 1
        raise KeyError("boom")

    it = prefetch(broken())
    assert next(it) == 1
    try:
        next(it)
        raise AssertionError("expected KeyError")
    except KeyError as e:
        assert e.args == ("boom",)
    endless = prefetch(iter(range(10**9)), depth=2)
    assert next(endless) == 0
    endless.close()  # the consumer stops early (e.g. --strict): the thread ends too
    for th in threading.enumerate():
        if th.name == "harvest-prefetch":
            th.join(5)
            assert not th.is_alive()


def test_strict_stops_at_first_bad_row(conn, tiny_model, tokenizer, tmp_path):
    import pytest

    from harvest.producer.rowkinds import RowError

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "the model"}\n{"foo": 1}\n{"text": "the data"}\n')
    with pytest.raises(RowError) as e:
        produce(conn, _cfg(tiny_model, tmp_path), str(path), tokenizer=tokenizer, progress=False, strict=True)
    assert str(e.value) == (
        f"bad row (--strict): {path}:2: no usable field: expected one of input_ids, messages, conversations, prompt, text; "
        "got ['foo']"
    )
    assert Ledger(conn, "p").counts()["queued"] == 0  # nothing of the batch was enqueued before the stop


def test_worker_processes_give_the_same_samples_in_the_same_order(conn, tiny_model, tokenizer, tmp_path):
    from harvest.cli.demo import demo_rows, write_jsonl
    from harvest.producer import producer as producer_mod

    rows = demo_rows(600) + [{"foo": 1}, {"text": ""}]
    path = write_jsonl(str(tmp_path / "d.jsonl"), rows)
    seen = {1: [], 2: []}
    for procs in (1, 2):
        conn.flushall()
        s = produce(
            conn,
            _cfg(tiny_model, tmp_path),
            path,
            tokenizer=tokenizer,
            progress=False,
            processes=procs,
            on_bad=lambda r, p=procs: seen[p].append(str(r)),
        )
        q = Queue(Keys("p").queue_name, connection=conn, serializer=JSONSerializer)
        ids = [x.id for job in q.jobs for x in decode_batch(job.args[0])[1]]
        seen[procs].append((s.text(), ids))
    assert seen[1] == seen[2]
    assert len(rows) > producer_mod.BATCH_ROWS  # several batches crossed the processes


def test_a_sample_failed_with_its_tokens_lost_is_enqueued_again_by_the_producer(conn, tiny_model, tokenizer, tmp_path):
    from harvest.state.failures import JOB_LOST, WORKER_DIED

    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [5, 6, 7]}\n{"input_ids": [8, 9]}\n')
    cfg = _cfg(tiny_model, tmp_path, max_batch_samples=1)
    produce(conn, cfg, str(path), tokenizer=tokenizer, progress=False)
    ledger = Ledger(conn, "p")
    q = Queue(Keys("p").queue_name, connection=conn, serializer=JSONSerializer)
    lost, died = [decode_batch(j.args[0])[1][0].id for j in q.jobs]
    q.empty()
    ledger.mark_failed({lost: (JOB_LOST, "kept nowhere"), died: (WORKER_DIED, "crashed it")})
    s = produce(conn, cfg, str(path), tokenizer=tokenizer, progress=False)
    assert (s.enqueued, s.skipped) == (1, 1)  # the sample that crashed workers stays failed: requeue decides
    assert ledger.states([lost, died]) == ["q", "f"] and list(ledger.failures()) == [died]
    assert [decode_batch(j.args[0])[1][0].id for j in q.jobs] == [lost]
