"""What one chaos trial (tests.support.chaos) found: every input sample accounted for, and
what was left behind."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

_SPOOL_TEMP = re.compile(r"\.tmp-[0-9a-f]{32}\.(\d+)\.[0-9a-f]+")


def killed_writers_temp(path: str) -> bool:
    """A spool file in flight (harvest.node.spooldir) whose worker is gone: a kill during its job's
    spool step leaves it, and harvest removes it by age (TEMP_MAX_AGE_S, an hour), not by pid, as
    the other containers of a node cannot see the pid. Counted, not a leftover."""
    m = _SPOOL_TEMP.fullmatch(os.path.basename(path))
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    return False


@dataclass
class TrialResult:
    seed: int
    samples: int
    kills: Counter = field(default_factory=Counter)
    restarts_on_exit: Counter = field(default_factory=Counter)
    node_returns: Counter = field(default_factory=Counter)  # within / after the grace, never
    spools_reclaimed: int = 0  # spools revoked with samples to put back
    spools_revoked: int = 0  # every spool given up for lost, empty ones too
    done: int = 0
    failed: int = 0
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    wrong_tokens: list[str] = field(default_factory=list)
    failed_without_reason: list[str] = field(default_factory=list)
    failure_reasons: Counter = field(default_factory=Counter)
    shards_without_index: list[str] = field(default_factory=list)
    unreadable: str = ""  # why a reader could not read the committed run (it must always can)
    leftovers: list[str] = field(default_factory=list)
    killed_temps: int = 0  # spool files in flight of killed workers (`killed_writers_temp`)
    janitor_lines: list[str] = field(default_factory=list)  # the final passes' reports: why files were kept
    timeline: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not (
            self.error
            or self.lost
            or self.doubled
            or self.wrong_tokens
            or self.failed_without_reason
            or self.shards_without_index
            or self.leftovers
            or self.unreadable
        )

    def summary(self) -> str:
        return (
            f"seed {self.seed}: {'OK' if self.ok else 'FAIL'} {self.samples} samples, done {self.done}, failed "
            f"{self.failed} {dict(self.failure_reasons)}, kills {dict(self.kills)}, exits {dict(self.restarts_on_exit)}, "
            + (
                f"nodes back {dict(self.node_returns)}, spools revoked {self.spools_revoked} "
                f"({self.spools_reclaimed} with samples), "
                if self.node_returns
                else ""
            )
            + f"lost {len(self.lost)}, doubled {len(self.doubled)}, wrong {len(self.wrong_tokens)}, "
            f"unexplained failures {len(self.failed_without_reason)}, shards without index "
            f"{len(self.shards_without_index)}, leftovers {len(self.leftovers)} {self.leftovers[:5]} (and "
            f"{self.killed_temps} spool files in flight of killed workers)"
            + (f" after final janitor passes {self.janitor_lines}" if self.leftovers else "")
            + f", unreadable {self.unreadable or 0}, "
            f"{self.seconds:.0f}s" + (f"; error: {self.error}" if self.error else "")
        )
