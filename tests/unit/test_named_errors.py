"""Errors name their object: a storage error that does not say which object (an object store's bare
`Access Denied`) is told with it, of the same type; a stored JSON document that does not parse names
its file; a garbled index file names itself and the way out; a broken run.json names itself."""

import json

import pytest

from harvest.errors import ConfigurationError
from harvest.formats.index import ShardError, read_index
from harvest.read.reader import RunReader
from harvest.storage import Location, UnreadableDocument, named


def test_an_error_that_names_nothing_is_told_with_its_object_and_keeps_its_type():
    e = named(PermissionError("Access Denied"), "s3://b/r/index/x.json")  # as s3fs raises it
    assert type(e) is PermissionError and str(e) == "s3://b/r/index/x.json: Access Denied"
    e = named(PermissionError(13, "Access Denied"), "s3://b/r/run.json")
    assert (type(e), e.errno, e.filename, str(e)) == (
        PermissionError,
        13,
        "s3://b/r/run.json",
        "[Errno 13] Access Denied: 's3://b/r/run.json'",
    )
    already = FileNotFoundError(2, "No such file or directory", "/o/r/run.json")
    assert named(already, "/o/r/run.json") is already

    class ClientError(OSError):  # a library's own type, whose constructor is its own: left alone
        pass

    theirs = ClientError("refused")
    assert named(theirs, "s3://b/x") is theirs


def test_location_reads_name_what_failed(tmp_path):
    loc = Location.from_url(str(tmp_path))
    (tmp_path / "a.json").write_text('{"x": ')
    with pytest.raises(UnreadableDocument) as e:
        loc.read_json("a.json")
    assert str(e.value) == f"{tmp_path}/a.json is not JSON (Expecting value at line 1 column 7): garbled or cut short"
    (tmp_path / "b.json").write_bytes(b'{"x": "\xff"}')
    with pytest.raises(UnreadableDocument) as e:
        loc.read_json("b.json")
    assert str(e.value) == (
        f"{tmp_path}/b.json is not JSON (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in "
        "position 7: invalid start byte): garbled or cut short"
    )
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/nope.json"):
        loc.read_json("nope.json")


def test_a_garbled_index_names_itself_and_the_repair(tmp_path):
    run = tmp_path / "out" / "r"
    (run / "index").mkdir(parents=True)
    (run / "index" / "abc.json").write_text("{oops")
    with pytest.raises(ShardError) as e:
        read_index(Location.from_url(str(run)), "abc.json")
    assert str(e.value) == (
        f"index file {run}/index/abc.json is not JSON (Expecting property name enclosed in double quotes at line 1 "
        f"column 2): garbled or cut short; move it out of {run}/index (its shard is then uncommitted) and run "
        "`harvest reconcile --run r` (with the run's --redis or --work-dir) to extract its samples again"
    )
    (run / "index" / "abc.json").write_text("[1]")
    with pytest.raises(ShardError, match=rf"^{run}/index/abc.json: an index file holds a JSON object, found list$"):
        read_index(Location.from_url(str(run)), "abc.json")


@pytest.mark.parametrize(
    "text,why",
    [
        (
            "{x",
            "is not a harvest run.json (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
            "column 2 (char 1)): garbled, or not written by harvest",
        ),
        (json.dumps({"run": "r", "zz": 1}), ": run config has unknown fields ['zz']: written by a newer harvest?"),
        (
            json.dumps({"run": "r"}),
            "is not a harvest run.json (RunConfig.__init__() missing 4 required positional "
            "arguments: 'model', 'capture_points', 'hidden_size', and 'out_url')",
        ),
    ],
)
def test_a_broken_run_json_names_itself(tmp_path, text, why):
    (tmp_path / "run.json").write_text(text)
    with pytest.raises(ConfigurationError) as e:
        RunReader(str(tmp_path))
    assert str(e.value) == f"{tmp_path}/run.json{'' if why.startswith(':') else ' '}{why}"
