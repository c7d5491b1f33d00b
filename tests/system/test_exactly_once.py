"""Exactly once whatever Redis forgets (issue 24), through the CLI and real processes: two
runners with two private Redis servers on one output, an index file lost after the run, and
Redis's AOF cut back by one and two seconds right after a commit."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.formats.index import INDEX
from harvest.ops.reconcile import committed_samples
from harvest.read.reader import RunReader
from harvest.storage import Location
from tests.support.chaos import Trial
from tests.support.cli import REPO, harvest_cli


def _copies(out: str) -> Counter:
    """How many committed index files name each sample, counted from the files themselves (a
    reader would hide a duplicate)."""
    loc = Location.from_url(out)
    return Counter(s for n in loc.list(INDEX, ".json") for s in committed_samples(loc.read_json(f"{INDEX}/{n}")))


def _run_args(dataset, model, out, tmp_path, name):
    return ["run", dataset, "--model", model, "--out", f"file://{out}", "--run", "twice", "--dtype", "fp32",
            "--workers", "1", "--shard-mb", "1", "--max-wait", "1", "--no-progress",
            "--work-dir", str(tmp_path / f"work-{name}"), "--dump-dir", str(tmp_path / f"dumps-{name}")]


def test_two_runners_with_two_private_redis_commit_each_sample_once(tmp_path, tiny_model):
    # Both started at once on the same dataset and output, each with a private Redis (two ledgers
    # that never talk): each extracts every sample, and the claims in storage decide who commits.
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(60))
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "harvest.cli", *_run_args(dataset, tiny_model, out, tmp_path, n)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in "ab"]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    copies = _copies(f"file://{out}/twice")
    assert copies and set(copies.values()) == {1}, [s for s, n in copies.items() if n > 1]
    reader = RunReader(f"file://{out}/twice")
    assert sorted(reader.sample_ids) == sorted(copies)
    collectors = "".join(open(tmp_path / f"work-{n}" / "logs" / "collector.log").read() for n in "ab")
    # the race happened: one runner found samples the other had committed or was committing
    assert "are committed already" in collectors or "being committed by another collector" in collectors, collectors


def test_a_lost_index_file_goes_back_to_the_queue_and_is_committed_once(tmp_path, tiny_model):
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(24))
    out = tmp_path / "out"
    args = _run_args(dataset, tiny_model, out, tmp_path, "a")
    res = harvest_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    loc = Location.from_url(f"file://{out}/twice")
    before = _copies(loc.url())
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
    result = Trial(str(tmp_path), tiny_model, 51 + int(lag), samples=40, kills=1, kinds=("rollback",),
                   on_commit=True, rollback_lags=(lag,), deadline_s=180).execute()
    assert result.ok, result.summary() + "\n" + "\n".join(result.timeline)
    assert result.kills == {"rollback": 1} and result.done == 40 and result.failed == 0, result.summary()
    assert result.restarts_on_exit == {}, result.summary()  # the run finished by itself: nothing had to be restarted
