"""`<out>/<run>/run.json`: the run's configuration beside its output, what every reader opens first.

It is written once, whole or not at all, when a run is first published
(harvest.state.runstore.publish_run, which also stores the run in Redis), and never rewritten but
by `harvest accept-model` (a checkpoint saved again): a later start with an identical configuration
leaves it as it is, and one that differs in anything that changes what is stored is refused by
name. The model is named by its fingerprint (harvest.formats.fingerprint) where the run records
one, so a symlink or a copy of it is the same run, and other weights under the same path are
not; a run.json without one is refused with a line that says how to record it. Readers
(harvest.read) parse it through `read_run_json`, with no Redis anywhere in the path.
"""

from __future__ import annotations

from harvest.config import ConfigError, RunConfig
from harvest.formats.fingerprint import mismatch_line, same_model
from harvest.storage import Location

RUN_FILE = "run.json"


def run_location(out_url: str, run: str) -> Location:
    """The run's output folder, `<out>/<run>`."""
    return Location.from_url(out_url).child(run)


def check_same_run(a: RunConfig, b: RunConfig, where: str) -> None:
    """Refuse `a` (the configuration now) unless it stores what `b` (the one in `where`) does.
    Where either records a model fingerprint, the fingerprints must be equal and the model's path
    may differ (a symlink, a copy); a hub id, without one, is compared by name."""
    ia, ib = a.identity(), b.identity()
    fa, fb = ia.pop("model_fingerprint"), ib.pop("model_fingerprint")
    if fa or fb:
        if not same_model(fb, fa):
            raise ConfigError(mismatch_line(a.run, fb, b.model, fa, a.model, where))
        del ia["model"], ib["model"]
    diff = sorted(k for k in ia if ia[k] != ib[k])
    if diff:
        details = ", ".join(f"{k}: {ib[k]!r} there, {ia[k]!r} now" for k in diff)
        raise ConfigError(
            f"run {a.run!r} already exists with a different configuration in {where} ({details}); use another --run name"
        )


def check_run_json(cfg: RunConfig) -> None:
    """Refuse `cfg` if its output already holds a run.json that stores something else; writes nothing."""
    loc = run_location(cfg.out_url, cfg.run)
    if loc.exists(RUN_FILE):
        check_same_run(cfg, RunConfig.from_json(loc.read_bytes(RUN_FILE)), loc.path(RUN_FILE))


def publish_run_json(cfg: RunConfig) -> None:
    """Write the run's run.json, or check the one there against `cfg` (ConfigError if they differ)."""
    loc = run_location(cfg.out_url, cfg.run)
    if loc.exists(RUN_FILE):
        check_same_run(cfg, RunConfig.from_json(loc.read_bytes(RUN_FILE)), loc.path(RUN_FILE))
    else:
        loc.write_atomic(RUN_FILE, cfg.to_json().encode())


def read_run_json(loc: Location) -> RunConfig:
    """The run whose output folder is `loc`; ConfigError if `loc` holds no run."""
    try:
        return RunConfig.from_json(loc.read_bytes(RUN_FILE))
    except FileNotFoundError:
        raise ConfigError(f"{loc.path(RUN_FILE)} not found: not a harvest run output") from None
