"""Errors name their object, as a user meets them: `harvest export` and `harvest reconcile` of a run
whose index file or run.json is garbled say which file, in one line, exit 2 (on a local folder and
on S3, where the object is named by its URL)."""

import pytest

from harvest.collector.collector import Collector
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.storage import Location
from tests.support.cli import harvest_cli
from tests.support.synth import make_config, spool_samples

JSON_ERR = "Expecting property name enclosed in double quotes"


def _commit(conn, tmp_path, out_url):
    cfg = publish_run(conn, make_config(out_url))
    samples = spool_samples(str(tmp_path / "spool"), cfg, [6, 1, 20])
    Ledger(conn, cfg.run).add_queued([s.id for s in samples])
    Ledger(conn, cfg.run).mark_spooled([s.id for s in samples])
    c = Collector(conn, cfg, str(tmp_path / "spool"), node="n1", shard_bytes=1500)
    while c.step(force=True):
        pass
    loc = Location.from_url(f"{out_url}/r")
    return loc, loc.list("index", ".json")[0]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_garbled_index_or_run_json_is_named_by_export_and_reconcile(conn, redis_server, tmp_path, where, request):
    out_url = str(tmp_path / "out") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/out"
    loc, index = _commit(conn, tmp_path, out_url)
    run_url = loc.describe()
    good = loc.read_bytes(f"index/{index}")
    loc.fs.pipe_file(loc.path("index", index), b"{oops")
    r = harvest_cli("export", "--run-url", run_url, "--format", "specforge", str(tmp_path / "sf"), "--no-progress")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        f"harvest: error: index file {run_url}/index/{index} is not JSON ({JSON_ERR} at line 1 column 2): garbled or "
        f"cut short; move it out of {run_url}/index (its shard is then uncommitted) and run `harvest reconcile --run r` "
        "(with the run's --redis or --work-dir) to extract its samples again\n"
    )
    r = harvest_cli("reconcile", "--run", "r", "--redis", redis_server.url, "--out", out_url)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"harvest: error: {run_url}/index/{index} is not JSON ({JSON_ERR} at line 1 column 2): garbled or cut short"
    )

    loc.fs.pipe_file(loc.path("index", index), good)
    loc.fs.pipe_file(loc.path("run.json"), b"{x")
    r = harvest_cli("export", "--run-url", run_url, "--format", "specforge", str(tmp_path / "sf"), "--no-progress")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        f"harvest: error: {run_url}/run.json is not a harvest run.json (JSONDecodeError: {JSON_ERR}: "
        "line 1 column 2 (char 1)): garbled, or not written by harvest\n"
    )
