"""Exactly once whatever Redis forgets, through the CLI and real processes: two
runners with two private Redis servers on one output, an index file lost after the run, and
Redis's AOF cut back by one and two seconds right after a commit."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.formats.index import INDEX, committed_samples
from harvest.read.reader import RunReader
from harvest.storage import Location
from tests.support.chaos import Trial
from tests.support.cli import REPO, harvest_cli, kill_group


def _copies(out: str) -> Counter:
    """How many committed index files name each sample, counted from the files themselves (a
    reader would hide a duplicate)."""
    loc = Location.from_url(out)
    return Counter(s for n in loc.list(INDEX, ".json") for s in committed_samples(loc.read_json(f"{INDEX}/{n}")))


def _run_args(dataset, model, out, tmp_path, name):
    return [
        "run",
        dataset,
        "--model",
        model,
        "--out",
        f"file://{out}",
        "--run",
        "twice",
        "--dtype",
        "fp32",
        "--workers",
        "1",
        "--shard-mb",
        "1",
        "--max-wait",
        "1",
        "--no-progress",
        "--work-dir",
        str(tmp_path / f"work-{name}"),
        "--dump-dir",
        str(tmp_path / f"dumps-{name}"),
    ]


def _finished_run(tmp_path, tiny_model) -> tuple[list[str], Location, Counter]:
    """A run of 24 rows committed by `harvest run`: its arguments, its folder, its committed copies."""
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(24))
    args = _run_args(dataset, tiny_model, tmp_path / "out", tmp_path, "a")
    res = harvest_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    loc = Location.from_url(f"file://{tmp_path / 'out'}/twice")
    return args, loc, _copies(loc.url())


def test_two_runners_with_two_private_redis_commit_each_sample_once(tmp_path, tiny_model):
    # Both started at once on the same dataset and output, each with a private Redis (two ledgers
    # that never talk): each extracts every sample, and the claims in storage decide who commits.
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(60))
    out = tmp_path / "out"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "harvest.cli", *_run_args(dataset, tiny_model, out, tmp_path, n)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for n in "ab"
    ]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            kill_group(p)  # the run and whatever it started
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    copies = _copies(f"file://{out}/twice")
    assert copies and set(copies.values()) == {1}, [s for s, n in copies.items() if n > 1]
    reader = RunReader(f"file://{out}/twice")
    assert sorted(reader.sample_ids) == sorted(copies)
    collectors = "".join(open(tmp_path / f"work-{n}" / "logs" / "collector.log").read() for n in "ab")
    # the race happened: one runner found samples the other had committed or was committing
    assert "are committed already" in collectors or "being committed by another collector" in collectors, collectors


def test_a_lost_index_file_goes_back_to_the_queue_and_is_committed_once(tmp_path, tiny_model):
    args, loc, before = _finished_run(tmp_path, tiny_model)
    names = loc.list(INDEX, ".json")
    assert len(names) >= 2
    lost = committed_samples(loc.read_json(f"{INDEX}/{names[0]}"))
    loc.delete(f"{INDEX}/{names[0]}")
    res = harvest_cli(*args)  # the same run again: the ledger says done, storage does not
    assert res.returncode == 0, res.stdout + res.stderr
    after = _copies(loc.url())
    assert after == before and set(after.values()) == {1}
    assert set(RunReader(loc.url()).sample_ids) == set(before)
    assert set(lost) <= set(after)  # extracted and committed again, once


@pytest.mark.parametrize("lag", [1.0, 2.0])
def test_aof_cut_back_right_after_a_commit_finishes_by_itself_with_every_sample_once(tiny_model, tmp_path, lag):
    # The parts as separate processes, 40 rows in jobs of the producer's size; right after the
    # first index file appears, Redis is SIGKILLed and its AOF cut back to its size `lag` s
    # earlier (what `appendfsync everysec` may lose), then restarted. Nothing else is restarted.
    # The rollback may forget the enqueue of a job a worker already holds: the worker spools those
    # samples anyway (Ledger.mark_spooled takes absent ones), or they would sit on the spool for good.
    result = Trial(
        str(tmp_path),
        tiny_model,
        51 + int(lag),
        samples=40,
        kills=1,
        kinds=("rollback",),
        on_commit=True,
        rollback_lags=(lag,),
        deadline_s=300,
    ).execute()
    assert result.ok, result.summary() + "\n" + "\n".join(result.timeline)
    assert result.kills == {"rollback": 1} and result.done == 40 and result.failed == 0, result.summary()
    assert result.restarts_on_exit == {}, result.summary()  # the run finished by itself: nothing had to be restarted


def test_reconcile_dedupes_a_seeded_duplicate_and_sends_a_corrupt_sample_back_for_extraction(tmp_path, tiny_model):
    from harvest.cli.redisproc import RedisServer
    from harvest.formats.index import encode_index
    from harvest.read.shard_reader import CorruptSample, ShardReader

    args, loc, before = _finished_run(tmp_path, tiny_model)
    first, second = loc.list(INDEX, ".json")[:2]
    # a duplicate, as two fleets would leave it: shard `first` stored again under another id
    doc = loc.read_json(f"{INDEX}/{first}")
    dup_id = "f" * 32
    loc.write_atomic(f"shards/{dup_id}.safetensors", loc.read_bytes(doc["shard"]))
    loc.write_atomic(
        f"{INDEX}/{dup_id}.json", encode_index({**doc, "shard_id": dup_id, "shard": f"shards/{dup_id}.safetensors"})
    )
    reader = RunReader(loc.url())
    assert sorted(reader.sample_ids) == sorted(before) and set(reader.duplicates) == set(doc["samples"])
    # a flipped byte in one sample's hidden states
    bad_doc = loc.read_json(f"{INDEX}/{second}")
    bad = bad_doc["samples"][0]
    span = ShardReader(loc, bad_doc).tensors["hidden_states"]
    path = loc.path(bad_doc["shard"])
    with open(path, "r+b") as f:
        f.seek(span.begin + 3)
        byte = f.read(1)
        f.seek(span.begin + 3)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptSample, match=f"sample {bad} is corrupt"):
        RunReader(loc.url()).get(bad)

    with RedisServer(str(tmp_path / "work-a" / "redis")) as server:  # the finished run's private Redis, again
        res = harvest_cli("reconcile", "--run", "twice", "--redis", server.url, "--dedupe", "--verify", "--no-progress")
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert (
            lines[0]
            == f"deduplicated {len(doc['samples'])} samples committed by more than one shard (1 index files rewritten)"
        )
        assert lines[1].startswith("verified ") and lines[1].endswith(": 1 corrupt, excluded from 1 index files")
        assert lines[2].startswith(f"  sample {bad} of shard {bad_doc['shard_id']}: corrupt: tensor hidden_states")
        assert (
            lines[3] == "marked 0 samples done from storage; 1 done in the ledger but committed by no index went "
            "back to the queue"
        )
        res = harvest_cli("reconcile", "--run", "twice", "--redis", server.url, "--dedupe", "--no-progress")
        assert (
            res.stdout.splitlines()[0]
            == "deduplicated 0 samples committed by more than one shard (0 index files rewritten)"
        )
        kept = min(doc["shard_id"], dup_id)  # every claim names the copy readers read
        assert {json.loads(loc.read_bytes(f"claims/{s}.json"))["shard"] for s in doc["samples"]} == {kept}
    res = harvest_cli(*args)  # the run again: it extracts the corrupt sample anew
    assert res.returncode == 0, res.stdout + res.stderr
    reader = RunReader(loc.url())
    assert reader.duplicates == {} and sorted(reader.sample_ids) == sorted(before)
    assert reader.shard_of(bad) != bad_doc["shard_id"]
    reader.get(bad)  # read back whole and checked
    assert set(_copies(loc.url()).values()) == {1}
