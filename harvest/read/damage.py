"""How a shard reader reports damage: one sample's bytes (`CorruptSample`), or a whole shard it
cannot open (`UnreadableShard`), each with the command that repairs it (`verify_fix`)."""

from __future__ import annotations

import posixpath

from harvest.formats.index import ShardError
from harvest.storage import Location


def object_url(loc: Location, name: str) -> str:
    """`name` of `loc` as a user types it: a path for a local folder, else its URL."""
    return loc.path(name) if loc.is_local else loc.fs.unstrip_protocol(loc.path(name))


def verify_fix(loc: Location, plural: bool = False) -> str:
    """The command that drops a run's corrupt samples from its index files so that they are
    extracted again (`loc` is the run's folder, `<out>/<run>`)."""
    run = posixpath.basename(loc.root)
    out = posixpath.dirname(loc.root) if loc.is_local else loc.url().rsplit("/", 1)[0]
    it = "them" if plural else "it"
    return (
        f"run `harvest reconcile --verify --run {run} --out {out}` to drop {it} from the index and extract {it} again"
    )


class CorruptSample(ShardError):
    """One sample's stored bytes differ from what was packed (its crc32), or are cut short."""

    def __init__(
        self,
        shard_url: str,
        shard_id: str,
        sample_id: str,
        tensor: str,
        begin: int,
        end: int,
        problem: str,
        fix: str,
        expected: int | None = None,
        found: int | None = None,
    ) -> None:
        self.shard_url, self.shard_id, self.sample_id, self.tensor = shard_url, shard_id, sample_id, tensor
        self.begin, self.end, self.problem, self.expected, self.found = begin, end, problem, expected, found
        super().__init__(
            f"{shard_url}: sample {sample_id} is corrupt: tensor {tensor}, bytes [{begin}, {end}) of "
            f"the shard {problem}; {fix}"
        )


class UnreadableShard(ShardError):
    """A committed shard that cannot be opened at all (its file missing, its header or offsets
    damaged): every sample it commits is lost with it."""

    def __init__(self, shard_id: str, why: str, samples: int, fix: str) -> None:
        self.shard_id, self.why = shard_id, why
        super().__init__(f"shard {shard_id} cannot be read ({why}); its {samples} samples: {fix}")
