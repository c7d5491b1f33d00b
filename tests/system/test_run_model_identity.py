"""A run knows its model, not its model's path: `harvest run` on a checkpoint whose weights were
replaced in place (the same path, the same shapes) is refused with one line naming both
fingerprints, before anything starts; a symlink and a copy of the run's checkpoint are accepted (the
copy's new samples are extracted from it); `harvest accept-model` records a checkpoint saved
again, after which the run goes on with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.formats.fingerprint import model_fingerprint, short
from tests.support.cli import REPO

RUN = "ident"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harvest.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def test_the_same_path_with_other_weights_is_refused_a_symlink_and_a_copy_are_not(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, str(tmp_path / "model"))
    rows = demo_rows(14, seed=11)
    data12, data14 = write_jsonl(str(tmp_path / "d12.jsonl"), rows[:12]), write_jsonl(str(tmp_path / "d14.jsonl"), rows)
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    common = [
        "--out",
        out,
        "--run",
        RUN,
        "--work-dir",
        work,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--no-progress",
        "--dtype",
        "fp32",
    ]

    first = _run("run", data12, "--model", model, *common)
    assert first.returncode == 0, first.stdout + first.stderr
    link = tmp_path / "link"
    link.symlink_to(model)
    again = _run("run", data12, "--model", str(link), *common)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to extract: no engine or worker was started" in again.stdout

    copy = shutil.copytree(model, str(tmp_path / "copy"))
    original = model_fingerprint(model)
    weights = os.path.join(model, "model.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file(
        {k: v + 0.5 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in load_file(weights).items()},
        weights,
        metadata={"format": "pt"},
    )  # other weights, the same names, shapes and dtypes
    replaced = model_fingerprint(model)
    refused = _run("run", data14, "--model", model, *common)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr == (
        f"harvest: error: run {RUN!r} was extracted from the model with fingerprint {short(original)} (at {model}, "
        f"recorded in {os.path.join(out, RUN, 'run.json')}), but {model} has fingerprint {short(replaced)}; differs in "
        f"model.safetensors: another checkpoint, or the same path with other weights; use another --run, or `harvest "
        f"accept-model --run {RUN} --model {model}` if it is the same model saved again\n"
    )

    on_copy = _run("run", data14, "--model", copy, *common)
    assert on_copy.returncode == 0, on_copy.stdout + on_copy.stderr
    n = len(rows)  # demo_rows ends with one long row more than asked for
    assert f"samples: {n} done, 0 failed ({n - 12} enqueued now, 12 already known)" in on_copy.stdout, on_copy.stdout

    accepted = _run("accept-model", "--run", RUN, "--model", model, "--work-dir", work)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert accepted.stdout == (
        f"run {RUN} now records model {model} (fingerprint {short(replaced)}), was {model} "
        f"(fingerprint {short(original)}); files that differ: model.safetensors\n"
    )
    after = _run("run", data14, "--model", model, *common)
    assert after.returncode == 0, after.stdout + after.stderr
    assert "nothing to extract: no engine or worker was started" in after.stdout
    now_the_copy = _run("run", data14, "--model", copy, *common)  # the run's model is the accepted one now
    assert now_the_copy.returncode == 2 and f"but {copy} has fingerprint {short(original)}" in now_the_copy.stderr


def test_a_worker_refuses_an_engine_serving_another_checkpoint_and_so_does_the_producer(
    tiny_model, tmp_path, conn, redis_server
):
    """The run's model at its path; an engine beside the workers started on other weights: the worker
    refuses before its first job, naming both fingerprints and the engine; so does `harvest produce`
    given the other checkpoint, and `harvest audit --against hf` with it."""
    from tests.support.ops import Procs, cli, new_run

    other = shutil.copytree(tiny_model, str(tmp_path / "other"))
    weights = os.path.join(other, "model.safetensors")
    g = torch.Generator().manual_seed(2)
    save_file(
        {k: v + 0.5 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in load_file(weights).items()},
        weights,
        metadata={"format": "pt"},
    )
    url_redis = redis_server.url
    cfg = new_run(conn, "wk", tiny_model, f"file://{tmp_path}/out")
    theirs, found = short(cfg.model_fingerprint), short(model_fingerprint(other))
    procs = Procs(str(tmp_path / "logs"))
    try:
        dumps = str(tmp_path / "dumps")
        url = procs.engine("engine", other, dumps)
        procs.start(
            "worker",
            "worker",
            "--run",
            "wk",
            "--redis",
            url_redis,
            "--engine-url",
            url,
            "--dump-dir",
            dumps,
            "--spool-dir",
            str(tmp_path / "spool"),
        )
        assert procs.wait("worker", 60) == 2
        err = [ln for ln in procs.log("worker").splitlines() if ln.startswith("harvest: error: ")]
        assert err == [
            f"harvest: error: run 'wk' was extracted from the model with fingerprint {theirs} (at "
            f"{tiny_model}, recorded in the run's configuration), but the engine at {url} serves {other}, "
            f"fingerprint {found}; differs in model.safetensors: another checkpoint, or the same path with "
            f"other weights; use another --run, or `harvest accept-model --run wk --model {other}` if it is "
            "the same model saved again"
        ], procs.log("worker")[-3000:]
    finally:
        procs.close()
    data = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(3, seed=1))
    res = cli("produce", data, "--run", "wk", "--redis", url_redis, "--model", other, "--out", f"file://{tmp_path}/out")
    assert res.returncode == 2 and f"but {other} has fingerprint {found}; differs in model.safetensors" in res.stderr, (
        res.stderr
    )
    res = cli("audit", "--run", "wk", "--redis", url_redis, "--against", "hf", "--model", other, "--samples", "1")
    assert res.returncode == 2 and f"but {other} has fingerprint {found}" in res.stderr, res.stderr
