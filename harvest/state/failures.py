"""Why a sample failed: every reason, the one exception that carries one, and recording it.

A failure travels: raised in a worker (claim, verify, the engine call, the spool write), or
found by the janitor (a job whose worker keeps dying) or a collector (a spool file that does
not match the run, or one damaged on the node each time its sample was extracted) -> recorded
in the ledger (state `f`, with reason and message) after the sample's payload row is kept ->
counted by `harvest status` and the metrics -> selected by reason with `harvest requeue --reason`.
The reason strings are part of the operator's interface: they are shown, filtered on and
scraped, so each is named once, here.
"""

from __future__ import annotations

from collections.abc import Mapping

from harvest.sample import Sample
from harvest.state.ledger import Ledger
from harvest.state.payload import payload_row

# The engine call (harvest.workers.job)
ENGINE_UNAVAILABLE = "engine-unavailable"  # transient: unreachable, timeouts, 5xx after retries
ENGINE_REJECTED = "engine-rejected"  # the engine refused the request (4xx), or vLLM's file was unusable
PROMPT_LENGTH = "prompt-length"  # the engine saw another prompt length than was sent
PREFIX_CACHED = "prefix-cached"  # part of the prompt came from the prefix cache: never computed
JOB_TIMEOUT = "job-timeout"  # transient: RQ's time limit for the job
WORKER_STOPPED = "worker-stopped"  # transient: a second stop signal during the job
WORKER_ERROR = "worker-error"  # an unexpected exception in the job
STORAGE_ERROR = "storage-error"  # transient: writing the node's spool failed
# Generating a conversation's turns (harvest.workers.regenerate), in a --regenerate run
GENERATION_EMPTY = "generation-empty"  # the model ended a turn before writing anything
GENERATION_LENGTH = "generation-length"  # a turn hit --max-new-tokens (failed only with --on-length fail)
CONTEXT_LENGTH = "context-length"  # a turn's prompt with --max-new-tokens, or the whole, past the model's context
# Claiming and verifying dumps (harvest.workers.claim)
INCOMPLETE_DUMP = "incomplete-dump"
BAD_CHUNKS = "bad-chunks"
BAD_DUMP = "bad-dump"
CAPTURE_MISMATCH = "capture-mismatch"
TOKEN_MISMATCH = "token-mismatch"
NONFINITE = "nonfinite"
# Found by operations
WORKER_DIED = "worker-died"  # the janitor gave up on a job whose workers kept dying
BAD_SPOOL = "bad-spool"  # a collector found a spool file that does not match the run
SPOOL_DAMAGED = "spool-damaged"  # its spool file was found damaged (checksums, truncated) each time it was extracted
SPOOL_LOST = "spool-lost"  # its spool was reclaimed and no payload row was kept to enqueue it again
SPOOL_REVOKED = "spool-revoked"  # transient: the worker's spool was reclaimed during the job
JOB_LOST = "job-lost"  # queued, in no job for the janitor's grace, and its tokens kept nowhere in Redis

REASONS = (
    ENGINE_UNAVAILABLE,
    ENGINE_REJECTED,
    PROMPT_LENGTH,
    PREFIX_CACHED,
    JOB_TIMEOUT,
    WORKER_STOPPED,
    WORKER_ERROR,
    STORAGE_ERROR,
    INCOMPLETE_DUMP,
    BAD_CHUNKS,
    BAD_DUMP,
    CAPTURE_MISMATCH,
    TOKEN_MISMATCH,
    NONFINITE,
    WORKER_DIED,
    BAD_SPOOL,
    SPOOL_DAMAGED,
    SPOOL_LOST,
    SPOOL_REVOKED,
    JOB_LOST,
    GENERATION_EMPTY,
    GENERATION_LENGTH,
    CONTEXT_LENGTH,
)


class SampleFailure(Exception):
    """A failure with its reason. Transient ones (another attempt, later or elsewhere, may not
    meet them) make the job retry with its samples still queued; others fail the sample at once."""

    def __init__(self, reason: str, message: str, transient: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.transient = reason, message, transient


def record_failures(
    ledger: Ledger,
    run: str,
    samples: Mapping[str, Sample],
    failures: Mapping[str, tuple[str, str]],
    forgotten: bool = False,
) -> list[str]:
    """Mark samples failed (sample id -> (reason, message)), keeping their payload rows first so
    they can be requeued later. Returns the samples that moved to failed. `forgotten`: see
    Ledger.mark_failed."""
    ledger.keep_failed_payloads({sid: payload_row(run, samples[sid]) for sid in failures if sid in samples})
    return ledger.mark_failed(dict(failures), forgotten=forgotten)
