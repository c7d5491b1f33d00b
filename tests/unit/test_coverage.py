"""A run's ledger against its dataset (harvest.ops.coverage) on a real Redis: the dataset's samples
by state, those in none (a Redis that came back without them), the run's samples the dataset no
longer holds, `--prune`'s drop of the queued ones, `status --check`'s line, and what the run's
summary says and exits with (harvest.cli.summary)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from harvest.cli.summary import RunSummary
from harvest.formats.datasetids import MANIFEST, SampleIds, read_manifest, write_manifest
from harvest.formats.runfile import run_location
from harvest.ids import sample_id
from harvest.ops.coverage import coverage, dataset_check, prune_queued
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.synth import make_config


def _ids(n: int, base: int = 0) -> list[str]:
    return [sample_id(np.arange(base + i, base + i + 3), np.ones(3, np.uint8)) for i in range(n)]


def _set(ids: list[str]) -> SampleIds:
    s = SampleIds()
    for i in ids + ids[:2]:  # repeats count once
        s.add(i)
    return s.freeze()


def test_sample_ids_hold_each_id_once_and_survive_their_file(tmp_path):
    ids = _ids(50) + ["00" * 16, "00" * 15 + "01", "01" + "00" * 15]  # zero bytes where a bytes type would pad
    s = _set(ids)
    assert len(s) == 53
    assert s.contains(ids).tolist() == [True] * 53
    assert s.contains(_ids(3, base=1000) + ["not-hex", "00" * 15]).tolist() == [False] * 5
    loc = run_location(str(tmp_path / "out"), "r")
    assert read_manifest(loc) is None
    write_manifest(loc, s)
    assert (tmp_path / "out" / "r" / MANIFEST).stat().st_size == 53 * 16
    again = read_manifest(loc)
    assert len(again) == 53 and again.contains(ids).all()


def _ledger(conn, tmp_path):
    cfg = publish_run(conn, make_config(str(tmp_path / "out")))
    return cfg, Ledger(conn, cfg.run)


def test_the_dataset_by_state_and_the_run_beyond_it(conn, tmp_path):
    cfg, led = _ledger(conn, tmp_path)
    data, old = _ids(10), _ids(4, base=100)  # `old`: rows since edited away
    led.add_queued(data[:7] + old)
    led.mark_spooled([data[0], old[0]], owner="sp")
    led.mark_done([data[1], data[2], old[1]])
    led.mark_failed({data[3]: ("nonfinite", "NaN")})
    cov = coverage(conn, cfg.run, _set(data))
    assert cov.total == 10
    assert cov.by_state == Counter({"queued": 3, "spooled": 1, "done": 2, "failed": 1, "absent": 3})
    assert cov.stray == Counter({"queued": 2, "spooled": 1, "done": 1})
    assert cov.missing == 7
    assert cov.missing_line() == (
        "7 of 10 samples are neither committed nor failed (3 queued, 1 spooled, 3 in no "
        "state (a Redis that came back without them))"
    )
    assert cov.stray_line() == (
        "1 committed (kept: harvest deletes no committed sample; a run that must hold exactly "
        "this dataset is a new --run); 3 queued or spooled, extracted too (--prune drops the "
        "queued ones)"
    )


def test_prune_drops_only_the_queued_samples_the_dataset_no_longer_holds(conn, tmp_path):
    cfg, led = _ledger(conn, tmp_path)
    data, old = _ids(5), _ids(4, base=100)
    led.add_queued(data + old)
    led.mark_done([old[0]])
    led.mark_spooled([old[1]], owner="sp")
    assert prune_queued(conn, cfg.run, _set(data)) == 2
    assert led.states(data + old) == ["q"] * 5 + ["d", "s", None, None]
    assert led.counts() == {"queued": 5, "spooled": 1, "done": 1, "failed": 0, "total": 7}
    cov = coverage(conn, cfg.run, _set(data))
    assert cov.stray_line(pruned=2) == (
        "1 committed (kept: harvest deletes no committed sample; a run that must hold "
        "exactly this dataset is a new --run); 2 queued, dropped (--prune); 1 queued "
        "or spooled, extracted too (--prune drops the queued ones)"
    )


def test_status_check_names_the_samples_a_redis_forgot(conn, tmp_path):
    cfg, led = _ledger(conn, tmp_path)
    data = _ids(6)
    assert dataset_check(conn, cfg) == []  # no `harvest run` kept the dataset's ids
    write_manifest(run_location(cfg.out_url, cfg.run), _set(data))
    led.add_queued(data[:4])
    led.mark_done(data[:2])
    assert dataset_check(conn, cfg) == [
        "dataset of run r: 2 of 6 samples are in no state (neither queued, spooled, committed nor failed: a Redis "
        "that came back without them); run the same `harvest run` command again: its producer pass enqueues them"
    ]
    led.add_queued(data[4:])
    assert dataset_check(conn, cfg) == []  # queued: a run in progress


def _summary(**kw) -> RunSummary:
    base = dict(
        run="r",
        out="/o",
        enqueued=40,
        skipped=0,
        bad_rows=0,
        done=16,
        failed=0,
        tokens=1,
        bytes=2,
        seconds=1.0,
        where="--redis redis://h:1/0",
    )
    return RunSummary(**{**base, **kw})


def test_a_summary_with_samples_missing_exits_75_naming_them_and_the_fix():
    s = _summary(
        missing="24 of 40 samples are neither committed nor failed (24 in no state (a Redis that came back "
        "without them))",
        again=10,
    )
    assert s.exit_status == 75
    lines = s.lines()
    assert (
        "  enqueued again: 10 samples of the dataset that Redis had lost (a producer pass after the extraction)"
        in lines
    )
    assert lines[-1] == (
        "  unfinished: 24 of 40 samples are neither committed nor failed (24 in no state (a Redis "
        "that came back without them)): run the same `harvest run` command again to finish them"
    )
    assert _summary(failed=2).exit_status == 1 and _summary().exit_status == 0
    assert json.dumps(_summary(stray="1 committed").lines()).count("not in the dataset: 1 committed") == 1
