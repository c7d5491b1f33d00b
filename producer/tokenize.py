"""Dataset rows -> tokenized samples with loss masks (or the reason a row gives none), a batch at a time.

Texts of a whole batch of rows go through the fast tokenizer's Rust `encode_batch` in one call
(it parallelises across threads); chats are rendered to text and assistant spans first and
their masks come from the token offsets. The length policy (`--max-len`, `--overlong`) and
the empty-sample check apply to every row kind alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from harvest.config import ConfigError
from harvest.state.payload import PayloadError, Sample
from producer.rowkinds import Chat, FieldMap, Pretokenized, PromptCompletion, RowError, Text, classify
from producer.rows import BadRow, Row
from producer.templates import ChatRenderer, TemplateError, mask_from_spans

OVERLONG_POLICIES = ("skip", "truncate")


@dataclass(frozen=True)
class LengthPolicy:
    max_len: int | None = None
    overlong: str = "skip"  # skip: report and drop; truncate: keep the first max_len tokens

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigError(f"--overlong must be one of {', '.join(OVERLONG_POLICIES)}, got {self.overlong!r}")
        if self.max_len is not None and self.max_len < 1:
            raise ConfigError(f"--max-len must be at least 1, got {self.max_len}")


class _Texts:
    """Texts collected from a batch of rows, tokenized together in one call."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.encoded: list = []

    def add(self, text: str) -> int:
        self.texts.append(text)
        return len(self.texts) - 1

    def encode(self, backend: Tokenizer, special: bool) -> None:
        self.encoded = backend.encode_batch(self.texts, add_special_tokens=special) if self.texts else []


class RowTokenizer:
    """Turns rows into samples. `truncated` counts rows cut to --max-len (they are still samples)."""

    def __init__(
        self,
        tokenizer,
        fields: FieldMap = FieldMap(),
        chat_template: str | None = None,
        length: LengthPolicy = LengthPolicy(),
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("harvest needs a fast (Rust `tokenizers`) tokenizer: one with a tokenizer.json")
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
                if isinstance(kind, Pretokenized):
                    out[i] = self._finish(row, *self._pretokenized(kind))
                elif isinstance(kind, Text):
                    plans[i] = ("text", special.add(kind.text))
                elif isinstance(kind, PromptCompletion):
                    plans[i] = ("pc", special.add(kind.prompt), plain.add(kind.completion))
                elif isinstance(kind, Chat):
                    text, spans = self.chat.render(kind.messages)
                    plans[i] = ("chat", plain.add(text), spans)
            except (RowError, TemplateError, PayloadError) as e:
                out[i] = BadRow(row.where, str(e))
        special.encode(self.backend, True)
        plain.encode(self.backend, False)
        for i, plan in plans.items():
            if plan[0] == "text":
                ids = special.encoded[plan[1]].ids
                mask = [1] * len(ids)
            elif plan[0] == "pc":
                p, c = special.encoded[plan[1]].ids, plain.encoded[plan[2]].ids
                if self.eos_id is not None and (not c or c[-1] != self.eos_id):
                    c = [*c, self.eos_id]  # the model must learn to stop after the completion
                ids, mask = p + c, [0] * len(p) + [1] * len(c)
            else:
                enc = plain.encoded[plan[1]]
                ids, mask = enc.ids, mask_from_spans(enc, plan[2])
            out[i] = self._finish(rows[i], ids, mask)
        return out  # type: ignore[return-value]

    def _pretokenized(self, kind: Pretokenized) -> tuple[np.ndarray, np.ndarray | None]:
        f = self.fields
        ids = np.asarray(kind.input_ids) if isinstance(kind.input_ids, list) else None
        if ids is None or ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise RowError(f"'{f['input_ids']}' must be a list of integers")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
            raise RowError(f"token id {int(bad)} outside the vocabulary [0, {self.vocab_size})")
        if kind.loss_mask is None:
            return ids, None
        mask = np.asarray(kind.loss_mask) if isinstance(kind.loss_mask, list) else None
        if mask is None or mask.ndim != 1 or (mask.size and (mask.dtype.kind not in "iub" or not np.isin(mask, (0, 1)).all())):
            raise RowError(f"'{f['loss_mask']}' must be a list of 0 and 1")
        if mask.size != ids.size:
            raise RowError(f"'{f['loss_mask']}' has {mask.size} entries for {ids.size} tokens")
        return ids, mask

    def _finish(self, row: Row, ids, mask) -> Sample | BadRow:
        n = len(ids)
        if n == 0:
            return BadRow(row.where, "empty sample (0 tokens)", "empty")
        max_len = self.length.max_len
        if max_len is not None and n > max_len:
            if self.length.overlong == "skip":
                return BadRow(row.where, f"{n} tokens, over --max-len {max_len} (--overlong skip)", "overlong")
            ids = ids[:max_len]
            mask = None if mask is None else mask[:max_len]
            self.truncated += 1
        return Sample.build(ids, mask)
