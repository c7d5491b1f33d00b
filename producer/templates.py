"""Chat templates and the loss mask of a conversation.

The mask covers exactly the assistant turns' tokens: their content and the end-of-turn token
the model must learn to emit, never the role headers or the whitespace the template puts
between turns. A conversation renders to text plus the character spans of its assistant
turns; tokenization (batched, elsewhere) maps spans to tokens through the offsets.

Templates with `{% generation %}` markers give the spans directly. For the rest they are
derived by rendering prefixes of the conversation and comparing: turn i spans from the end
of `render(messages[:i], add_generation_prompt=True)` (everything up to and including the
assistant header) to the end of `render(messages[:i+1])`, less trailing whitespace. This
needs no per-template regex and works for every template whose rendering of a prefix is a
prefix of the whole; one that is not (e.g. it rewrites earlier turns) is refused with a
message that says to add markers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from transformers.utils.chat_template_utils import render_jinja_template

from harvest.errors import InputError

if TYPE_CHECKING:
    from tokenizers import Encoding
    from transformers import PreTrainedTokenizerBase

try:
    from transformers.utils.chat_template_utils import (
        _alias_reasoning_fields,
        _compile_jinja_template,
        _plain_template_data,
    )
except ImportError:  # a transformers without them: the public path for every render
    _compile_jinja_template = None

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
Span = tuple[int, int]
_SENTINEL = "\u2063harvest-sentinel\u2063"


class TemplateError(InputError, ValueError):
    """A conversation the chat template cannot render into masked tokens."""


def load_chat_template(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


class ChatRenderer:
    """Renders conversations with one chat template (the tokenizer's, or one given)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> None:
        tpl = chat_template if chat_template is not None else tokenizer.chat_template
        if isinstance(tpl, dict):  # named templates: the default one renders chats
            tpl = tpl.get("default")
        self.template = tpl
        self.markers = bool(tpl) and bool(_GENERATION.search(tpl))
        # apply_chat_template passes the special tokens (bos_token, eos_token, ...) to the template too
        self._vars = dict(tokenizer.special_tokens_map)
        self._compiled = None
        if tpl and _compile_jinja_template is not None:
            try:
                self._compiled = _compile_jinja_template(tpl)
                self._plain_vars = _plain_template_data(self._vars)
            except Exception:  # a template Jinja cannot parse: each chat row is refused by the public path
                self._compiled = None

    def _prepare(self, messages: list[dict]) -> list[dict]:
        """The messages as every render of a prefix sees them (render_jinja_template's copy)."""
        if self._compiled is None:
            return messages
        try:
            return _alias_reasoning_fields(_plain_template_data(messages))
        except Exception as e:  # noqa: BLE001 - transformers' copy of this row's messages (harvest.producer.rows)
            raise TemplateError(f"chat template's data not prepared: {type(e).__name__}: {e}") from None

    def _render(self, chat: list[dict], gen_prompt: bool = False) -> str:
        """`chat`: prepared messages (`_prepare`), or a prefix of them."""
        try:
            if self._compiled is None:
                text, _ = render_jinja_template(
                    [chat], chat_template=self.template, add_generation_prompt=gen_prompt, **self._vars
                )
                return text[0]
            return self._compiled.render(
                messages=chat, tools=None, documents=None, add_generation_prompt=gen_prompt, **self._plain_vars
            )
        except Exception as e:  # the template's own raise_exception, or a Jinja error
            raise TemplateError(f"chat template failed: {e}") from None

    def render(self, messages: list[dict]) -> tuple[str, list[Span]]:
        """The whole conversation as text, and the character spans the loss mask covers."""
        if not self.template:
            raise TemplateError("the tokenizer has no chat template; pass --chat-template FILE")
        if self.markers:
            try:
                text, spans = render_jinja_template(
                    [messages], chat_template=self.template, return_assistant_tokens_mask=True, **self._vars
                )
            except Exception as e:
                raise TemplateError(f"chat template failed: {e}") from None
            return text[0], [(a, b) for a, b in spans[0]]
        return self._by_prefixes(self._prepare(messages))

    def _opening_prefix(self, first: dict) -> str:
        """What precedes an assistant turn that opens the chat (BOS, a default system prompt, the header).
        A template that cannot render an empty chat is asked for the turn with a sentinel as content."""
        try:
            return self._render([], gen_prompt=True)
        except TemplateError:
            text = self._render(self._prepare([{**first, "content": _SENTINEL}]))
            return text[: max(text.find(_SENTINEL), 0)]

    def _by_prefixes(self, chat: list[dict]) -> tuple[str, list[Span]]:
        full = self._render(chat)
        spans: list[Span] = []
        for i, m in enumerate(chat):
            if m["role"] != "assistant":
                continue
            before = self._render(chat[:i], gen_prompt=True) if i else self._opening_prefix(m)
            upto = full if i == len(chat) - 1 else self._render(chat[: i + 1])
            if not (full.startswith(upto) and upto.startswith(before)):
                raise TemplateError(
                    f"the chat template does not render the conversation up to message {i} as a prefix of the whole, "
                    "so the assistant tokens cannot be found; add {% generation %} markers to the template"
                )
            end = len(upto.rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return full, spans


def mask_from_spans(encoding: Encoding, spans: Sequence[Span]) -> np.ndarray:
    """1 for every token holding a character of a span (a token straddling a span's edge is one
    the model emits, so it counts), 0 for the rest. `encoding` is a `tokenizers.Encoding` of the
    rendered text; its char -> token map makes this O(spans), not O(tokens)."""
    mask = np.zeros(len(encoding.ids), np.uint8)
    for s, e in spans:
        first = next((t for c in range(s, e) if (t := encoding.char_to_token(c)) is not None), None)
        if first is None:
            continue
        last = next(t for c in range(e - 1, s - 1, -1) if (t := encoding.char_to_token(c)) is not None)
        mask[first : last + 1] = 1
    return mask
