"""The RQ job class workers run: harvest's job function and nothing else.

RQ resolves a job's function, and its success/failure/stopped callbacks, by importing the
dotted names stored in the job hash. JSON serialization keeps pickle out, but a JSON job
naming `os.system` with a shell command as its argument would still run: whoever can write
to Redis would get code execution on every GPU node. A worker therefore accepts only
`harvest.state.jobs.JOB_FUNCTION`, and ignores any callback names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from harvest.state.jobs import JOB_FUNCTION, PayloadJob

log = logging.getLogger("harvest.worker")


class RefusedJob(RuntimeError):
    """A job that names a function other than harvest's."""


class HarvestJob(PayloadJob):
    @property
    def func(self) -> Callable[..., Any]:
        name = self.func_name
        if name != JOB_FUNCTION or self.instance is not None:
            raise RefusedJob(f"job {self.id} names function {name!r}; this worker runs only {JOB_FUNCTION}: refused")
        from harvest.workers.job import process_batch

        return process_batch

    def _refuse_callback(self, kind: str, name: str | None) -> None:
        if name:
            log.warning("job %s names a %s callback %r: ignored (workers run no callbacks)", self.id, kind, name)
        return None

    @property
    def success_callback(self) -> None:
        return self._refuse_callback("success", self._success_callback_name)

    @property
    def failure_callback(self) -> None:
        return self._refuse_callback("failure", self._failure_callback_name)

    @property
    def stopped_callback(self) -> None:
        return self._refuse_callback("stopped", self._stopped_callback_name)
