"""The dataset and the run agree. A run stopped with its samples queued, then rows edited: the rerun
says how many queued samples the dataset no longer holds, and `--prune` drops them. A finished run
rerun on an edited file says how many committed samples it no longer holds, and deletes none. And
the summary's tokens and bytes are what the index files commit: after `harvest reconcile --verify`
excluded a corrupt copy and the rerun extracted it again, the excluded copy is not counted."""

from __future__ import annotations

import glob
import json
import os
import random

import numpy as np

from harvest.cli.redisproc import RedisServer
from harvest.formats.index import committed_samples, kept_copies
from harvest.formats.runfile import run_location
from harvest.ids import sample_id
from tests.support.chaos import make_rows
from tests.support.cli import harvest_cli
from tests.unit.test_integrity import flip

KEPT_LINE = "kept: harvest deletes no committed sample; a run that must hold exactly this dataset is a new --run"


def _ids(rows: list[list[int]]) -> list[str]:
    return [sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)) for r in rows]


def _docs(run_dir: str) -> list[dict]:
    docs = []
    for path in sorted(glob.glob(os.path.join(run_dir, "index", "*.json"))):
        with open(path) as f:
            docs.append(json.load(f))
    return docs


def _committed(run_dir: str) -> list[str]:
    return sorted(s for d in _docs(run_dir) for s in committed_samples(d))


def test_reruns_on_an_edited_dataset_say_what_the_run_holds_beyond_it(tiny_model, tmp_path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    rows = make_rows(12, vocab, random.Random(8))
    data, out = tmp_path / "data.jsonl", tmp_path / "out"

    def write(rs: list[list[int]]) -> None:
        data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rs))

    def edit(rs: list[list[int]], at: tuple[int, ...]) -> list[list[int]]:
        return [[(t + 1) % vocab for t in r] if i in at else r for i, r in enumerate(rs)]

    server = RedisServer(str(tmp_path / "redis")).start()
    common = [
        "--model",
        tiny_model,
        "--out",
        str(out),
        "--run",
        "edits",
        "--redis",
        server.url,
        "--dtype",
        "fp32",
        "--batch-samples",
        "2",
    ]
    run = [
        "run",
        str(data),
        *common,
        "--max-wait",
        "1",
        "--chunked-prefill-size",
        "32",
        "--no-progress",
        "--work-dir",
        str(tmp_path / "work"),
        "--dump-dir",
        str(tmp_path / "dumps"),
    ]
    try:
        # A run stopped with its samples queued (its producer alone ran), then 3 rows edited.
        write(rows)
        res = harvest_cli("produce", str(data), *common)
        assert res.returncode == 0, res.stdout + res.stderr
        rows = edit(rows, (1, 5, 9))
        write(rows)
        res = harvest_cli(*run, "--prune")
        assert res.returncode == 0, res.stdout + res.stderr
        assert (
            f"harvest: run edits holds samples that {data} no longer holds: 3 queued, dropped (--prune)\n" in res.stderr
        ), res.stderr
        assert "  samples: 12 done, 0 failed (3 enqueued now, 9 already known)\n" in res.stdout, res.stdout
        assert "  not in the dataset: 3 queued, dropped (--prune)\n" in res.stdout, res.stdout
        assert _committed(str(out / "edits")) == sorted(_ids(rows))

        # The finished run rerun on a file with 2 more rows edited: both versions stay committed.
        old = rows
        rows = edit(rows, (0, 11))
        write(rows)
        res = harvest_cli(*run)
        assert res.returncode == 0, res.stdout + res.stderr
        assert (
            f"harvest: run edits holds samples that {data} no longer holds: 2 committed ({KEPT_LINE})\n" in res.stderr
        ), res.stderr
        assert "  samples: 14 done, 0 failed (2 enqueued now, 10 already known)\n" in res.stdout, res.stdout
        assert f"  not in the dataset: 2 committed ({KEPT_LINE})\n" in res.stdout, res.stdout
        assert _committed(str(out / "edits")) == sorted(set(_ids(rows)) | set(_ids(old)))

        # A corrupt copy excluded from its index, extracted again: the summary counts the copy kept.
        docs = _docs(str(out / "edits"))
        whole = sum(d["bytes"] for d in docs)
        victim = _ids(rows)[3]
        flip(
            run_location(str(out), "edits"),
            next(d["shard_id"] for d in docs if victim in d["samples"]),
            victim,
            "hidden_states",
        )
        res = harvest_cli("reconcile", "--run", "edits", "--redis", server.url, "--verify", "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr
        res = harvest_cli(*run)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "  samples: 14 done, 0 failed (0 enqueued now, 12 already known)\n" in res.stdout, res.stdout
        docs = _docs(str(out / "edits"))
        kept = kept_copies(docs).kept
        assert sorted(kept) == sorted(set(_ids(rows)) | set(_ids(old)))
        share = {
            d["shard_id"]: sum(
                t for s, t in zip(d["samples"], d["tokens"], strict=False) if kept.get(s) == d["shard_id"]
            )
            for d in docs
        }
        tokens = sum(share.values())
        nbytes = sum(d["bytes"] * share[d["shard_id"]] // sum(d["tokens"]) for d in docs)
        assert nbytes < sum(d["bytes"] for d in docs)  # the shard holding the excluded copy counts less
        assert sum(d["bytes"] for d in docs) > whole  # the copy extracted again is in a shard of its own
        assert f"  tokens: {tokens}, bytes: {nbytes}, seconds: " in res.stdout, res.stdout
    finally:
        server.stop()
