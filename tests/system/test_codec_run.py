"""`harvest run --codec blosc2-zstd` end to end through the CLI: the reference engine chunking at 32
tokens, the collector coding each sample, the audit recomputing every sample against an
independent transformers forward; a byte flipped in one sample's coded bytes is named by the
audit as corruption at rest, `harvest reconcile --verify` drops it, the same command extracts it
again, and the audit then passes; `harvest ratio` reports what the codec saved."""

from __future__ import annotations

import json
import os
import re

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import RedisServer
from harvest.formats.index import CODED_FORMAT, INDEX
from harvest.read.reader import RunReader
from harvest.read.shard_reader import ShardReader
from harvest.storage import Location
from tests.support.cli import harvest_cli

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as tests/system/test_audit.py: two cores shared by the suite


def test_a_coded_run_is_audited_repaired_and_measured_like_any_other(tmp_path, tiny_model):
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(12))
    out, work = tmp_path / "out", tmp_path / "work"
    args = [
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        f"file://{out}",
        "--run",
        "coded",
        "--codec",
        "blosc2-zstd",
        "--workers",
        "1",
        "--shard-mb",
        "1",
        "--max-wait",
        "1",
        "--chunked-prefill-size",
        "32",
        "--no-progress",
        "--work-dir",
        str(work),
        "--dump-dir",
        str(tmp_path / "dumps"),
    ]
    res = harvest_cli(*args, env=ONE_THREAD)
    assert res.returncode == 0, res.stdout + res.stderr
    n = int(re.search(r"samples: (\d+) done, 0 failed", res.stdout).group(1))
    assert json.loads((out / "coded" / "run.json").read_text())["codec"] == "blosc2-zstd"
    loc = Location.from_url(f"file://{out}/coded")
    docs = [loc.read_json(f"{INDEX}/{name}") for name in loc.list(INDEX, ".json")]
    assert {d["format"] for d in docs} == {CODED_FORMAT} and {d["codec"] for d in docs} == {"blosc2-zstd"}

    reader = RunReader(loc.url())
    sid = max(reader.sample_ids, key=lambda s: len(reader.tokens(s)[0]))  # the longest: several prefill chunks
    doc = next(d for d in docs if sid in d["samples"])
    i = doc["samples"].index(sid)
    span = ShardReader(loc, doc).tensors["hidden_states"]
    begin, end = span.begin + doc["coded_offsets"][i], span.begin + doc["coded_offsets"][i + 1]
    with open(loc.path(doc["shard"]), "r+b") as f:
        f.seek((begin + end) // 2)
        byte = f.read(1)
        f.seek((begin + end) // 2)
        f.write(bytes([byte[0] ^ 0x04]))

    audit = ["audit", "--run", "coded", "--against", "hf", "--samples", "100", "--seed", "5", "--no-progress"]
    with RedisServer(str(work / "redis")) as server:  # the finished run's private Redis, again
        res = harvest_cli(*audit, "--redis", server.url, env=ONE_THREAD)
        assert res.returncode == 1, res.stdout + res.stderr
        corrupt = [ln for ln in res.stdout.splitlines() if ln.startswith("CORRUPT ")]
        assert len(corrupt) == 1 and f"sample {sid} " in corrupt[0], res.stdout
        assert f"corrupt: tensor hidden_states, bytes [{begin}, {end}) of the shard " in corrupt[0], corrupt[0]
        assert corrupt[0].endswith(": corruption at rest, not drift"), corrupt[0]
        assert not [ln for ln in res.stdout.splitlines() if ln.startswith("FAIL ")], res.stdout
        res = harvest_cli("reconcile", "--run", "coded", "--redis", server.url, "--verify", "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr
    assert sid not in RunReader(loc.url()).sample_ids

    res = harvest_cli(*args, env=ONE_THREAD)  # the same command: the dropped sample extracted again
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(RunReader(loc.url()).sample_ids) == sorted(reader.sample_ids)
    with RedisServer(str(work / "redis")) as server:
        res = harvest_cli(*audit, "--redis", server.url, env=ONE_THREAD)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"verdict: pass: {n} of {n} samples within the bound" in res.stdout, res.stdout

    res = harvest_cli("ratio", "--run-url", str(out / "coded"))
    assert res.returncode == 0, res.stdout + res.stderr
    ratio = float(re.search(r"MB stored: ([\d.]+)x;", res.stdout).group(1))
    assert res.stdout.startswith("run coded (codec blosc2-zstd, bf16): ") and ratio > 1.0, res.stdout
    assert os.listdir(tmp_path / "dumps") == []
