"""What a dataset row means: pre-tokenized ids, plain text, prompt + completion, or a chat.

Datasets name their columns differently, so every field the producer reads has a logical
name (below) that `--field logical=actual` can point at another column. A row is classified
by the first of these that it has: `input_ids`, `messages`, `conversations`, `prompt`,
`text`. Anything malformed raises `RowError` with a message that names the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from harvest.errors import ConfigurationError, InputError

FIELDS = (
    "input_ids",
    "loss_mask",
    "text",
    "prompt",
    "completion",
    "response",
    "messages",
    "conversations",
    "system",
)
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT `from` values -> OpenAI roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
    "ipython": "tool",
}


class RowError(InputError, ValueError):
    """A row that gives no sample; the message names the field and what is wrong with it. The
    producer raises it too for the row that stops it (a bad row under --strict, an overlong one
    under --overlong fail)."""


@dataclass(frozen=True)
class FieldMap:
    """Logical field name -> the row's key for it."""

    names: Mapping[str, str] = field(default_factory=dict)

    def __getitem__(self, logical: str) -> str:
        return self.names.get(logical, logical)

    @classmethod
    def parse(cls, specs: Iterable[str]) -> FieldMap:
        """`["text=content", "messages=dialog"]` -> a FieldMap; unknown logical names are refused."""
        names: dict[str, str] = {}
        for spec in specs:
            logical, sep, actual = spec.partition("=")
            logical, actual = logical.strip(), actual.strip()
            if not sep or not actual:
                raise ConfigurationError(f"--field {spec!r}: expected LOGICAL=COLUMN, e.g. text=content")
            if logical not in FIELDS:
                raise ConfigurationError(
                    f"--field {spec!r}: unknown field {logical!r}; expected one of {', '.join(FIELDS)}"
                )
            names[logical] = actual
        return cls(names)


@dataclass(frozen=True)
class Pretokenized:
    input_ids: list
    loss_mask: list | None


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class PromptCompletion:
    prompt: str
    completion: str


@dataclass(frozen=True)
class Chat:
    messages: list[dict]


RowKind = Pretokenized | Text | PromptCompletion | Chat


def _type(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _unicode(v: str, where: str) -> str:
    """`v`, refused if it holds a lone surrogate (JSON's `"\\ud800"` parses to one): no tokenizer
    can encode it, and the message names the field and the character."""
    if v.isascii():
        return v
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(
            f"{where} is not valid Unicode: a lone surrogate {v[e.start]!r} at character {e.start}"
        ) from None
    return v


def _string(d: Mapping, key: str) -> str:
    v = d[key]
    if not isinstance(v, str):
        raise RowError(f"'{key}' must be a string, got {_type(v)}")
    return _unicode(v, f"'{key}'")


def _content(v: object, where: str) -> str:
    """A message's content: a string, or a list of `{"type": "text", "text": ...}` parts (joined)."""
    if isinstance(v, str):
        return _unicode(v, f"{where} content")
    if isinstance(v, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v
    ):
        return _unicode("".join(p["text"] for p in v), f"{where} content")
    raise RowError(f"{where} content must be a string, got {_type(v)}")


def _messages(v: object, key: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise RowError(
            f"'{key}' must be a non-empty list of messages, got {_type(v) if not isinstance(v, list) else 'an empty list'}"
        )
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise RowError(f"'{key}'[{i}] must be an object, got {_type(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise RowError(f"'{key}'[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
        out.append({**m, "content": _content(m.get("content"), f"'{key}'[{i}]")})
    return out


def _sharegpt(v: object, key: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise RowError(
            f"'{key}' must be a non-empty list of turns, got {_type(v) if not isinstance(v, list) else 'an empty list'}"
        )
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise RowError(f"'{key}'[{i}] must be an object, got {_type(t)}")
        who = t.get("from")
        role = SHAREGPT_ROLES.get(who.lower() if isinstance(who, str) else who)
        if role is None:
            raise RowError(f"'{key}'[{i}] has from {who!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": _content(t.get("value"), f"'{key}'[{i}]")})
    return out


def _with_system(messages: list[dict], d: Mapping, fields: FieldMap) -> list[dict]:
    """A row-level `system` string becomes the first message unless the chat already has one."""
    key = fields["system"]
    if d.get(key) is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": _string(d, key)}, *messages]


def classify(d: object, fields: FieldMap = FieldMap()) -> RowKind:
    """The meaning of one parsed row, or RowError."""
    if not isinstance(d, dict):
        raise RowError(f"row is a {_type(d)}, expected an object")
    f = fields
    if f["input_ids"] in d:
        return Pretokenized(d[f["input_ids"]], d.get(f["loss_mask"]))
    if f["messages"] in d:
        return Chat(_with_system(_messages(d[f["messages"]], f["messages"]), d, f))
    if f["conversations"] in d:
        return Chat(_with_system(_sharegpt(d[f["conversations"]], f["conversations"]), d, f))
    if f["prompt"] in d:
        key = f["completion"] if f["completion"] in d else f["response"]
        if key not in d:
            raise RowError(f"'{f['prompt']}' without '{f['completion']}' or '{f['response']}'")
        p, c = d[f["prompt"]], d[key]
        if isinstance(p, list) and isinstance(c, list):  # conversational prompt-completion (TRL)
            return Chat(_with_system(_messages(p, f["prompt"]) + _messages(c, key), d, f))
        return PromptCompletion(_string(d, f["prompt"]), _string(d, key))
    if f["text"] in d:
        return Text(_string(d, f["text"]))
    kinds = ", ".join(f[k] for k in ("input_ids", "messages", "conversations", "prompt", "text"))
    raise RowError(f"no usable field: expected one of {kinds}; got {sorted(map(str, d))[:8]}")
