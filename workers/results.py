"""What one execution of a job did: the `spool` step's outcome and the job's result for RQ."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JobResult:
    """What one execution of a job did with its samples (the ledger holds the truth)."""

    spooled: int = 0
    failed: int = 0
    skipped: int = 0  # samples already past queued when the job started
    reasons: dict[str, int] = field(default_factory=dict)  # failure reason -> samples failed with it

    def to_rq(self) -> dict:
        """RQ's return value: JSON only (harvest.state.jobs.SERIALIZER), the three counts."""
        return {"spooled": self.spooled, "failed": self.failed, "skipped": self.skipped}


@dataclass
class Spooled:
    """The `spool` step's outcome: samples durable and in place, or the storage error that stopped it."""

    ids: list[str] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0
    dump_bytes: int = 0
    error: str | None = None
