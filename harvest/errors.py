"""harvest's error vocabulary: one root, `HarvestError`, and the four kinds of failure a user can
do something about. Stdlib only, so any process (and `harvest --help`) imports it for free.

A `HarvestError` that reaches the CLI (`harvest.cli.errors.HarvestGroup`) is told as one
`harvest: error: <for_user()>` line and exit status `exit_status` (2; RedisLost 75); anything
else is a bug and keeps its traceback. Foreign errors (redis, botocore, OSError on a path the
user named) are translated into these kinds at that boundary by one table
(`harvest.cli.errors.FOREIGN`), never by catching built-in exceptions in a command.

The cut is by who can fix it and where to look, which is what the one line must name:

- `ConfigurationError`: what the user asked for cannot be done as asked: a flag, an
  environment variable, the run's configuration or one that contradicts the stored run, a
  missing tool or venv. Fix: change the command line or the environment.
- `InputError`: something handed to harvest does not hold what it must: a dataset row, an id,
  a chat template, a checkpoint's final norm, or a file one process hands another (dump, spool,
  shard, index, payload). Fix: the data (the message names the file and the row or byte).
- `StorageError`: the output (a local folder, an object store) failed an operation for good,
  or the filesystem refused a path the user named (full, read-only, permission). Fix: the
  storage; what was written is kept.
- `ServiceError`: a service harvest talks to (Redis, the S3 endpoint, the engine, a child
  process of `harvest run`) cannot be reached, or went away. Fix: start it, or point at it.

Classes derive from their kind and keep the built-in base their callers catch, e.g.
`SampleError(InputError, ValueError)`, so every `except ValueError` stays as it was.

Outside the root on purpose: control flow that never reaches the CLI, caught where it is
raised or by RQ:

- `harvest.state.failures.SampleFailure`: one sample's failure with its reason; the worker
  records it in the ledger, the job goes on.
- `harvest.collector.records.Voided`: the commit fence refused a shard; the collector drops it.
- `harvest.workers.safejob.RefusedJob`: raised inside RQ's job execution for a job naming another
  function; RQ marks that job failed, the worker goes on.
- `harvest.formats.filecopy.ShortFile`: a kernel copy that met the end of its source; the
  shard writer falls back to writing from memory.
- `harvest.engines.reference.BadRequest`: a request the reference engine answers with HTTP 400.
"""

from __future__ import annotations


class HarvestError(Exception):
    """A failure the user can fix; its message names the fix."""

    exit_status = 2  # the CLI's exit status for it

    def for_user(self) -> str:
        """The CLI's line for it (after `harvest: error: `)."""
        return str(self)


class ConfigurationError(HarvestError, ValueError):
    """A flag, environment variable or run configuration that cannot be used as given, or that
    contradicts the stored run. A ValueError too: the callers that parse a value catch that."""


class InputError(HarvestError):
    """Data handed to harvest (dataset, ids, templates, checkpoints, dump/spool/shard files) that
    does not hold what it must."""


class StorageError(HarvestError):
    """A storage operation that failed for good; the message names the object and the cause."""


class OutputRefused(StorageError):
    """The output refuses writes (read-only, permission denied, access denied): no retry or restart
    helps until someone fixes the storage. Its own exit status tells a supervisor (harvest run)
    to stop the run at once, in order, instead of restarting the collector into the same wall."""

    exit_status = 77  # EX_NOPERM (sysexits.h)


REFUSING_ERRNOS = frozenset({1, 13, 30})  # EPERM, EACCES, EROFS


def refuses_writes(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, says the storage refuses writes for good
    (s3fs turns an object store's AccessDenied into PermissionError)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PermissionError) or (isinstance(e, OSError) and e.errno in REFUSING_ERRNOS):
            return True
        e = e.__cause__ or e.__context__
    return False


class ServiceError(HarvestError):
    """A service harvest depends on (Redis, S3, the engine, a child process) is unreachable or gone."""


KINDS = (ConfigurationError, InputError, StorageError, ServiceError)
