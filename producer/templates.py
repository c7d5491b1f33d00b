"""Chat templates and the loss mask of a conversation.

The mask covers exactly the assistant turns' tokens: their content and the end-of-turn token
the model must learn to emit, never the role headers. Templates with `{% generation %}`
markers give the mask directly; for the rest it is derived by rendering prefixes of the
conversation and comparing (text spans, mapped to tokens by offsets), which works for any
template whose rendering of a prefix is a prefix of the whole.
"""

from __future__ import annotations

import numpy as np

ROLES = ("system", "user", "assistant", "tool")


class TemplateError(ValueError):
    """A conversation the chat template cannot render into masked tokens."""


def has_generation_markers(tokenizer) -> bool:
    tpl = tokenizer.chat_template or ""
    return "{% generation %}" in tpl or "{%- generation %}" in tpl


def check_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise TemplateError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TemplateError(f"message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise TemplateError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise TemplateError(f"message {i} content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def render_with_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    if tokenizer.chat_template is None:
        raise TemplateError("the tokenizer has no chat template; pass --chat-template FILE")
    if has_generation_markers(tokenizer):
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
    return _mask_by_prefixes(tokenizer, messages)


def _render(tokenizer, messages: list[dict], gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def _mask_by_prefixes(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(before) and full.startswith(upto) and len(upto) >= len(before)):
            raise TemplateError(
                f"the chat template does not render turn {i} as a prefix of the whole conversation; "
                "add {% generation %} markers to the template"
            )
        end = len(before) + len(full[len(before) : len(upto)].rstrip())
        spans.append((len(before), end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = np.zeros(len(enc["input_ids"]), np.uint8)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if b > a and any(s <= a and b <= e for s, e in spans):
            mask[t] = 1
    return list(enc["input_ids"]), mask.tolist()
