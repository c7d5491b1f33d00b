"""One dataset row -> one tokenized sample with its loss mask, or the reason it is bad."""

from __future__ import annotations

from harvest.payload import PayloadError, Sample
from producer.sources import BadRow, Row
from producer.templates import TemplateError, check_messages, render_with_mask

ROW_KINDS = ("input_ids", "messages", "text")


class RowTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def __call__(self, row: Row) -> Sample | BadRow:
        d = row.data
        if not isinstance(d, dict):
            return BadRow(row.where, f"row is a JSON {type(d).__name__}, expected an object")
        try:
            if "input_ids" in d:
                sample = self._pretokenized(d["input_ids"], d.get("loss_mask"))
            elif "messages" in d:
                ids, mask = render_with_mask(self.tokenizer, check_messages(d["messages"]))
                sample = Sample.build(ids, mask)
            elif "text" in d:
                if not isinstance(d["text"], str):
                    raise TemplateError(f"'text' must be a string, got {type(d['text']).__name__}")
                sample = Sample.build(self.tokenizer(d["text"])["input_ids"])
            else:
                return BadRow(row.where, f"no usable field: expected one of {', '.join(ROW_KINDS)}; got {sorted(d)[:8]}")
        except (TemplateError, PayloadError) as e:
            return BadRow(row.where, str(e))
        if sample.num_tokens == 0:
            return BadRow(row.where, "empty sample (0 tokens)")
        return sample

    def _pretokenized(self, ids: object, mask: object) -> Sample:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise PayloadError("'input_ids' must be a list of integers")
        bad = [x for x in ids if x < 0 or x >= self.vocab_size]
        if bad:
            raise PayloadError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if mask is not None and (not isinstance(mask, list) or not all(x in (0, 1) for x in mask)):
            raise PayloadError("'loss_mask' must be a list of 0 and 1")
        return Sample.build(ids, mask)
