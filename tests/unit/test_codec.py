"""Runs whose hidden states are coded (`--codec blosc2-zstd`) read exactly as runs without a codec:
the same samples, committed by the real collector (real Redis) to a local folder and to S3 (moto's
server), come back bit-identical from every reader (ranged reads, both datasets, the live feed,
speculators' in-place backend), in each storage dtype, with samples coded in several blosc2
chunks; a byte flipped in a sample's coded bytes fails that sample alone, named, and `harvest
reconcile --verify` finds it; `harvest ratio` tells what the codec saved."""

from __future__ import annotations

import json
import os
import pickle
import threading
import zlib

import pytest
import torch

from harvest.collector.collector import Collector
from harvest.formats import codec
from harvest.formats.index import CODED_FORMAT, FORMAT, INDEX, index_file, parse_index
from harvest.formats.settled import write_settled
from harvest.formats.shard import shard_file
from harvest.ops.ratio import run_ratio
from harvest.ops.verify import Corruption, verify_run
from harvest.read.dataset import HiddenStateDataset
from harvest.read.feed import HiddenStateIterable
from harvest.read.reader import RunReader
from harvest.read.shard_reader import CorruptSample, ShardReader
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.storage import Location
from tests.support.feedrun import FeedRun
from tests.support.need import need_module
from tests.support.synth import make_config, spool_samples
from tests.support.wait import wait_for
from tests.unit.test_integrity import make_run

LENGTHS = [30, 5, 70, 1, 12, 50, 9]
CODED = "blosc2-zstd"


def _collected(conn, tmp_path, out_url: str, run: str, dtype: str, codec_name: str):
    """The LENGTHS samples spooled and committed by a collector (shards of about 3 samples) into
    run `run` of `out_url`; returns (the run's folder, the samples as spooled)."""
    cfg = publish_run(conn, make_config(out_url, run=run, dtype=dtype, hidden=64, codec=codec_name))
    spool = str(tmp_path / f"spool-{run}")
    samples = spool_samples(spool, cfg, LENGTHS)
    ledger = Ledger(conn, run)
    ids = [s.id for s in samples]
    ledger.add_queued(ids)
    ledger.mark_spooled(ids)
    c = Collector(
        conn, cfg, spool, node="n1", shard_bytes=3 * os.path.getsize(os.path.join(spool, f"{ids[0]}.safetensors"))
    )
    while c.step(force=True):
        pass
    assert ledger.counts()["done"] == len(LENGTHS)
    assert [n for n in os.listdir(spool) if n != ".spool-id"] == []  # no scratch file left behind
    return Location.from_url(out_url).child(run), samples


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: dict, b: dict) -> bool:
    """Two samples (or training items) as readers hand them out: the same keys, tensors equal bit for bit."""
    return a.keys() == b.keys() and all(
        torch.equal(_bits(a[k]), _bits(b[k])) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8_e4m3"])
def test_a_coded_run_reads_bit_identical_to_one_without_a_codec(conn, tmp_path, request, monkeypatch, where, dtype):
    monkeypatch.setattr(codec, "PIECE_BYTES", 4096)  # the longer samples coded in several blosc2 chunks
    out = request.getfixturevalue("s3_bucket") if where == "s3" else f"file://{tmp_path / 'out'}"
    plain, samples = _collected(conn, tmp_path, out, "plain", dtype, "none")
    coded, _ = _collected(conn, tmp_path, out, "coded", dtype, CODED)
    docs = [parse_index(coded.read_json(f"{INDEX}/{n}"), n) for n in coded.list(INDEX, ".json")]
    assert len(docs) > 1 and {d["format"] for d in docs} == {CODED_FORMAT} and {d["codec"] for d in docs} == {CODED}
    assert all(parse_index(plain.read_json(f"{INDEX}/{n}"), n)["format"] == FORMAT for n in plain.list(INDEX, ".json"))
    long = next(d for d in docs if LENGTHS[2] in d["tokens"])
    i = long["tokens"].index(LENGTHS[2])
    assert long["coded_offsets"][i + 1] - long["coded_offsets"][i] > 2 * 4096 * 0.5  # several chunks

    url = {p: loc.root if loc.is_local else loc.url() for p, loc in (("plain", plain), ("coded", coded))}
    readers = {p: RunReader(u) for p, u in url.items()}
    for s in samples:
        a, b = readers["plain"].get(s.id), readers["coded"].get(s.id)
        assert _same(a, b)
        assert torch.equal(_bits(b["hidden_states"]), _bits(s.hidden_states))
        if dtype == "fp8_e4m3":
            assert torch.equal(b["hidden_scale"], s.hidden_scale)
            assert torch.equal(
                _bits(readers["coded"].get(s.id, torch.bfloat16)["hidden_states"]),
                _bits(readers["plain"].get(s.id, torch.bfloat16)["hidden_states"]),
            )
    reader = ShardReader(coded, docs[0])
    n = docs[0]["offsets"][-1]
    whole = torch.cat([RunReader(url["plain"]).get(sid)["hidden_states"] for sid in docs[0]["samples"]])
    assert torch.equal(
        _bits(reader.rows("hidden_states", 1, n - 1)), _bits(whole[1 : n - 1])
    )  # ranges that cut samples

    ds = {p: HiddenStateDataset(u) for p, u in url.items()}  # storage orders differ: shard names are random
    assert sorted(ds["plain"].sample_ids) == sorted(ds["coded"].sample_ids)
    for k, sid in enumerate(ds["coded"].sample_ids):
        assert _same(ds["plain"][ds["plain"].sample_ids.index(sid)], ds["coded"][k])
    feeds = {p: {tuple(x["input_ids"].tolist()): x for x in HiddenStateIterable(u, seed=3)} for p, u in url.items()}
    assert len(feeds["coded"]) == len(samples) and feeds["plain"].keys() == feeds["coded"].keys()
    for key, b in feeds["coded"].items():
        assert _same(feeds["plain"][key], b)

    r = run_ratio(coded)
    assert (r.codec, r.shards, r.tokens) == (CODED, len(docs), sum(LENGTHS))
    assert r.hidden_stored == sum(d["coded_offsets"][-1] for d in docs) and r.hidden_ratio > 1.0
    assert r.shard_bytes == sum(d["bytes"] for d in docs)
    assert run_ratio(plain).hidden_ratio == 1.0 and run_ratio(plain).codec == "none"


def _flip_coded(loc: Location, shard_id: str, sample_id: str) -> tuple[int, int]:
    """Flip one byte in the middle of `sample_id`'s coded hidden states; returns their byte range."""
    doc = parse_index(loc.read_json(index_file(shard_id)), "i")
    i = doc["samples"].index(sample_id)
    span = ShardReader(loc, doc).tensors["hidden_states"]
    begin, end = span.begin + doc["coded_offsets"][i], span.begin + doc["coded_offsets"][i + 1]
    data = bytearray(loc.read_bytes(shard_file(shard_id)))
    data[(begin + end) // 2] ^= 0x10
    loc.write_atomic(shard_file(shard_id), bytes(data))
    return begin, end


@pytest.mark.parametrize("at", ["middle", "header"])
def test_a_flipped_coded_byte_fails_that_sample_alone_named_and_verify_finds_it(tmp_path, at):
    _, loc, samples, (a, b) = make_run(tmp_path, [[0, 1, 2], [3, 4]], codec=CODED)
    victim = samples[1]
    if at == "middle":
        begin, end = _flip_coded(loc, a, victim.id)
    else:  # the first chunk's header: blosc2 itself refuses it
        doc = parse_index(loc.read_json(index_file(a)), "i")
        i = doc["samples"].index(victim.id)
        begin = ShardReader(loc, doc).tensors["hidden_states"].begin + doc["coded_offsets"][i]
        end = begin + doc["coded_offsets"][i + 1] - doc["coded_offsets"][i]
        data = bytearray(loc.read_bytes(shard_file(a)))
        data[begin + 12] ^= 0x40  # inside the chunk's coded size
        loc.write_atomic(shard_file(a), bytes(data))
    reader = RunReader(loc.root)
    with pytest.raises(CorruptSample) as e:
        reader.get(victim.id)
    err = e.value
    assert (err.sample_id, err.shard_id, err.tensor, err.begin, err.end) == (victim.id, a, "hidden_states", begin, end)
    assert str(err).startswith(
        f"{loc.path(shard_file(a))}: sample {victim.id} is corrupt: tensor hidden_states, "
        f"bytes [{begin}, {end}) of the shard "
    )
    assert str(err).endswith(
        f"run `harvest reconcile --verify --run r --out {os.path.dirname(loc.root)}` to drop it "
        "from the index and extract it again"
    )
    assert "decode" in err.problem
    if err.expected is not None:  # it decoded, to other bytes: its crc32 says so
        assert err.expected == zlib.crc32(_bits(victim.hidden_states).numpy().tobytes()) != err.found
    for s in samples[:5]:
        if s is not victim:
            assert torch.equal(_bits(reader.get(s.id)["hidden_states"]), _bits(s.hidden_states))
    ids, mask = reader.tokens(victim.id)  # its tokens are sound
    assert torch.equal(ids, victim.input_ids) and torch.equal(mask, victim.loss_mask)
    got = [item["input_ids"].tolist() for item in HiddenStateIterable(loc.root)]
    assert sorted(got) == sorted(s.input_ids.long().tolist() for s in samples[:5] if s is not victim)
    rep = verify_run(loc)
    assert rep.corrupt == [Corruption(a, victim.id, "hidden_states", begin, end, err.problem)]


def test_the_live_feed_reads_a_coded_run_as_it_grows(tmp_path):
    run = FeedRun(tmp_path, 16, hidden=64, codec=CODED)
    by_id = {s.id: s for s in run.samples}
    run.commit_sizes([4, 3])
    got, errors = [], []

    def train() -> None:
        try:
            got.extend(HiddenStateIterable(run.url, seed=1, follow=True, poll_s=0.05, wait_s=60))
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    t = threading.Thread(target=train, daemon=True)
    t.start()
    wait_for(lambda: len(got) == 7, 60, "the committed samples read")
    run.commit_sizes([5, 4], start=7)
    write_settled(run.loc, run.cfg.run, 16, 0)
    t.join(60)
    assert not t.is_alive() and errors == []
    assert sorted(run.sid(item) for item in got) == sorted(run.ids)
    for item in got:  # the EAGLE-3 item: the final state (last capture point) and the others side by side
        hs = by_id[run.sid(item)].hidden_states
        assert torch.equal(_bits(item["hidden_state"]), _bits(hs[:, -1]))
        assert torch.equal(_bits(item["aux_hidden_state"]), _bits(hs[:, :-1].reshape(hs.shape[0], -1)))


def test_speculators_in_place_rows_of_a_coded_run_are_the_export_files_of_one_without(tmp_path):
    need_module("hs_connectors", "hs-connectors 0.9.0", "install it with scripts/trainer_pkgs.sh")
    from safetensors.torch import load_file

    from harvest.read.export import _atomic
    from harvest.read.speculators import MANIFEST, export_speculators, hs_file
    from harvest.read.speculators_backend import open_transfer
    from tests.unit.test_in_place_feed import NORM

    groups = [[0, 1, 2], [3, 4, 5]]
    _, plain, _, _ = make_run(tmp_path / "plain", groups)
    _, coded, _, _ = make_run(tmp_path / "coded", groups, codec=CODED)
    full, small = str(tmp_path / "full"), str(tmp_path / "small")
    assert export_speculators(RunReader(plain.root), full, None, NORM, _atomic, progress=False)[:2] == (6, 0)
    assert export_speculators(RunReader(coded.root), small, None, NORM, _atomic, progress=False, in_place=True)[:2] == (
        6,
        0,
    )
    transfer = pickle.loads(pickle.dumps(open_transfer(small)))
    for row in range(6):
        got, want = transfer.get_cached(row), load_file(hs_file(full, row))
        assert got.keys() == want.keys() and all(torch.equal(_bits(got[k]), _bits(want[k])) for k in got), row
    assert json.load(open(os.path.join(small, MANIFEST)))["run_url"] == coded.url()
