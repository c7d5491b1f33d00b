"""Every Redis key harvest uses, in one place, so the layout of a run in Redis can be read here."""

from __future__ import annotations

from dataclasses import dataclass

from harvest.ids import check_id


@dataclass(frozen=True)
class Keys:
    run: str

    def __post_init__(self) -> None:
        check_id(self.run, "run name")

    @property
    def prefix(self) -> str:
        return f"harvest:{self.run}"

    @property
    def queue_name(self) -> str:
        """The RQ queue of the run (RQ stores it under `rq:queue:<name>`)."""
        return f"harvest:{self.run}"

    @property
    def config(self) -> str:
        """JSON RunConfig, written once when the run starts."""
        return f"{self.prefix}:config"

    @property
    def state(self) -> str:
        """Hash sample_id -> one-letter state (see harvest.ledger)."""
        return f"{self.prefix}:state"

    @property
    def counts(self) -> str:
        """Hash state letter -> number of samples in that state, kept by the same script that moves states."""
        return f"{self.prefix}:counts"

    @property
    def failed(self) -> str:
        """Hash sample_id -> JSON {reason, message} for samples in state f."""
        return f"{self.prefix}:failed"

    @property
    def attempts(self) -> str:
        """Hash sample_id -> attempts started, so each attempt gets a fresh rid."""
        return f"{self.prefix}:attempts"

    @property
    def stats(self) -> str:
        """Hash of throughput counters (tokens_done, bytes_done, shards)."""
        return f"{self.prefix}:stats"

    def packing(self, host: str) -> str:
        """JSON {shard_id, sample_ids} of the shard a collector is committing; survives its crash."""
        return f"{self.prefix}:packing:{check_id(host, 'host name')}"


# The RQ job function, named by string so the producer need not import the workers.
JOB_FUNCTION = "workers.job.process_batch"
