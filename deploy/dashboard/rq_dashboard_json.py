"""rq-dashboard for a harvest Redis: rq-dashboard's own CLI (same options and RQ_DASHBOARD_* variables),
with its workers read through the serializer it is told to use.

rq-dashboard 0.9.0 lists workers with `Worker.all(connection=...)`, leaving out the serializer it
uses everywhere else, so a busy worker's current job is read with pickle. Harvest's jobs are JSON,
so its Workers page answers HTTP 500 while any job runs. There is no option for it; this gives the
worker class rq-dashboard calls the configured serializer and changes nothing else. Pinned with the
release it was read against (Dockerfile, pyproject's dev extra); tests/system/test_rq_tools.py reads
the Workers page of a busy run through it. Needs nothing of harvest: it runs in the dashboard image.
"""

from __future__ import annotations

from typing import Any

import rq_dashboard.web as web
from rq.worker import BaseWorker, Worker
from rq_dashboard.cli import main


class _ConfiguredWorker(Worker):
    @classmethod
    def all(cls, *args: Any, **kwargs: Any) -> list[BaseWorker]:  # rq's own signature, passed through
        kwargs.setdefault("serializer", web.config.serializer)
        return Worker.all(*args, **kwargs)


web.Worker = _ConfiguredWorker

if __name__ == "__main__":
    main()
