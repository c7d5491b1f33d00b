"""The error vocabulary (harvest/errors.py), read from the code itself: every exception class of
the package and its wings derives from HarvestError through one of its four kinds, save the
internal ones listed here with their reason; the CLI's translation table tells a real Redis
and S3 failure as one line, exit 2; a bug keeps its traceback."""

from __future__ import annotations

import ast
import builtins
import errno
import json
import os
import subprocess
import sys
import typing

import click
import pytest
from click.testing import CliRunner

from harvest.cli.errors import FOREIGN, HarvestGroup, translate
from harvest.errors import KINDS, ConfigurationError, HarvestError, InputError, ServiceError, StorageError
from tests.support.cli import REPO

PACKAGES = ("harvest", "producer", "workers", "collector", "engines")
ROOT = "HarvestError"

# Exception classes outside the root, "path:Class" -> why.
OUTSIDE = {
    "harvest/state/failures.py:SampleFailure": "one sample's failure with its reason: recorded in the ledger by the "
                                                "worker, never raised to the CLI",
    "collector/records.py:Voided": "the commit fence refused a shard: the collector drops it",
    "workers/safejob.py:RefusedJob": "raised inside RQ's job execution; RQ fails that job, the worker goes on",
    "harvest/formats/filecopy.py:ShortFile": "a kernel copy met the end of its source: the shard writer falls back",
    "engines/reference.py:BadRequest": "answered as HTTP 400 by the reference engine's handler",
}


def _classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of the packages: "path:Name" -> (its module path, its bases' last names)."""
    out = {}
    for top in PACKAGES:
        for d, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for n in names:
                if not n.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(d, n), REPO)
                tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        out[f"{path}:{node.name}"] = (path, [ast.unparse(b).split(".")[-1] for b in node.bases])
    return out


@pytest.fixture(scope="module")
def classes() -> dict[str, tuple[str, list[str]]]:
    return _classes()


def _resolve(name: str, path: str, classes) -> list[str]:
    """The repository classes a base name may be: the one in the same file, else any of that name."""
    same = f"{path}:{name}"
    return [same] if same in classes else [k for k in classes if k.endswith(f":{name}")]


def _ancestors(key: str, classes, seen=None) -> set[str]:
    """Every base name up the class's tree (repository classes by key, others by name)."""
    seen = set() if seen is None else seen
    path, bases = classes[key]
    out = set()
    for b in bases:
        found = _resolve(b, path, classes)
        out |= set(found) or {b}
        for k in found:
            if k not in seen:
                seen.add(k)
                out |= _ancestors(k, classes, seen)
    return out


def _is_exception(key: str, classes) -> bool:
    def foreign_exception(name: str) -> bool:
        b = getattr(builtins, name, None)
        return (isinstance(b, type) and issubclass(b, BaseException)) or name.endswith(("Error", "Exception"))

    return any(":" not in a and foreign_exception(a) for a in _ancestors(key, classes))


def _in_root(key: str, classes) -> bool:
    return any(a.endswith(f":{ROOT}") for a in _ancestors(key, classes))


def test_every_exception_class_derives_from_harvest_error(classes):
    exceptions = {k for k in classes if _is_exception(k, classes)}
    assert "harvest/errors.py:HarvestError" in exceptions and len(exceptions) > 25
    outside = sorted(k for k in exceptions - {"harvest/errors.py:HarvestError"} if not _in_root(k, classes))
    unexplained = [k for k in outside if k not in OUTSIDE]
    assert not unexplained, (f"{unexplained}: derive each from its kind in harvest/errors.py (keeping the built-in "
                             "base its callers catch), or list it in OUTSIDE with why it never reaches the CLI")
    missing = [k for k in OUTSIDE if k not in classes]
    assert not missing, f"{missing}: gone; remove them from OUTSIDE"
    stale = [k for k in OUTSIDE if _in_root(k, classes) and not OUTSIDE[k].startswith("pending:")]
    assert not stale, f"{stale}: in the root now; remove them from OUTSIDE"


def test_every_error_has_one_of_the_kinds(classes):
    kinds = {f"harvest/errors.py:{k.__name__}" for k in KINDS}
    for key in classes:
        if _in_root(key, classes) and key not in kinds:
            assert _ancestors(key, classes) & kinds, f"{key} derives from HarvestError itself: choose its kind"


def test_the_kinds_at_runtime():
    from harvest.config import ConfigError
    from harvest.ids import InvalidId
    from harvest.state.connection import REDIS_LOST_EXIT, RedisLost
    from harvest.storage import StorageError as StorageStorageError
    from producer.producer import BadRowError

    assert issubclass(ConfigError, ConfigurationError) and issubclass(ConfigError, ValueError)
    assert issubclass(InvalidId, InputError) and issubclass(BadRowError, InputError)
    assert StorageStorageError is StorageError
    lost = RedisLost("redis://h:1/0", 3, 300, "gone")
    assert isinstance(lost, ServiceError) and lost.exit_status == REDIS_LOST_EXIT
    assert all(issubclass(k, HarvestError) for k in KINDS) and [k.exit_status for k in KINDS] == [2, 2, 2, 2]


# -- the translation table at the CLI boundary -------------------------------------------------

def _cli(body) -> click.Group:
    @click.group(cls=HarvestGroup)
    def cli() -> None:
        pass

    @cli.command("cmd")
    @click.argument("path", required=False)
    def cmd(path) -> None:
        body(path)

    return cli


def _one_line(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


def test_a_real_redis_connection_error_is_one_line_exit_2():
    from harvest.cli.errors import connect
    from harvest.cli.redisproc import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    res = CliRunner().invoke(_cli(lambda _: connect(url)), ["cmd"])
    assert res.exit_code == 2, res.output
    line = _one_line(res)
    assert line.startswith(f"harvest: error: cannot reach Redis at {url} (Error 111 connecting to "), line
    assert line.endswith(": start redis-server there, or pass --redis URL (default from HARVEST_REDIS_URL)"), line
    import redis

    with pytest.raises(redis.ConnectionError) as e:
        connect(url)
    err = translate(e.value)
    assert isinstance(err, ServiceError) and err.__cause__ is e.value and err.exit_status == 2
    assert err.for_user().split(" (")[0] == line.removeprefix("harvest: error: ").split(" (")[0]


def test_a_botocore_no_credentials_error_is_one_line_exit_2():
    from botocore.exceptions import NoCredentialsError

    def body(_):
        raise NoCredentialsError()

    res = CliRunner().invoke(_cli(body), ["cmd"])
    assert res.exit_code == 2, res.output
    assert _one_line(res) == ("harvest: error: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                              "(or AWS_PROFILE), and HARVEST_S3_ENDPOINT or --s3-endpoint for MinIO/Ceph")
    e = NoCredentialsError()
    err = translate(e)
    assert isinstance(err, ConfigurationError) and err.__cause__ is e and err.exit_status == 2


def test_the_table_looks_up_only_what_is_imported():
    assert {row.module for row in FOREIGN} == {"redis.exceptions", "botocore.exceptions"}
    code = ("import sys, harvest.cli; from harvest.cli.errors import translate; translate(ValueError()); "
            "print(sorted(m for m in ('redis', 'botocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_an_os_error_on_a_path_the_user_named_is_one_line(tmp_path):
    missing = str(tmp_path / "nope" / "data.jsonl")
    res = CliRunner().invoke(_cli(lambda p: open(p)), ["cmd", missing])
    assert res.exit_code == 2
    assert _one_line(res) == f"harvest: error: [Errno 2] No such file or directory: '{missing}'"
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "x"))
    assert isinstance(translate(full, ["--out", str(tmp_path / "out")]), StorageError)
    assert isinstance(translate(full, [f"--out={tmp_path / 'out'}"]), StorageError)
    assert translate(full, ["--out", str(tmp_path / "elsewhere")]) is None


def test_an_os_error_elsewhere_keeps_its_traceback(tmp_path):
    inner = str(tmp_path / "harvest-internal" / "x")
    with pytest.raises(FileNotFoundError):
        CliRunner().invoke(_cli(lambda p: open(inner)), ["cmd", str(tmp_path / "data")], catch_exceptions=False)


# -- a bug is a bug ------------------------------------------------------------------------------

def test_an_unexpected_value_error_keeps_its_traceback():
    def body(_):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        CliRunner().invoke(_cli(body), ["cmd"], catch_exceptions=False)
    assert translate(ValueError("a bug")) is None
    assert translate(RuntimeError("a bug")) is None and translate(FileNotFoundError("a bug")) is None


@pytest.fixture
def small_inputs(tmp_path) -> tuple[str, str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8}))
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    return str(tmp_path / "data.jsonl"), str(tmp_path / "model")


def test_a_value_error_inside_produce_is_not_a_mistake(small_inputs, monkeypatch):
    import producer.producer as pp
    from harvest.cli import main

    data, model = small_inputs

    def buggy(*a, **kw):
        raise ValueError("a bug in the producer")

    monkeypatch.setattr(pp, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(pp, "produce", buggy)
    with pytest.raises(ValueError, match="a bug in the producer"):
        CliRunner().invoke(main, ["produce", data, "--run", "r1", "--model", model, "--dry-run", "--no-progress"],
                           catch_exceptions=False)


def test_a_runtime_error_inside_run_is_not_a_mistake(small_inputs, tmp_path, monkeypatch):
    import signal

    import harvest.cli.runner as runner
    import harvest.config as config
    from harvest.cli import main

    data, model = small_inputs

    def buggy(*a, **kw):
        raise RuntimeError("a bug in the runner")

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # `run` sets SIGTERM's handler: not this process's
    monkeypatch.setattr(config, "build_config", lambda **kw: None)
    monkeypatch.setattr(runner, "run_all", buggy)
    with pytest.raises(RuntimeError, match="a bug in the runner"):
        CliRunner().invoke(main, ["run", data, "--model", model, "--out", str(tmp_path / "out")],
                           catch_exceptions=False)


def test_fail_never_returns():
    from harvest.cli.options import fail

    assert typing.get_type_hints(fail)["return"] is typing.NoReturn
