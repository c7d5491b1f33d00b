"""`harvest audit` through the CLI on a run the reference engine extracted wrongly on purpose.

One run of 25 samples (chunked prefill 64, fp32) with three of the engine's audit faults
(engines/faults.py), each hitting one sample: the rows of a chunk shifted by one position, a
capture point taken from the next layer, and a batch-dependent perturbation; then one byte of a
fourth sample's hidden states flipped in its shard. Every sample passes the worker's checks (the
run ends 25 done, 0 failed): the numbers are plausible, only a second computation sees them. The
engine's log says which sample each fault hit and which rows (the injector's own account); each
route must name the same samples, reasons and rows. Then `--requeue-bad` repairs the run: the
four are extracted again (by an engine without faults), committed once, and both routes pass,
the engine route against a given engine whose batch fault is on for good (each sample alone
never meets it).

The two tests that audit the faulty run share the module's run (one xdist worker) and change
nothing in it; the test that repairs a run makes one of its own, so every test stands alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import zlib
from collections import Counter
from dataclasses import dataclass

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import RedisServer, free_port
from harvest.formats.index import INDEX, committed_samples
from harvest.health import wait_healthy
from harvest.ids import parse_rid
from harvest.read.reader import RunReader
from harvest.read.shard_reader import ShardReader
from harvest.storage import Location
from tests.support.cli import REPO, harvest_cli, kill_group

SHARED = pytest.mark.xdist_group("test_audit")  # the tests that read the module's faulty run, on one worker

RUN = "faulty"
FAULTS = "shift-chunk:1,wrong-layer:1,perturb:1"
# One torch thread in every process here (engines, the transformers forward): the suite runs tests
# side by side on two cores, where torch's threads of several processes wait on one another (the
# workers run one thread for the same reason); the forward of the tiny model needs no more.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class Faulty:
    args: list[str]
    loc: Location
    work: str
    before: list[str]  # committed sample ids
    expected: dict[str, str]  # sample id -> its line in the audit's output
    reasons: dict[str, str]  # sample id -> outcome
    rows: dict[str, range]  # sample id -> the rows the fault changed


def _range(a: int, b: int) -> str:
    return f"{a}-{b - 1}" if b - 1 > a else f"{a}"


def _flip_a_byte(loc: Location, reader: RunReader, sid: str) -> tuple[int, int, int, int]:
    """One bit of `sid`'s hidden states flipped in its shard: (begin, end, crc32 found, crc32 recorded)."""
    shard = reader.shard_of(sid)
    doc = loc.read_json(f"{INDEX}/{shard}.json")
    i = doc["samples"].index(sid)
    span = ShardReader(loc, doc).tensors["hidden_states"]
    begin, end = span.begin + doc["offsets"][i] * span.row_bytes, span.begin + doc["offsets"][i + 1] * span.row_bytes
    with open(loc.path(doc["shard"]), "r+b") as f:
        f.seek(begin + 5)
        byte = f.read(1)
        f.seek(begin + 5)
        f.write(bytes([byte[0] ^ 0x04]))
        f.seek(begin)
        found = zlib.crc32(f.read(end - begin))
    return begin, end, found, doc["crc32"][i][doc["crc32_tensors"].index("hidden_states")]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, tiny_model) -> Faulty:
    """The module's faulty run, for the tests that only audit it."""
    return _faulty_run(tmp_path_factory.mktemp("audit"), tiny_model)


@pytest.fixture
def repairable(tmp_path_factory, tiny_model) -> Faulty:
    """A faulty run of the test's own, for a test that repairs it."""
    return _faulty_run(tmp_path_factory.mktemp("audit-repair"), tiny_model)


def _faulty_run(base, tiny_model) -> Faulty:
    """The run of the module's docstring in `base`, with each fault's expected audit line."""
    dataset = write_jsonl(str(base / "d.jsonl"), demo_rows(24))
    out, work = base / "out", base / "work"
    args = [
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        f"file://{out}",
        "--run",
        RUN,
        "--dtype",
        "fp32",
        "--workers",
        "1",
        "--shard-mb",
        "1",
        "--max-wait",
        "1",
        "--chunked-prefill-size",
        "64",
        "--no-progress",
        "--work-dir",
        str(work),
        "--dump-dir",
        str(base / "dumps"),
    ]
    res = harvest_cli(*args, env={"HARVEST_ENGINE_FAULTS": FAULTS, **ONE_THREAD})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "samples: 25 done, 0 failed" in res.stdout  # the worker's checks pass every fault
    log = (work / "logs" / "engine.log").read_text()
    loc = Location.from_url(f"file://{out}/{RUN}")
    reader = RunReader(loc.url())
    tokens = {s: len(reader.tokens(s)[0]) for s in reader.sample_ids}
    expected, reasons, rows = {}, {}, {}

    def head(sid: str, label: str = "FAIL") -> str:
        return f"{label} sample {sid} (shard {reader.shard_of(sid)}, {tokens[sid]} tokens): "

    ((rid, a, b),) = re.findall(r"injected fault shift-chunk: (\S+) rows \[(\d+), (\d+)\)", log)
    sid, a, b = parse_rid(rid)[0], int(a), int(b)
    expected[sid] = (
        head(sid) + f"misaligned: rows {_range(a, b)} hold the states of the position before them (every capture point)"
    )
    reasons[sid], rows[sid] = "misaligned", range(a, b)
    ((rid, point, layer),) = re.findall(
        r"injected fault wrong-layer: (\S+) capture point (\d+) taken from layer (\d+)", log
    )
    sid = parse_rid(rid)[0]
    assert (point, layer) == ("2", "3")  # eagle3 of 8 layers: [2, 4, 5, 8]
    expected[sid] = head(sid) + "wrong-layer: capture point 2 holds layer 3's states"
    reasons[sid], rows[sid] = "wrong-layer", range(tokens[sid])
    hits = re.findall(r"injected fault perturb: (\S+) rows \[(\d+), (\d+)\)", log)  # one line per chunk
    assert len({h[0] for h in hits}) == 1
    sid = parse_rid(hits[0][0])[0]
    a, b = min(int(h[1]) for h in hits), max(int(h[2]) for h in hits)
    expected[sid] = (
        head(sid) + f"drift: {b - a} of {tokens[sid]} rows beyond the bound, rows {_range(a, b)} (every capture point)"
    )
    reasons[sid], rows[sid] = "drift", range(a, b)
    assert len(reasons) == 3
    sid = next(s for s in reader.sample_ids if s not in reasons and tokens[s] > 1)
    begin, end, found, recorded = _flip_a_byte(loc, reader, sid)
    expected[sid] = (
        head(sid, "CORRUPT") + f"corrupt: tensor hidden_states, bytes [{begin}, {end}) of the shard have "
        f"crc32 {found}, its index records {recorded}: corruption at rest, not drift"
    )
    reasons[sid] = "corrupt"
    return Faulty(args, loc, str(work), sorted(reader.sample_ids), expected, reasons, rows)


def _audit(f: Faulty, *args: str):
    with RedisServer(os.path.join(f.work, "redis")) as server:  # the run's private Redis, again
        return harvest_cli(
            "audit", "--run", RUN, "--redis", server.url, "--no-progress", *args, env=ONE_THREAD
        ), server.url


def _committed_bytes(loc: Location) -> str:
    h = hashlib.sha256()
    for folder in (INDEX, "shards"):
        for name in loc.list(folder):
            h.update(name.encode() + loc.read_bytes(f"{folder}/{name}"))
    return h.hexdigest()


def _check_caught(
    f: Faulty,
    res,
    route_line: str,
    verdict: str = "4 of 25 samples not within the bound (1 drift, 1 misaligned, 1 wrong-layer, 1 corrupt)",
) -> None:
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"audit of run {RUN}: 25 of 25 committed samples (seed 3, stratified by length: 1-")
    assert lines[0].endswith(" tokens), fp32, capture points 2, 4, 5, 8")
    assert re.fullmatch(route_line, lines[1]), lines[1]
    assert lines[2] == "stored bytes: 24 of 25 samples match their index's crc32s; 1 corrupt at rest (not recomputed)"
    assert lines[3] == "bound (fp32): relative error per row <= 1.00e-04"
    flagged = [ln for ln in lines if ln.startswith(("FAIL ", "CORRUPT ", "UNCHECKED "))]
    assert sorted(flagged) == sorted(f.expected.values())
    for sid, want in f.rows.items():  # each failing capture point's worst rows lie in the rows the fault changed
        at = lines.index(f.expected[sid]) + 1
        points = []
        while lines[at].startswith("  point "):  # the capture points that failed, under their sample's line
            points.append(lines[at])
            at += 1
        assert len(points) == (1 if f.reasons[sid] == "wrong-layer" else 4), points  # only point 2 is wrong
        for ln in points:
            worst = [int(x) for x in ln.split("worst rows ")[1].split(", ")]
            assert set(worst) <= set(want), (ln, want)
    assert lines[-2] == f"verdict: FAIL: {verdict}"


@SHARED
def test_each_fault_is_caught_against_the_engine_with_its_reason_and_rows(faulty):
    before = _committed_bytes(faulty.loc)
    res, _ = _audit(faulty, "--against", "engine", "--samples", "100", "--seed", "3")
    _check_caught(
        faulty,
        res,
        r"against engine: reference engine at http://127\.0\.0\.1:\d+ \(started by the audit\), "
        r"chunked prefill 61, each sample alone with a fresh rid",
    )
    assert _committed_bytes(faulty.loc) == before  # an audit changes no committed byte
    record = re.fullmatch(r"recorded: (.*/audits/\d{8}T\d{6}Z-3\.json)", res.stdout.splitlines()[-1])
    assert record, res.stdout
    doc = json.loads(open(record.group(1)).read())
    assert (doc["verdict"], doc["route"], doc["samples"], doc["outcomes"]) == (
        "fail",
        "engine",
        25,
        {"ok": 21, "drift": 1, "misaligned": 1, "wrong-layer": 1, "corrupt": 1},
    )
    assert {r["sample"]: r["outcome"] for r in doc["results"] if r["outcome"] != "ok"} == faulty.reasons
    latest = faulty.loc.read_json("audits/latest.json")
    assert latest["record"] == "audits/" + os.path.basename(record.group(1)) and latest["verdict"] == "fail"


@SHARED
def test_each_fault_is_caught_against_transformers_with_its_reason_and_rows(faulty):
    res, _ = _audit(faulty, "--against", "hf", "--samples", "100", "--seed", "3")
    _check_caught(faulty, res, r"against hf: transformers \S+ forward of \S+ on cpu in float32, each sample whole")


@contextlib.contextmanager
def _engine(model: str, dumps: str, faults: str):
    """A reference engine of the run's kind, capture points and chunk, with test faults on for good."""
    port = free_port()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harvest.cli",
            "engine",
            "--model",
            model,
            "--dump-dir",
            dumps,
            "--port",
            str(port),
            "--layers",
            "2,4,5,8",
            "--chunked-prefill-size",
            "64",
        ],
        cwd=REPO,
        env={**os.environ, "HARVEST_ENGINE_FAULTS": faults, **ONE_THREAD},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", 120), "the reference engine did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_group(p)
        p.wait()


def test_requeue_bad_extracts_them_again_once_and_both_routes_then_pass(repairable, tiny_model, tmp_path):
    res, _ = _audit(repairable, "--against", "hf", "--samples", "100", "--seed", "3", "--requeue-bad")
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert re.fullmatch(
        r"requeue-bad: excluded 4 samples from \d index files; marked 0 samples done from storage; "
        r"4 done in the ledger but committed by no index went back to the queue",
        lines[-2],
    ), lines[-2]
    assert len(RunReader(repairable.loc.url())) == 21  # excluded: no reader reads the wrong copies any more
    res = harvest_cli(
        *repairable.args, env=ONE_THREAD
    )  # the run again, its engine without faults: the four extracted anew
    assert res.returncode == 0, res.stdout + res.stderr
    assert "samples: 25 done, 0 failed (0 enqueued now, 25 already known)" in res.stdout
    reader = RunReader(repairable.loc.url())
    assert sorted(reader.sample_ids) == repairable.before and reader.duplicates == {}
    copies = Counter(
        s
        for n in repairable.loc.list(INDEX, ".json")
        for s in committed_samples(repairable.loc.read_json(f"{INDEX}/{n}"))
    )
    assert set(copies.values()) == {1} and sorted(copies) == repairable.before  # each committed once
    for sid in repairable.reasons:
        reader.get(sid)  # read back whole and checked
    # Clean by both routes. The engine route against a given engine (URL and dump dir) whose batch
    # fault is on for good: sent alone, no sample meets it.
    dumps = tmp_path / "dumps"
    with _engine(tiny_model, str(dumps), "perturb") as url:
        engine, _ = _audit(
            repairable, "--engine-url", url, "--dump-dir", str(dumps), "--samples", "100", "--seed", "11"
        )
    hf, _ = _audit(repairable, "--against", "hf", "--samples", "100", "--seed", "11")
    for res in (engine, hf):
        assert res.returncode == 0, res.stdout + res.stderr
        lines = res.stdout.splitlines()
        assert lines[2] == "stored bytes: 25 of 25 samples match their index's crc32s"
        assert not [ln for ln in lines if ln.startswith(("FAIL ", "CORRUPT ", "UNCHECKED "))]
        assert lines[-2] == "verdict: pass: 25 of 25 samples within the bound"
    assert re.fullmatch(
        rf"against engine: reference engine at {re.escape(url)} \(given\), chunked prefill 64, each "
        r"sample alone with a fresh rid",
        engine.stdout.splitlines()[1],
    )
    assert [f for f in os.listdir(dumps) if not f.startswith(".")] == []  # every dump the audit caused, claimed
    with RedisServer(os.path.join(repairable.work, "redis")) as server:
        status = harvest_cli("status", "--run", RUN, "--redis", server.url)
        import redis

        from harvest.ops.metrics import RedisCollector

        fams = {m.name: m for m in RedisCollector(redis.Redis.from_url(server.url), [RUN]).collect()}
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("  audit    "))
    assert re.fullmatch(
        r"  audit    pass \S+ \S+, against hf, 25 samples \(seed 11\), worst relative error \S+ "
        r"\(bound 1.00e-04\)",
        line,
    ), line
    assert [(s.labels, s.value) for s in fams["harvest_audit_samples"].samples] == [({"run": RUN, "outcome": "ok"}, 25)]
    (stamp,) = fams["harvest_audit_timestamp_seconds"].samples
    assert stamp.labels == {"run": RUN, "route": "hf", "verdict": "pass"} and stamp.value > 0
