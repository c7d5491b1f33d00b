"""A collector frozen (SIGSTOP) at each commit step past its spool grace, its samples reclaimed and
committed by another collector, then resumed (SIGCONT) before the other's fence or after its
commit: every sample ends committed exactly once, readable, its claim naming the shard that
commits it, no shard without index, the ledger done (tests/support/freeze.py)."""

import pytest

from harvest.collector.faults import CRASH_POINTS
from tests.support.freeze import FreezeTrial
from tests.support.freeze_soak import soak

DECIDED = ("fenced", "indexed", "marked", "unlinking")  # the frozen collector's commit was decided


def _out(kind, tmp_path, request):
    if kind == "file":
        return f"file://{tmp_path / 'out'}"
    return f"{request.getfixturevalue('s3_bucket')}/out"


# On S3, one order each for the steps whose storage differs from a local output's (S3 trials take
# seconds; the soak, `python -m tests.support.freeze_soak`, draws the rest): before any upload, an
# upload with every part stored (aborted by the tend pass while the node is frozen; its resume waits
# out the store client's own retries), the shard visible (the interleaving that lost a shard when
# names were shared), the fence passed.
ORDERS = ("before-fence", "after-commit")
CASES = [(p, "file", o) for p in CRASH_POINTS for o in ORDERS] + [
    ("claimed", "s3", "after-commit"),
    ("packed", "s3", "before-fence"),
    ("uploaded", "s3", "before-fence"),
    ("fenced", "s3", "after-commit"),
]


@pytest.mark.parametrize(("point", "kind", "order"), CASES)
def test_a_frozen_collector_that_resumes_loses_nothing(conn, redis_server, tmp_path, request, kind, order, point):
    t = FreezeTrial(conn, redis_server.url, str(tmp_path), _out(kind, tmp_path, request), [20, 15, 10, 5, 8])
    t.execute(point, order)
    assert t.froze
    assert t.problems() == {k: [] for k in t.problems()}
    if point in ("marked", "unlinking"):  # the record went with the move to done: nothing of A's is left to void
        assert t.frozen_record is None
        return
    _, indexed, there = t.frozen_shard_fate()
    assert t.frozen_record["sample_ids"] == t.order[:3]
    # a decided shard is finished (by the tend pass or by A), never voided; any other is gone whole
    assert (indexed, there) == ((True, True) if point in DECIDED else (False, False))


def test_freeze_soak_a_few_trials(conn, redis_server, tmp_path, request):
    """Random points, occurrences, orders, tend passes, local and S3 alternately (the soak's own
    100-trial run: `python -m tests.support.freeze_soak --trials 100`)."""
    s3 = request.getfixturevalue("s3_bucket")
    totals = soak(conn, redis_server.url, str(tmp_path), trials=2, seed=7, s3_url=s3)
    assert totals["trials"] == 2 and totals["froze"] >= 1, totals
    assert {k: totals[k] for k in ("lost", "doubled", "unreadable", "wrong", "other")} == {
        "lost": 0,
        "doubled": 0,
        "unreadable": 0,
        "wrong": 0,
        "other": 0,
    }, totals
