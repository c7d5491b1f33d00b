import base64
import hashlib
import json

import numpy as np
import pytest

from harvest.ids import InvalidId, check_id, job_id_for, parse_rid, rid_for, sample_id, shard_id_for
from harvest.sample import Sample, SampleError
from harvest.state.payload import PayloadError, decode_batch, encode_batch


def test_sample_id_is_blake2b128_of_int32le_ids_then_mask_bytes():
    ids = np.array([1, 2, 300, 70000], np.int32)
    mask = np.array([0, 1, 1, 0], np.uint8)
    expect = hashlib.blake2b(ids.astype("<i4").tobytes() + mask.tobytes(), digest_size=16).hexdigest()
    assert sample_id(ids, mask) == expect
    assert sample_id(ids, 1 - mask) != expect


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", "a b", "x.y", "é", None, "a" * 201])
def test_check_id_refuses_anything_that_could_escape_a_path(bad):
    with pytest.raises(InvalidId, match=r"must match \[A-Za-z0-9_-\]\+"):
        check_id(bad)


def test_rid_round_trip_and_rejection():
    sid = "0123456789abcdef0123456789abcdef"
    assert parse_rid(rid_for(sid, 3)) == (sid, 3)
    with pytest.raises(InvalidId, match="expected hv-<32 hex>-<attempt>"):
        parse_rid("hv-../../x-1")


def test_job_and_shard_ids_depend_on_order_and_content():
    a, b = "a" * 32, "b" * 32
    assert job_id_for("r", [a, b]) == job_id_for("r", [a, b]) != job_id_for("r", [b, a])
    assert shard_id_for([a, b]) != shard_id_for([a])


def test_payload_round_trip_is_json_with_ids_in_the_fewest_bytes_and_mask_bits():
    big = 1 << 24
    s = [
        Sample.build([5, 6, 70000]),
        Sample.build([9], [0]),
        Sample.build([1, 65535], [1, 0]),
        Sample.build([big, 0, big + 7]),
        Sample.build(list(range(20)), [i % 3 == 0 for i in range(20)]),
    ]
    p = encode_batch("run1", s)
    rows = p["samples"]
    assert [r["w"] for r in rows] == [3, 2, 2, 4, 2]
    assert base64.b64decode(rows[0]["ids"]) == bytes([5, 0, 0, 6, 0, 0, 0x70, 0x11, 0x01])  # 70000 = 0x011170
    assert base64.b64decode(rows[2]["ids"]) == np.array([1, 65535], "<u2").tobytes()
    assert base64.b64decode(rows[3]["ids"]) == np.array([big, 0, big + 7], "<i4").tobytes()
    assert base64.b64decode(rows[4]["bits"]) == bytes([0b01001001, 0b10010010, 0b00000100])  # bit i = token i
    assert json.loads(json.dumps(p)) == p  # JSON all the way
    run, back = decode_batch(p)
    assert run == "run1"
    assert [x.id for x in back] == [x.id for x in s]
    assert [x.input_ids.tolist() for x in back] == [x.input_ids.tolist() for x in s]
    assert [x.loss_mask.tolist() for x in back] == [x.loss_mask.tolist() for x in s]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"w": 5}, "token id width 5 is not 2, 3 or 4"),
        ({"w": 3}, "bytes of 3-byte token ids"),
        ({"bits": base64.b64encode(b"\x01\x00").decode()}, "2 bytes of mask bits for 3 tokens"),
        ({"ids": "not base64!"}, "malformed sample in payload"),
    ],
)
def test_malformed_rows_are_refused(change, message):
    p = encode_batch("r", [Sample.build([5, 6, 7])])
    p["samples"][0].update(change)
    if change.get("w") == 3:
        p["samples"][0]["ids"] = base64.b64encode(b"\x05\x00\x06\x00").decode()
    with pytest.raises(PayloadError, match=message):
        decode_batch(p)


def test_payload_with_id_not_matching_content_is_refused():
    p = encode_batch("run1", [Sample.build([5, 6])])
    p["samples"][0]["id"] = "f" * 32
    with pytest.raises(PayloadError, match=f"sample {'f' * 32} does not match its content"):
        decode_batch(p)


def test_payload_that_is_not_ours_is_refused():
    with pytest.raises(PayloadError, match="not a harvest v2 job payload"):
        decode_batch({"samples": []})
    with pytest.raises(SampleError, match="loss_mask has 1 entries for 2 tokens"):
        Sample.build([1, 2], [1])
