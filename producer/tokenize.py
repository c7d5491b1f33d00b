"""Dataset rows -> tokenized samples with loss masks (or the reason a row gives none), a batch at a time.

Texts of a whole batch of rows go through the fast tokenizer's Rust `encode_batch` in one call
(it parallelises across threads); chats are rendered to text and assistant spans first and
their masks come from the token offsets. The length policy (`--max-len`, the model's context,
`--overlong`) and the empty-sample check apply to every row kind alike. One row never stops a
batch: see harvest.producer.rows for where the line runs between a bad row and a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from harvest.config import model_context
from harvest.errors import ConfigurationError
from harvest.producer.rowkinds import Chat, FieldMap, Pretokenized, PromptCompletion, RowError, RowKind, Text, classify
from harvest.producer.rows import OVERLONG_POLICIES, BadRow, Row, exception_reason
from harvest.producer.templates import ChatRenderer, TemplateError, mask_from_spans
from harvest.sample import Sample, SampleError
from harvest.settings import ProducerSettings
from harvest.state.conversation import Conversation, ConversationError

if TYPE_CHECKING:
    from tokenizers import Encoding
    from transformers import PreTrainedTokenizerBase

ROW_ERRORS = (
    RowError,
    TemplateError,
    SampleError,
    ConversationError,
)  # harvest's own verdicts on a row, told as they are


@dataclass(frozen=True)
class LengthPolicy:
    """The longest sample: `max_len` (--max-len) and the model's `context` (`model_context`), the
    smaller of the two; `overlong` says what a longer one becomes (harvest.producer.rows.OVERLONG_POLICIES)."""

    max_len: int | None = None
    # skip: report and drop; truncate: keep the first tokens; fail: stop the producer
    overlong: str = ProducerSettings.overlong
    context: int | None = None  # the model's context length, when known
    context_from: str = ""  # where `context` was read, for the message

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigurationError(f"--overlong must be one of {', '.join(OVERLONG_POLICIES)}, got {self.overlong!r}")
        if self.max_len is not None and self.max_len < 1:
            raise ConfigurationError(f"--max-len must be at least 1, got {self.max_len}")

    def limit(self) -> tuple[int | None, str, str]:
        """(the longest sample allowed, what sets it, where that was read) or (None, "", "") when
        nothing does."""
        if self.context is not None and (self.max_len is None or self.context < self.max_len):
            return self.context, f"the model's context of {self.context}", f"{self.context_from} in its config.json"
        if self.max_len is not None:
            return self.max_len, f"--max-len {self.max_len}", ""
        return None, "", ""

    def with_model(self, model_dir: str | None) -> LengthPolicy:
        """This policy bounded by the context of the model in `model_dir` too (unchanged when it
        states none, or is no local folder)."""
        found = model_context(model_dir) if model_dir else None
        return replace(self, context=found[0], context_from=found[1]) if found else self


_PLACEHOLDER = "answer"  # an assistant turn's content while the pieces around it are cut out


class _Texts:
    """Texts collected from a batch of rows, tokenized together in one call."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.encoded: list = []
        self.failed: dict[int, str] = {}  # text index -> why the tokenizer gave no encoding

    def add(self, text: str) -> int:
        self.texts.append(text)
        return len(self.texts) - 1

    def encode(self, backend: Tokenizer, special: bool) -> None:
        """All texts in one call; if the tokenizer refuses the batch, each text alone, so the text
        it refuses fails its own row (`failed`) and the others are encoded as in one call."""
        if not self.texts:
            return
        try:
            self.encoded = backend.encode_batch(self.texts, add_special_tokens=special)
            return
        except Exception:  # noqa: BLE001 - the tokenizer on rows' data (harvest.producer.rows); found per text below
            pass
        self.encoded = []
        for i, text in enumerate(self.texts):
            try:
                self.encoded.append(backend.encode(text, add_special_tokens=special))
            except Exception as e:  # noqa: BLE001 - this text's own: its row is bad
                self.encoded.append(None)
                self.failed[i] = _refusal(text, e)


def _refusal(text: str, e: Exception) -> str:
    """Why the tokenizer refused `text`: a lone surrogate (which it reports only as a type error), or
    its own words."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as u:
        return (
            f"the row's text as rendered is not valid Unicode: a lone surrogate {text[u.start]!r} at character "
            f"{u.start}; the tokenizer cannot encode it"
        )
    return exception_reason("the tokenizer cannot encode this row's text", e)


class RowTokenizer:
    """Turns rows into samples. `truncated` counts rows cut to their length limit (they are still samples)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        fields: FieldMap = FieldMap(),
        chat_template: str | None = None,
        length: LengthPolicy = LengthPolicy(),
        regenerate: bool = False,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigurationError("harvest needs a fast (Rust `tokenizers`) tokenizer: one with a tokenizer.json")
        # The Rust tokenizer with padding and truncation off, whatever tokenizer.json says: the
        # tokenizer's own where both are off already (encoding does not change it), else a private
        # copy with them turned off (a copy costs ~0.1 s for a 32k vocabulary, once per produce,
        # and starts with a cold BPE cache). A caller that shares its tokenizer must not call it
        # with truncation or padding while this one runs: transformers sets those on the backend.
        backend = tokenizer.backend_tokenizer
        if backend.padding is not None or backend.truncation is not None:
            backend = Tokenizer.from_str(backend.to_str())
            backend.no_padding()
            backend.no_truncation()
        self.backend = backend
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.fields, self.length = fields, length
        self.chat = ChatRenderer(tokenizer, chat_template)
        self.truncated = 0
        # --regenerate: chat rows become conversations whose assistant turns the target model writes
        # (harvest.state.conversation); rows of other kinds have no turns to write and are refused.
        self.regenerate = regenerate
        self.special_ids = set(tokenizer.all_special_ids)

    def one(self, row: Row | BadRow) -> Sample | BadRow:
        return self([row])[0]

    def __call__(self, rows: Sequence[Row | BadRow]) -> list[Sample | BadRow]:
        out: list[Sample | BadRow | None] = [None] * len(rows)
        special, plain = _Texts(), _Texts()  # with / without the tokenizer's own special tokens (BOS)
        plans: dict[int, tuple] = {}
        for i, row in enumerate(rows):
            if isinstance(row, BadRow):
                out[i] = row
                continue
            try:
                kind = classify(row.data, self.fields)
                if self.regenerate:
                    plans[i] = self._conversation_plan(kind, plain)
                elif isinstance(kind, Pretokenized):
                    out[i] = self._finish(row, *self._pretokenized(kind))
                elif isinstance(kind, Text):
                    plans[i] = ("text", [(special, special.add(kind.text))], None)
                elif isinstance(kind, PromptCompletion):
                    plans[i] = ("pc", [(special, special.add(kind.prompt)), (plain, plain.add(kind.completion))], None)
                elif isinstance(kind, Chat):
                    text, spans = self.chat.render(kind.messages)
                    plans[i] = ("chat", [(plain, plain.add(text))], spans)
            except ROW_ERRORS as e:
                out[i] = BadRow(row.where, str(e))
        special.encode(self.backend, True)
        plain.encode(self.backend, False)
        for i, (what, refs, spans) in plans.items():
            refused = [texts.failed[j] for texts, j in refs if j in texts.failed]
            if refused:
                out[i] = BadRow(rows[i].where, refused[0])
                continue
            out[i] = self._assemble(rows[i], what, [texts.encoded[j] for texts, j in refs], spans)
        return out  # type: ignore[return-value]

    def _assemble(self, row: Row, what: str, encs: list[Encoding], spans: Any) -> Sample | BadRow:
        """A planned row's sample from its encoded texts: its token ids and loss mask. `spans`: a
        chat's assistant spans, or a conversation's messages."""
        if what == "conv":
            try:
                return self._conversation(row, encs, spans)
            except ROW_ERRORS as e:
                return BadRow(row.where, str(e))
        if what == "text":
            ids = encs[0].ids
            mask = [1] * len(ids)
        elif what == "pc":
            p, c = encs[0].ids, encs[1].ids
            if self.eos_id is not None and (not c or c[-1] != self.eos_id):
                c = [*c, self.eos_id]  # the model must learn to stop after the completion
            ids, mask = p + c, [0] * len(p) + [1] * len(c)
        else:
            ids, mask = encs[0].ids, mask_from_spans(encs[0], spans)
        return self._finish(row, ids, mask)

    def _conversation_plan(self, kind: RowKind, plain: _Texts) -> tuple:
        """A chat row of a --regenerate run, cut for its turns to be written (harvest.state.conversation):
        its texts between the assistant turns, and each turn's placeholder text (whose last token is the
        template's end-of-turn token), queued for the batch's tokenizer call. A chat that ends on another
        role gets one more assistant turn: the answer to its last message."""
        if not isinstance(kind, Chat):
            raise RowError(
                f"--regenerate writes the assistant turns of chat rows ('{self.fields['messages']}' or "
                f"'{self.fields['conversations']}'); this row is {type(kind).__name__.lower()}, with none"
            )
        messages = [dict(m) for m in kind.messages]
        if not messages or messages[-1].get("role") != "assistant":
            messages.append({"role": "assistant", "content": ""})
        # Every answer rendered as one placeholder: the pieces (and so the sample id) do not depend on
        # the answers the row brought, which are written again.
        placeholder = [{**m, "content": _PLACEHOLDER} if m.get("role") == "assistant" else m for m in messages]
        text, spans = self.chat.render(placeholder)
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        if len(spans) != turns:
            raise TemplateError(
                f"the chat template rendered {len(spans)} assistant turns of {turns}: "
                "it cannot be regenerated turn by turn"
            )
        edges = [0, *[x for span in spans for x in span], len(text)]
        pieces = [text[edges[2 * k] : edges[2 * k + 1]] for k in range(turns + 1)]
        refs = [(plain, plain.add(p)) for p in pieces] + [(plain, plain.add(text[a:b])) for a, b in spans]
        stored = [{**m, "content": None} if m.get("role") == "assistant" else m for m in messages]
        return ("conv", refs, stored)

    def _conversation(self, row: Row, encs: list, messages: list[dict]) -> Sample | BadRow:
        turns = len(encs) // 2
        pieces, answers = [e.ids for e in encs[: turns + 1]], [e.ids for e in encs[turns + 1 :]]
        ends = [a[-1] for a in answers if a and a[-1] in self.special_ids]  # the template's end-of-turn
        stop = {*ends, *([] if self.eos_id is None else [self.eos_id])}
        if not stop:
            raise TemplateError(
                "the chat template ends an assistant turn with no special token and the tokenizer "
                "has no EOS: nothing tells where a generated turn ends"
            )
        close = ends[0] if ends else self.eos_id  # what closes a turn cut at --max-new-tokens
        skeleton = [t for p in pieces for t in p]
        conv = Conversation(tuple(len(p) for p in pieces), tuple(sorted(stop)), tuple(messages), close)
        limit, what, source = self.length.limit()
        if limit is not None and len(skeleton) > limit:
            why = f"{source}; " if source else ""
            return BadRow(
                row.where,
                f"{len(skeleton)} tokens before any answer is written, over {what} ({why}"
                "a conversation to regenerate is never truncated)",
                "overlong",
            )
        return Sample.build(skeleton, [0] * len(skeleton), conv)

    def _pretokenized(self, kind: Pretokenized) -> tuple[np.ndarray, np.ndarray | None]:
        """The row's ids (and mask) checked in Python before numpy sees them: numpy would take
        `true` for token 1 and a 30-digit number for an object array."""
        f = self.fields
        ids = _int_list(kind.input_ids, f["input_ids"], "a list of integers (token ids)", {int}, None)
        if ids:
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= self.vocab_size:
                i = next(i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
                raise RowError(
                    f"token id {ids[i]} ('{f['input_ids']}'[{i}]) outside the vocabulary [0, {self.vocab_size})"
                )
        if kind.loss_mask is None:
            return np.array(ids, np.int64), None
        mask = _int_list(kind.loss_mask, f["loss_mask"], "a list of 0 and 1", {int, bool}, {0, 1})
        if len(mask) != len(ids):
            raise RowError(f"'{f['loss_mask']}' has {len(mask)} entries for {len(ids)} tokens")
        return np.array(ids, np.int64), np.array(mask, np.uint8)

    def _finish(self, row: Row, ids: np.ndarray | list[int], mask: np.ndarray | list[int] | None) -> Sample | BadRow:
        n = len(ids)
        if n == 0:
            return BadRow(row.where, "empty sample (0 tokens)", "empty")
        limit, what, source = self.length.limit()
        if limit is not None and n > limit:
            if self.length.overlong != "truncate":
                why = f"{source}; " if source else ""
                return BadRow(
                    row.where, f"{n} tokens, over {what} ({why}--overlong {self.length.overlong})", "overlong"
                )
            ids = ids[:limit]
            mask = None if mask is None else mask[:limit]
            self.truncated += 1
        return Sample.build(ids, mask)


def _int_list(v: object, key: str, what: str, types: set[type], values: set[int] | None) -> list:
    """`v`, a list whose items are all of `types` exactly (a boolean is no token id; a mask takes
    true and false as 1 and 0) and, with `values`, among them; else RowError naming the first item
    that is not. The checks run at C speed (`set(map(type, v))`); the item is looked for only then."""
    if not isinstance(v, list):
        raise RowError(f"'{key}' must be {what}, got {_kind(v)}")
    if not set(map(type, v)) <= types or (values is not None and not set(v) <= values):
        i = next(i for i, x in enumerate(v) if type(x) not in types or (values is not None and x not in values))
        raise RowError(f"'{key}' must be {what}: '{key}'[{i}] is {_show(v[i])}")
    return v


def _kind(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _show(v: object) -> str:
    """An item of a row's list, for a message: its JSON spelling (short) and what it is."""
    if isinstance(v, bool):
        return f"{'true' if v else 'false'} (a boolean, not an integer)"
    if v is None:
        return "null"
    if isinstance(v, int):
        text = str(v) if abs(v) < 10**24 else f"an integer of {len(str(abs(v)))} digits"
        return text
    if isinstance(v, float):
        return f"{v!r} (a number with a fraction)" if len(repr(v)) <= 24 else "a number with a fraction"
    if isinstance(v, str):
        return f"{v!r} (a string)" if len(v) <= 20 else f"a string of {len(v)} characters"
    return {"dict": "an object", "list": "a list"}.get(type(v).__name__, f"a {type(v).__name__}")
