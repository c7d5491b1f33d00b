"""The regeneration stage's payload and files: a chat row cut into the pieces around its assistant
turns (checked against transformers' own rendering of each prefix), the conversation's id, its
journey through a job payload, the splice of generated turns, and the generated-dataset file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from harvest.formats.generated import decode_generated, encode_generated, entry
from harvest.formats.index import ShardError
from harvest.producer.rows import BadRow, Row
from harvest.producer.tokenize import RowTokenizer
from harvest.sample import Sample
from harvest.state.conversation import Conversation, ConversationError, turn_seed
from harvest.state.payload import PayloadError, decode_batch, encode_batch, payload_rows
from tests.support.cli import REPO

CHAT = [
    {"role": "system", "content": "short"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "second"},
    {"role": "assistant", "content": "second answer"},
]


def test_a_chat_is_cut_into_the_template_pieces_around_its_turns(tokenizer):
    rt = RowTokenizer(tokenizer, regenerate=True)
    s = rt.one(Row({"messages": CHAT}, "d:1"))
    assert isinstance(s, Sample) and s.conv is not None and s.conv.turns == 2
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    pieces = [tokenizer.decode(p) for p in s.conv.pieces(s.input_ids)]
    assert pieces[0] == render(CHAT[:2], gen=True)  # up to the first turn's header
    assert pieces[1] == render(CHAT[:4], gen=True)[len(render(CHAT[:3])) :]  # after its <|im_end|>, to the next header
    assert pieces[2] == render(CHAT)[len(render(CHAT)) :]  # nothing follows the last turn in this template
    assert s.conv.stop == tuple(sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}))
    assert s.conv.close == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the template's end-of-turn, not EOS
    assert not s.loss_mask.any()
    assert [m["content"] for m in s.conv.messages] == ["short", "first question", None, "second", None]
    # The answers the row brought are written again: they do not change the sample.
    other = [{**m, "content": "something else"} if m["role"] == "assistant" else m for m in CHAT]
    assert rt.one(Row({"messages": other}, "d:2")).id == s.id


def test_a_chat_ending_on_a_user_turn_gets_one_turn_to_write_and_other_rows_are_refused(tokenizer):
    rt = RowTokenizer(tokenizer, regenerate=True)
    s = rt.one(Row({"messages": CHAT[:2]}, "d:1"))
    assert s.conv.turns == 1 and [m["role"] for m in s.conv.messages] == ["system", "user", "assistant"]
    bad = rt.one(Row({"text": "plain text"}, "d:2"))
    assert isinstance(bad, BadRow) and bad.kind == "bad"
    assert str(bad) == (
        "d:2: --regenerate writes the assistant turns of chat rows ('messages' or 'conversations'); "
        "this row is text, with none"
    )


def test_a_conversation_travels_in_a_payload_and_its_id_covers_its_structure(tokenizer):
    s = RowTokenizer(tokenizer, regenerate=True).one(Row({"messages": CHAT}, "d:1"))
    payload = encode_batch("r", [s])
    _, (back,) = decode_batch(json.loads(json.dumps(payload)))
    assert back.id == s.id and back.conv == s.conv and back.input_ids.tolist() == s.input_ids.tolist()
    assert json.loads(payload_rows(payload)[0])["conv"] == s.conv.to_json()  # kept with spooled and failed samples
    tampered = json.loads(json.dumps(payload))
    cuts = tampered["samples"][0]["conv"]["cuts"]
    cuts[0], cuts[1] = cuts[0] - 1, cuts[1] + 1  # the same tokens, cut elsewhere
    with pytest.raises(PayloadError, match=f"sample {s.id} does not match its content"):
        decode_batch(tampered)
    dropped = json.loads(json.dumps(payload))
    del dropped["samples"][0]["conv"]  # what a worker from before regeneration would read
    with pytest.raises(PayloadError, match="does not match its content"):
        decode_batch(dropped)


def test_splice_puts_each_turn_between_its_pieces_and_masks_exactly_the_turns():
    conv = Conversation(
        (3, 2, 1), (9, 11), ({"role": "user"}, {"role": "assistant"}, {"role": "user"}, {"role": "assistant"}), 9
    )
    s = Sample.build([1, 2, 3, 4, 5, 6], [0] * 6, conv)
    pieces = conv.pieces(s.input_ids)
    prompt, _ = conv.splice(pieces, [])
    assert prompt.tolist() == [1, 2, 3]
    prompt, _ = conv.splice(pieces, [[7, 11]])
    assert prompt.tolist() == [1, 2, 3, 7, 11, 4, 5]  # a turn the model ended keeps its own stop token
    ids, mask = conv.splice(pieces, [[7, 9], [8, 8, 9]])
    assert ids.tolist() == [1, 2, 3, 7, 9, 4, 5, 8, 8, 9, 6]
    assert mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0]
    # a turn cut at max_new_tokens is closed by the template's end-of-turn token, which the model did not write
    prompt, mask = conv.splice(pieces, [[7, 7]])
    assert prompt.tolist() == [1, 2, 3, 7, 7, 9, 4, 5] and mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    with pytest.raises(ConversationError, match=r"the end-of-turn token 10 is not one of the stop tokens \[9, 11\]"):
        Conversation((3, 2, 1), (9, 11), conv.messages, 10)
    done = s.regenerated(ids, mask)
    assert done.id == s.id and done.conv is None
    assert turn_seed(s.id, 0) == turn_seed(s.id, 0) != turn_seed(s.id, 1)
    assert 0 <= turn_seed(s.id, 1) < 2**31


def test_the_generated_file_round_trips_and_is_checked_against_its_index():
    rows = [
        {
            "id": "a" * 32,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}],
            "turns": [{"tokens": [5, 6, 4], "finish_reason": "stop", "seed": 7, "prompt_tokens": 12}],
        },
        {
            "id": "b" * 32,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "parts"}]},
                {"role": "assistant", "content": "s"},
            ],
            "turns": [{"tokens": [8], "finish_reason": "length", "seed": 9, "prompt_tokens": 3}],
        },
    ]
    data = encode_generated(rows)
    e = entry("generated/x.parquet", data, 2)
    back = decode_generated(data, "generated/x.parquet", e["sha256"])
    assert back[0] == rows[0]
    assert back[1]["messages"][0]["content"] == '[{"type": "text", "text": "parts"}]'  # structured content as JSON
    with pytest.raises(ShardError, match="generated file generated/x.parquet: its sha256 is not the one its index"):
        decode_generated(data[:-1] + b"\0", "generated/x.parquet", e["sha256"])
    with pytest.raises(ShardError, match="not a readable Parquet file"):
        decode_generated(b"not parquet", "generated/x.parquet")
    assert np.array_equal(np.frombuffer(data[:4], np.uint8), np.frombuffer(b"PAR1", np.uint8))


def test_reading_the_generated_dataset_of_a_run_without_it_is_refused_by_name(tmp_path):
    from harvest.formats.runfile import publish_run_json
    from harvest.read.generated import NotRegenerated, iter_generated
    from tests.support.synth import make_config

    cfg = make_config(f"file://{tmp_path}/out", run="plain")
    publish_run_json(cfg)
    with pytest.raises(NotRegenerated) as e:
        iter_generated(f"file://{tmp_path}/out/plain")  # refused at the call, before any row is asked for
    assert str(e.value) == (
        f"run plain in file://{tmp_path}/out/plain was not started with --regenerate: the target "
        "model wrote none of its answers, so it has no generated conversations"
    )


def test_reading_a_generated_file_starts_no_native_thread():
    """Arrow's pool threads alive at interpreter exit aborted `harvest generated` after it had
    written its output (exit 134, now and then: apache/arrow#34314). A generated file is read on
    the calling thread: the process's threads (native ones too, /proc/<pid>/task) are as many after
    the read as before. In a fresh interpreter, so no earlier test's pool is counted."""
    code = """if True:
        import os
        from harvest.formats.generated import decode_generated, encode_generated
        data = encode_generated([{"id": "a" * 32, "messages": [{"role": "user", "content": "q"}],
                                  "turns": [{"tokens": [5], "finish_reason": "stop", "seed": 7, "prompt_tokens": 1}]}])
        before = len(os.listdir("/proc/self/task"))
        assert decode_generated(data, "generated/x.parquet")[0]["id"] == "a" * 32
        print(before, len(os.listdir("/proc/self/task")))
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    before, after = res.stdout.split()
    assert after == before
