"""Fault injection with exact accounting (tests/support/chaos.py): real processes SIGKILLed at random
moments, then every input sample must be in exactly one committed shard or failed with a
reason, with nothing left behind. Fixed seeds; bench/chaos.py runs the long version."""

from __future__ import annotations

import pytest

from tests.support.chaos import Trial

# The kills these fixed-seed trials draw from: every kind but `rollback`, which bench/chaos.py's
# soak and tests/system/test_exactly_once.py exercise (with a rollback among them these seeds'
# timing-dependent paths are not yet steady enough for CI: see test_exactly_once).
KILLS = ("worker", "engine", "collector", "producer", "redis")


@pytest.mark.parametrize("seed", [11])  # bench/chaos.py runs the many-trial version
def test_kills_lose_and_double_nothing_file_output(tiny_model, tmp_path, seed):
    result = Trial(str(tmp_path), tiny_model, seed, samples=50, kills=5, kinds=KILLS).execute()
    assert result.ok, result.summary()
    assert result.done + result.failed == 50  # the 5 duplicated rows are the same samples, stored once
    assert sum(result.kills.values()) == 5


def test_kills_with_engine_faults_on_s3(tiny_model, tmp_path, s3_bucket):
    # Every kind of engine fault at once, a few times each: each hit sample must end failed
    # with the fault's reason or (transient ones) done after a retry; never lost or doubled.
    env = {"HARVEST_ENGINE_FAULTS": "http500:2,nan:1,bad-ids:1,cached:1,drop-chunk:1"}
    result = Trial(
        str(tmp_path), tiny_model, 21, samples=50, kills=4, out_url=s3_bucket, env=env, kinds=KILLS
    ).execute()
    assert result.ok, result.summary()
    assert set(result.failure_reasons) <= {"nonfinite", "token-mismatch", "prefix-cached", "incomplete-dump"}
    assert result.failed >= 1, result.summary()  # the permanent faults hit at least one sample


def test_node_faults_lose_and_double_nothing(tiny_model, tmp_path):
    # Three nodes sharing Redis and the output: one lost node back within the spool grace, one back
    # after its spool was reclaimed (its disk with it), one never back.
    result = Trial(
        str(tmp_path),
        tiny_model,
        31,
        samples=40,
        kills=3,
        workers=1,
        nodes=3,
        kinds=("node",),
        returns=("within", "after", "never"),
    ).execute()
    assert result.ok, result.summary()
    assert result.node_returns == {"within": 1, "after": 1, "never": 1}, result.summary()
    assert result.spools_revoked >= 1, result.summary()  # the late one, at least (the lost one if it was seen silent)
    assert result.done + result.failed == 40


def test_every_kind_of_kill_on_two_nodes_to_s3(tiny_model, tmp_path, s3_bucket):
    result = Trial(
        str(tmp_path),
        tiny_model,
        41,
        samples=40,
        kills=5,
        workers=1,
        nodes=2,
        out_url=s3_bucket,
        kinds=(*KILLS, "node"),
    ).execute()
    assert result.ok, result.summary()
    assert result.done + result.failed == 40


def test_frozen_nodes_lose_and_double_nothing(tiny_model, tmp_path):
    # A node frozen (SIGSTOP, every process of it) at a random commit step of its collector, resumed
    # within the spool grace or past it (its spool reclaimed and its samples committed elsewhere).
    result = Trial(
        str(tmp_path), tiny_model, 51, samples=60, kills=3, workers=1, nodes=2, kinds=("freeze",), on_commit=True
    ).execute()
    assert result.ok, (result.summary(), result.timeline)
    assert result.kills["freeze"] == 3 and any(" frozen, resumes at " in t for t in result.timeline), result.timeline
    assert result.done + result.failed == 60
