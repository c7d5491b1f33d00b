"""The error vocabulary (harvest/errors.py) at work: the kinds at runtime, the CLI's translation
table telling a real Redis and S3 failure as one line, exit 2, and a bug keeping its traceback.
That every exception class derives from the root is a house rule (tests/unit/test_house.py)."""

from __future__ import annotations

import errno
import json
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


def test_the_kinds_at_runtime():
    from harvest.ids import InvalidId
    from harvest.producer.rowkinds import RowError
    from harvest.state.connection import REDIS_LOST_EXIT, RedisLost
    from harvest.storage import StorageError as StorageStorageError

    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(InvalidId, InputError) and issubclass(RowError, InputError)
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
    assert _one_line(res) == (
        "harvest: error: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(or AWS_PROFILE), and HARVEST_S3_ENDPOINT or --s3-endpoint for MinIO/Ceph"
    )
    e = NoCredentialsError()
    err = translate(e)
    assert isinstance(err, ConfigurationError) and err.__cause__ is e and err.exit_status == 2


def test_the_table_looks_up_only_what_is_imported():
    assert {row.module for row in FOREIGN} == {"redis.exceptions", "botocore.exceptions"}
    code = (
        "import sys, harvest.cli; from harvest.cli.errors import translate; translate(ValueError()); "
        "print(sorted(m for m in ('redis', 'botocore') if m in sys.modules))"
    )
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
    import harvest.producer.producer as pp
    from harvest.cli import main

    data, model = small_inputs

    def buggy(*a, **kw):
        raise ValueError("a bug in the producer")

    monkeypatch.setattr(pp, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(pp, "produce", buggy)
    with pytest.raises(ValueError, match="a bug in the producer"):
        CliRunner().invoke(
            main,
            ["produce", data, "--run", "r1", "--model", model, "--dry-run", "--no-progress"],
            catch_exceptions=False,
        )


def test_a_runtime_error_inside_run_is_not_a_mistake(small_inputs, tmp_path, monkeypatch):
    import signal

    from harvest import config
    from harvest.cli import main, runner

    data, model = small_inputs

    def buggy(*a, **kw):
        raise RuntimeError("a bug in the runner")

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # `run` sets SIGTERM's handler: not this process's
    monkeypatch.setattr(config, "build_config", lambda **kw: None)
    monkeypatch.setattr(runner, "run_all", buggy)
    with pytest.raises(RuntimeError, match="a bug in the runner"):
        CliRunner().invoke(
            main, ["run", data, "--model", model, "--out", str(tmp_path / "out")], catch_exceptions=False
        )


def test_fail_never_returns():
    from harvest.cli.options import fail

    assert typing.get_type_hints(fail)["return"] is typing.NoReturn
