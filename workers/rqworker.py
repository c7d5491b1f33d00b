"""The RQ worker class harvest runs: RQ's SimpleWorker, with liveness decided by Redis's clock.

STUB: being written (issue 24: a node whose clock is skewed must not fail or strand another
node's job).
"""

from __future__ import annotations

from rq import SimpleWorker


class HarvestWorker(SimpleWorker):
    pass
