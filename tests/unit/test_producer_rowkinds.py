"""Every row kind, token by token with its loss mask; configurable field names; length policy; bad rows."""

import numpy as np
import pytest

from harvest.ids import sample_id
from harvest.producer.rowkinds import FieldMap
from harvest.producer.rows import BadRow, Row
from harvest.producer.tokenize import LengthPolicy, RowTokenizer


def enc(tok, text, special=False):
    return tok.backend_tokenizer.encode(text, add_special_tokens=special).ids


def pairs(s):
    return s.input_ids.tolist(), s.loss_mask.tolist()


def test_input_ids_with_and_without_mask(tokenizer):
    t = RowTokenizer(tokenizer)
    s = t.one(Row({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, "f:1"))
    assert pairs(s) == ([5, 6, 7], [0, 1, 1])
    assert s.id == sample_id(np.array([5, 6, 7]), np.array([0, 1, 1]))
    assert pairs(t.one(Row({"input_ids": [5, 6, 7]}, "f:2"))) == ([5, 6, 7], [1, 1, 1])


def test_text_masks_everything(tokenizer):
    s = RowTokenizer(tokenizer).one(Row({"text": "the model reads"}, "f:1"))
    ids = tokenizer("the model reads")["input_ids"]
    assert pairs(s) == (ids, [1] * len(ids))


def test_truncation_or_padding_in_tokenizer_json_never_cuts_or_pads_a_sample(tiny_model):
    """A tokenizer.json that truncates (or pads) would silently cut samples: harvest encodes with
    a private copy that does neither, and leaves the caller's tokenizer as it was."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = " ".join(["the model reads"] * 20)
    full = tok.backend_tokenizer.encode(text).ids
    tok.backend_tokenizer.enable_truncation(max_length=5)
    tok.backend_tokenizer.enable_padding(length=200, pad_id=0)
    t = RowTokenizer(tok)
    assert t.backend is not tok.backend_tokenizer
    assert pairs(t.one(Row({"text": text}, "f:1"))) == (full, [1] * len(full))
    assert tok.backend_tokenizer.truncation["max_length"] == 5 and tok.backend_tokenizer.padding["length"] == 200
    plain = AutoTokenizer.from_pretrained(tiny_model)
    assert RowTokenizer(plain).backend is plain.backend_tokenizer  # nothing to turn off: no copy


@pytest.mark.parametrize("key", ["completion", "response"])
def test_prompt_completion_masks_the_completion_and_eos(tokenizer, key):
    s = RowTokenizer(tokenizer).one(Row({"prompt": "the model", key: " reads a token"}, "f:1"))
    p, c = enc(tokenizer, "the model", True), enc(tokenizer, " reads a token")
    eos = tokenizer.eos_token_id
    assert pairs(s) == (p + c + [eos], [0] * len(p) + [1] * (len(c) + 1))


def test_conversational_prompt_completion_uses_the_chat_template(tokenizer):
    prompt = [{"role": "user", "content": "hi"}]
    completion = [{"role": "assistant", "content": "the model"}]
    a = RowTokenizer(tokenizer).one(Row({"prompt": prompt, "completion": completion}, "f:1"))
    b = RowTokenizer(tokenizer).one(Row({"messages": prompt + completion}, "f:2"))
    assert pairs(a) == pairs(b)


def test_messages_with_row_level_system(tokenizer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the model"}]
    t = RowTokenizer(tokenizer)
    s = t.one(Row({"system": "Be brief.", "messages": msgs}, "f:1"))
    full = [{"role": "system", "content": "Be brief."}, *msgs]
    ref = tokenizer.apply_chat_template(full, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert pairs(s) == (list(ref["input_ids"]), list(ref["assistant_masks"]))
    masked = tokenizer.decode([i for i, m in zip(*pairs(s), strict=False) if m])
    assert masked == "the model<|im_end|>"
    # a chat that already starts with a system message keeps its own
    own = t.one(Row({"system": "ignored", "messages": full}, "f:2"))
    assert pairs(own) == pairs(s)


def test_sharegpt_conversations_map_to_roles(tokenizer):
    conv = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "the model"},
        {"from": "human", "value": "and?"},
        {"from": "gpt", "value": "a data token."},
    ]
    msgs = [
        {"role": {"human": "user", "gpt": "assistant"}.get(c["from"], c["from"]), "content": c["value"]} for c in conv
    ]
    t = RowTokenizer(tokenizer)
    assert pairs(t.one(Row({"conversations": conv}, "f:1"))) == pairs(t.one(Row({"messages": msgs}, "f:2")))
    s = t.one(Row({"conversations": conv[1:], "system": "Be brief."}, "f:3"))
    assert pairs(s) == pairs(t.one(Row({"messages": msgs}, "f:2")))


def test_content_parts_are_joined(tokenizer):
    t = RowTokenizer(tokenizer)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
        {"role": "assistant", "content": "the model"},
    ]
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the model"}]
    assert pairs(t.one(Row({"messages": parts}, "f:1"))) == pairs(t.one(Row({"messages": plain}, "f:1")))


def test_field_names_are_configurable(tokenizer):
    fields = FieldMap.parse(["text=content", "messages=dialog", "input_ids=tokens", "loss_mask=labels_mask"])
    t = RowTokenizer(tokenizer, fields=fields)
    assert pairs(t.one(Row({"content": "the model"}, "f:1"))) == pairs(
        RowTokenizer(tokenizer).one(Row({"text": "the model"}, "f:1"))
    )
    assert pairs(t.one(Row({"tokens": [7, 8], "labels_mask": [0, 1]}, "f:2"))) == ([7, 8], [0, 1])
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the model"}]
    assert pairs(t.one(Row({"dialog": msgs}, "f:3"))) == pairs(
        RowTokenizer(tokenizer).one(Row({"messages": msgs}, "f:3"))
    )
    assert str(t.one(Row({"text": "x"}, "f:4"))) == (
        "f:4: no usable field: expected one of tokens, dialog, conversations, prompt, content; got ['text']"
    )
    with pytest.raises(ValueError, match=r"--field 'txt=content': unknown field 'txt'"):
        FieldMap.parse(["txt=content"])
    with pytest.raises(ValueError, match=r"expected LOGICAL=COLUMN"):
        FieldMap.parse(["text"])


def test_length_policy(tokenizer):
    row = Row({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, "f:7")
    skip = RowTokenizer(tokenizer, length=LengthPolicy(max_len=3))
    r = skip.one(row)
    assert isinstance(r, BadRow) and r.kind == "overlong"
    assert str(r) == "f:7: 4 tokens, over --max-len 3 (--overlong skip)"
    trunc = RowTokenizer(tokenizer, length=LengthPolicy(max_len=3, overlong="truncate"))
    assert pairs(trunc.one(row)) == ([5, 6, 7], [0, 0, 1]) and trunc.truncated == 1
    assert pairs(skip.one(Row({"input_ids": [5, 6, 7]}, "f:8"))) == ([5, 6, 7], [1, 1, 1])
    with pytest.raises(ValueError, match="--overlong must be one of skip, truncate, fail, got 'drop'"):
        LengthPolicy(overlong="drop")


def test_empty_samples_are_reported(tokenizer):
    t = RowTokenizer(tokenizer)
    for data in ({"text": ""}, {"input_ids": []}):
        r = t.one(Row(data, "f:1"))
        assert isinstance(r, BadRow) and r.kind == "empty" and str(r) == "f:1: empty sample (0 tokens)"


@pytest.mark.parametrize(
    "data,msg",
    [
        ({"input_ids": [1, 99999]}, "token id 99999 ('input_ids'[1]) outside the vocabulary [0, 512)"),
        ({"input_ids": [-1, 2]}, "token id -1 ('input_ids'[0]) outside the vocabulary [0, 512)"),
        ({"input_ids": "1 2"}, "'input_ids' must be a list of integers (token ids), got str"),
        ({"input_ids": None}, "'input_ids' must be a list of integers (token ids), got null"),
        (
            {"input_ids": [1.5, 2]},
            "'input_ids' must be a list of integers (token ids): 'input_ids'[0] is 1.5 (a number with a fraction)",
        ),
        ({"input_ids": [[1], [2]]}, "'input_ids' must be a list of integers (token ids): 'input_ids'[0] is a list"),
        (
            {"input_ids": [5, True, 7]},
            "'input_ids' must be a list of integers (token ids): 'input_ids'[1] is true (a boolean, not an integer)",
        ),
        (
            {"input_ids": [5, "6"]},
            "'input_ids' must be a list of integers (token ids): 'input_ids'[1] is '6' (a string)",
        ),
        (
            {"input_ids": [5, 10**30]},
            "token id 1000000000000000000000000000000 ('input_ids'[1]) outside the vocabulary [0, 512)",
        ),
        ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "'loss_mask' must be a list of 0 and 1: 'loss_mask'[1] is 2"),
        (
            {"input_ids": [1, 2], "loss_mask": [1, None]},
            "'loss_mask' must be a list of 0 and 1: 'loss_mask'[1] is null",
        ),
        (
            {"input_ids": [1, 2], "loss_mask": [1.0, 0]},
            "'loss_mask' must be a list of 0 and 1: 'loss_mask'[0] is 1.0 (a number with a fraction)",
        ),
        ({"input_ids": [1, 2], "loss_mask": {"a": 1}}, "'loss_mask' must be a list of 0 and 1, got dict"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "'loss_mask' has 1 entries for 2 tokens"),
        ({"text": 5}, "'text' must be a string, got int"),
        ({"text": None}, "'text' must be a string, got null"),
        ({"text": "ab\ud800c"}, "'text' is not valid Unicode: a lone surrogate '\\ud800' at character 2"),
        (
            {"prompt": "a", "completion": "\udfff"},
            "'completion' is not valid Unicode: a lone surrogate '\\udfff' at character 0",
        ),
        (
            {"messages": [{"role": "user", "content": "hi \ud800"}]},
            "'messages'[0] content is not valid Unicode: a lone surrogate '\\ud800' at character 3",
        ),
        (
            {"conversations": [{"from": "human", "value": [{"type": "text", "text": "\ud800"}]}]},
            "'conversations'[0] content is not valid Unicode: a lone surrogate '\\ud800' at character 0",
        ),
        ({"prompt": "a"}, "'prompt' without 'completion' or 'response'"),
        ({"prompt": "a", "completion": ["x"]}, "'completion' must be a string, got list"),
        ({"messages": []}, "'messages' must be a non-empty list of messages, got an empty list"),
        ({"messages": "hi"}, "'messages' must be a non-empty list of messages, got str"),
        ({"messages": ["hi"]}, "'messages'[0] must be an object, got str"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "'messages'[0] has role 'robot'; expected one of system, user, assistant, tool",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, "'messages'[0] content must be a string, got int"),
        (
            {"conversations": [{"from": "alien", "value": "x"}]},
            "'conversations'[0] has from 'alien'; expected one of "
            "system, human, user, gpt, assistant, model, chatgpt, bard, tool, function, observation, function_response, ipython",
        ),
        ({"system": 1, "messages": [{"role": "user", "content": "x"}]}, "'system' must be a string, got int"),
        ({"foo": 1}, "no usable field: expected one of input_ids, messages, conversations, prompt, text; got ['foo']"),
        ([1, 2], "row is a list, expected an object"),
        ("x", "row is a str, expected an object"),
    ],
)
def test_bad_rows_are_reported_with_their_place(tokenizer, data, msg):
    r = RowTokenizer(tokenizer).one(Row(data, "d.jsonl:12"))
    assert isinstance(r, BadRow) and r.kind == "bad"
    assert str(r) == f"d.jsonl:12: {msg}"


def test_a_batch_mixes_kinds_and_keeps_row_order(tokenizer):
    t = RowTokenizer(tokenizer)
    rows = [
        Row({"text": "the model"}, "f:1"),
        BadRow("f:2", "invalid JSON (x)"),
        Row({"prompt": "the", "completion": " model"}, "f:3"),
        Row({"foo": 1}, "f:4"),
        Row({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}, "f:5"),
        Row({"input_ids": [9]}, "f:6"),
    ]
    out = t(rows)
    assert [type(o).__name__ for o in out] == ["Sample", "BadRow", "Sample", "BadRow", "Sample", "Sample"]
    assert [pairs(out[i]) for i in (0, 2, 4, 5)] == [pairs(t.one(rows[i])) for i in (0, 2, 4, 5)]
