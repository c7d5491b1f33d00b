"""How close to a plain read of the shards does feeding a trainer in place run?

A synthetic run (N samples of `[T, 4, H]` bf16, committed by the real collector into shards of
`--shard-mb`) is read, in one process, from a local output and from moto's S3 server (in its own
process), five ways:

- plain: every shard file read whole, one after the other (`fsspec cat_file`): the floor of any
  reader of those bytes, with no checks and no tensors; then the same with `zlib.crc32` over every
  byte, the ceiling of a reader that verifies what it reads (every harvest feed does: each
  sample's crc32 from its index). From the page cache that ceiling is far below the plain read
  (crc32 runs at ~1.6 GB/s on this machine's cores, a page-cache copy at ~4-5 GB/s): a local feed
  cannot reach 0.8 of plain without dropping its checks, and harvest keeps them;
- harvest's feed: `HiddenStateIterable` (one rank, read-ahead on), in storage order and shuffled
  (seed 0: samples mixed within windows of 4 shards, so fewer of them lie adjacent);
- speculators in place: row after row through the `harvest` hidden-states backend
  (`HarvestTransfer.get_cached`: ranged reads, crc32 checks, the pre-norm last slot), as
  speculators' dataset calls it; also with `--workers` threads, as its DataLoader workers would;
- SpecForge in place: each pointer file loaded as SpecForge loads feature files
  (`load_feature_file`) and its hidden states taken;
- export files: the per-sample files `harvest export` writes, read by the trainers' own loaders
  (hs-connectors' `FileTransfer`, SpecForge's `load_feature_file` with the tensors touched), from
  the local disk where a training machine keeps them.

Every feed hands each sample's hidden states to one copy, as the trainers' collators do (and
safetensors' and torch's memory-mapped files are read only then). Samples/s and MB/s of hidden
states (plain: of shard bytes, nearly all hidden states), the
median of `--repeats`, and each feed's ratio to the plain read of the same storage measured in
the same run (goal >= 0.8). With `--codec` (default blosc2-zstd; `none` skips it) the same
samples are committed a second time with that codec, and harvest's feed and speculators' backend
read that run too: their samples/s against the same feed of the uncoded run (goal >= 0.8), from
the local output and from S3, decoding on the feed's read-ahead thread. The local figures come from the page cache (everything was just
written; nothing drops caches on a shared machine): they compare CPU cost, not the disk. torch
runs one intra-op thread here, as in speculators' DataLoader workers (`_worker_init_fn`): on a
busy machine its small elementwise ops otherwise wait for descheduled pool threads (10x slower).

    python bench/feed.py --samples 64 --tokens 512 --hidden 1024
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import redis  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.collector.collector import Collector  # noqa: E402
from harvest.read.export import export_run  # noqa: E402
from harvest.read.reader import RunReader  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402
from harvest.storage import Location  # noqa: E402
from tests.support.moto import moto_server  # noqa: E402
from tests.support.synth import make_config, spool_samples  # noqa: E402


def fake_checkpoint(where: str, hidden: int) -> str:
    """A checkpoint holding only what the speculators export reads: the final norm (non-unit)."""
    os.makedirs(where)
    with open(os.path.join(where, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "rms_norm_eps": 1e-5, "hidden_size": hidden}, f)
    w = 0.5 + torch.rand(hidden, generator=torch.Generator().manual_seed(0))
    save_file({"model.norm.weight": w.to(torch.bfloat16)}, os.path.join(where, "model.safetensors"))
    return where


def make_run(base: str, args: argparse.Namespace, run: str = "feed", codec: str = "none") -> str:
    server = RedisServer(os.path.join(base, f"redis-{run}"), appendonly=False).start()
    try:
        conn = redis.Redis.from_url(server.url)
        cfg = publish_run(conn, make_config(f"file://{base}/out", run=run, hidden=args.hidden, codec=codec))
        spool = os.path.join(base, "spool")
        ids = [s.id for s in spool_samples(spool, cfg, [args.tokens] * args.samples)]
        ledger = Ledger(conn, cfg.run)
        ledger.add_queued(ids)
        ledger.mark_spooled(ids)
        collector = Collector(conn, cfg, spool, node="bench", shard_bytes=args.shard_mb << 20)
        while collector.step(force=True):
            pass
    finally:
        server.stop()
    shutil.rmtree(os.path.join(base, "spool"), ignore_errors=True)
    return f"{base}/out/{run}"


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn()
    return time.perf_counter() - t, n


def plain(url: str) -> Callable[[], int]:
    loc = Location.from_url(url)

    def read() -> int:
        return sum(len(loc.fs.cat_file(loc.path("shards", name))) for name in loc.list("shards", ".safetensors"))

    return read


def crc_ceiling(url: str) -> Callable[[], int]:
    """The plain read plus zlib.crc32 over every byte: the fastest a feed that verifies what it
    reads (every harvest feed checks each sample's crc32 from the index) can go on this CPU."""
    import zlib

    loc = Location.from_url(url)

    def read() -> int:
        n = 0
        for name in loc.list("shards", ".safetensors"):
            data = loc.fs.cat_file(loc.path("shards", name))
            zlib.crc32(data)
            n += len(data)
        return n

    return read


def harvest_feed(url: str, seed: int | None) -> Callable[[], int]:
    """harvest's own training feed (`HiddenStateIterable`, one rank, read-ahead on), in storage
    order or shuffled; each item's hidden states copied once, as a collator's stack would."""
    from harvest.read.feed import HiddenStateIterable

    def feed() -> int:
        n = 0
        for item in HiddenStateIterable(url, seed=seed):
            for key in ("hidden_state", "aux_hidden_state"):
                t = item[key].clone()
                n += t.numel() * t.element_size()
        return n

    return feed


def speculators_feed(dest: str, run_url: str, rows: int, workers: int) -> Callable[[], int]:
    from harvest.read.speculators_backend import open_transfer

    def feed() -> int:
        transfer = open_transfer(dest, run_url)  # a fresh reader each time: its index reads are counted

        def one(i: int) -> int:
            hs = transfer.get_cached(i)["hidden_states"].clone()  # the collator's copy
            return hs.numel() * hs.element_size()

        if workers == 1:
            return sum(one(i) for i in range(rows))
        with ThreadPoolExecutor(workers) as pool:
            return sum(pool.map(one, range(rows)))

    return feed


def specforge_files(dest: str) -> Callable[[], int]:
    """SpecForge's loader over `dest`: pointer files (hidden states fetched) or the export's .ckpt
    files (memory-mapped: cloned, as its FeatureDataLoader clones on fetch)."""
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    import harvest.read.specforge_feed as feed_mod

    def feed() -> int:
        feed_mod._readers.clear()  # a fresh reader each time, as for the other feeds
        n = 0
        for path in list_feature_files(dest):
            raw = load_feature_file(path)
            for key in ("hidden_state", "aux_hidden_state"):
                t = raw[key].clone()
                n += t.numel() * t.element_size()
        return n

    return feed


def export_files(dest: str, rows: int) -> Callable[[], int]:
    from pathlib import Path

    from hs_connectors import FileTransfer

    def feed() -> int:
        transfer = FileTransfer(Path(dest) / "hidden_states")
        n = 0
        for i in range(rows):
            hs = transfer.get_cached(i)["hidden_states"].clone()  # memory-mapped: read here, as the collator copies
            n += hs.numel() * hs.element_size()
        return n

    return feed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4, help="threads for the parallel speculators feed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="Where to work (default: a temp dir)")
    ap.add_argument("--codec", default="blosc2-zstd", help="the codec of the second run read (none: no second run)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    base = tempfile.mkdtemp(prefix="harvest-feed-", dir=args.dir)
    moto, endpoint = moto_server()
    os.environ.update(
        HARVEST_S3_ENDPOINT=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1"
    )
    try:
        local = make_run(base, args)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="feed-bench")
        s3 = Location.from_url("s3://feed-bench/feed")
        s3.fs.put(local + "/", s3.root + "/", recursive=True)
        coded = {}
        if args.codec != "none":
            coded["local"] = make_run(base, args, "coded", args.codec)
            s3c = Location.from_url("s3://feed-bench/coded")
            s3c.fs.put(coded["local"] + "/", s3c.root + "/", recursive=True)
            coded["s3"] = s3c.url()
            print(f"codec {args.codec}: shards {RunReader(coded['local']).total_bytes() / 1e6:.0f} MB", flush=True)
        model = fake_checkpoint(os.path.join(base, "model"), args.hidden)
        reader = RunReader(local)
        rows = len(reader)
        dests = {}
        for fmt in ("speculators", "specforge"):
            dests[fmt] = os.path.join(base, f"{fmt}-files")
            export_run(local, fmt, dests[fmt], progress=False, model=model)
            for where, url in (("local", local), ("s3", s3.url())):
                dests[fmt, where] = os.path.join(base, f"{fmt}-in-place-{where}")
                export_run(url, fmt, dests[fmt, where], progress=False, model=model, in_place=True)
        for where, url in coded.items():
            dests["coded", where] = os.path.join(base, f"speculators-in-place-coded-{where}")
            export_run(url, "speculators", dests["coded", where], progress=False, model=model, in_place=True)
        shard_bytes = reader.total_bytes()
        print(
            f"run: {rows} samples of [{args.tokens}, 4, {args.hidden}] bf16 "
            f"({rows and reader.total_bytes() / rows / 1e6:.1f} MB each), {len(reader.shard_ids())} shards, "
            f"{shard_bytes / 1e6:.0f} MB; {args.repeats} repeats, medians",
            flush=True,
        )

        cases: list[tuple[str, str, Callable[[], int]]] = []
        for where, url in (("local", local), ("s3", s3.url())):
            cases += [
                (where, "plain read of the shards (cat_file)", plain(url)),
                (where, "  the same with crc32 of every byte", crc_ceiling(url)),
                (where, "harvest feed (HiddenStateIterable)", harvest_feed(url, None)),
                (where, "harvest feed, shuffled (seed 0)", harvest_feed(url, 0)),
                (
                    where,
                    "speculators in place (harvest backend)",
                    speculators_feed(dests["speculators", where], url, rows, 1),
                ),
                (
                    where,
                    f"speculators in place, {args.workers} threads",
                    speculators_feed(dests["speculators", where], url, rows, args.workers),
                ),
                (where, "SpecForge in place (pointer files)", specforge_files(dests["specforge", where])),
            ]
        for where, url in coded.items():  # the same samples, coded: against the rows above of the same name
            cases += [
                (where, f"harvest feed (HiddenStateIterable), {args.codec}", harvest_feed(url, None)),
                (where, f"harvest feed, shuffled (seed 0), {args.codec}", harvest_feed(url, 0)),
                (
                    where,
                    f"speculators in place (harvest backend), {args.codec}",
                    speculators_feed(dests["coded", where], url, rows, 1),
                ),
            ]
        cases += [
            ("local", "speculators export files (FileTransfer)", export_files(dests["speculators"], rows)),
            ("local", "SpecForge export files (load_feature_file)", specforge_files(dests["specforge"])),
        ]
        times: dict[tuple[str, str], list[float]] = {}
        nbytes: dict[tuple[str, str], int] = {}
        for _ in range(args.repeats):
            for where, name, fn in cases:
                dt, n = timed(fn)
                times.setdefault((where, name), []).append(dt)
                nbytes[where, name] = n
        for where in ("local", "s3"):
            print(f"\n{where}:")
            base_mbs = None
            for (w, name), ts in times.items():
                if w != where:
                    continue
                t = statistics.median(ts)
                mbs = nbytes[w, name] / t / 1e6
                base_mbs = base_mbs or mbs  # the plain read comes first
                line = f"  {name:46s} {rows / t:8.1f} samples/s {mbs:9.1f} MB/s   {mbs / base_mbs:5.2f} x plain"
                uncoded = name.removesuffix(f", {args.codec}")
                if uncoded != name:
                    line += f"   {statistics.median(times[w, uncoded]) / t:5.2f} x uncoded"
                print(line)
    finally:
        moto.terminate()
        moto.wait()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
