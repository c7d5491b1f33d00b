import torch

from harvest.shard import ShardReader, build_shard, index_file, shard_file
from harvest.spool import SpooledSample
from harvest.storage import Location


def _sample(i: int, n: int) -> SpooledSample:
    g = torch.Generator().manual_seed(i)
    return SpooledSample(
        f"{i:032x}",
        torch.randint(0, 500, (n,), generator=g, dtype=torch.int32),
        torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8),
        torch.randn(n, 3, 8, generator=g).to(torch.bfloat16),
    )


def test_shard_round_trip_by_byte_ranges(tmp_path):
    samples = [_sample(i, n) for i, n in enumerate([1, 17, 5])]
    sid, data, index = build_shard(samples, "r", [2, 4, 8])
    loc = Location.from_url(str(tmp_path))
    loc.write_atomic(shard_file(sid), data)
    loc.write_atomic(index_file(sid), b"{}")
    assert index["offsets"] == [0, 1, 18, 23] and index["samples"] == [s.id for s in samples]
    r = ShardReader(loc, index)
    for i, s in enumerate(samples):
        got = r.sample(i)
        assert torch.equal(got["input_ids"], s.input_ids)
        assert torch.equal(got["loss_mask"], s.loss_mask)
        assert torch.equal(got["hidden_states"], s.hidden_states)


def test_same_samples_same_bytes():
    a = build_shard([_sample(1, 4), _sample(2, 3)], "r", [1])
    b = build_shard([_sample(1, 4), _sample(2, 3)], "r", [1])
    assert a[0] == b[0] and a[1] == b[1]
