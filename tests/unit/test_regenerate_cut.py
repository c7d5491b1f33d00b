"""One rule for every regenerated turn, a cut one included (`--on-length keep`): the tokens are the chat
template's rendering of the stored messages. Checked against transformers' own rendering with the tiny
model's template: the prompt of the turn after a cut one, and the whole extracted conversation, decode
to the template's text of the messages the generated dataset stores. The engine is a stand-in that
answers a script (a real one cannot be made to write a chosen cut turn on cue); the rule under test is
the worker's splice, which is the same for every engine."""

from __future__ import annotations

from harvest.producer.rows import Row
from harvest.producer.tokenize import RowTokenizer
from harvest.regeneration import Regeneration
from harvest.sample import Sample
from harvest.workers.clients.base import Completion
from harvest.workers.regenerate import write_turns

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "old one"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "old two"},
]
MAX_NEW = 4


class _Script:
    """Turn 1 reaches max_new_tokens without a stop token; turn 2 ends with the template's <|im_end|>.
    Each prompt it is sent is kept."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.prompts: list[list[int]] = []

    def complete(self, rid, prompt, params):
        self.prompts.append(list(prompt))
        encode = lambda text: self.tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        if len(self.prompts) == 1:
            tokens = encode("an answer that runs on and on and on")[:MAX_NEW]
            return Completion(rid, tokens, self.tok.decode(tokens), "length", len(prompt))
        tokens = encode("done")
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        return Completion(rid, [*tokens, end], self.tok.decode(tokens), "stop", len(prompt))


def test_a_cut_turn_is_closed_as_the_template_renders_the_stored_messages(tokenizer):
    sample = RowTokenizer(tokenizer, regenerate=True).one(Row({"messages": CHAT}, "d:1"))
    assert isinstance(sample, Sample)
    engine = _Script(tokenizer)
    written = write_turns(engine, sample, 1, Regeneration(max_new_tokens=MAX_NEW, on_length="keep"))
    messages = written.record["messages"]
    assert [t["finish_reason"] for t in written.record["turns"]] == ["length", "stop"]
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    # the second turn is written from the stored conversation so far, as the template renders it
    assert decode(engine.prompts[1]) == render(messages[:4], gen=True)
    ids, mask = written.sample.input_ids.tolist(), written.sample.loss_mask.tolist()
    assert decode(ids) == render(messages)
    # the mask holds exactly the model's tokens: not the <|im_end|> that closes the cut turn
    turns = [t["tokens"] for t in written.record["turns"]]
    assert [i for i, m in zip(ids, mask, strict=False) if m] == turns[0] + turns[1]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    at = engine.prompts[1].index(end, len(engine.prompts[0]))
    assert at == len(engine.prompts[0]) + MAX_NEW and mask[at] == 0  # right after the cut turn's tokens
    assert written.tokens == MAX_NEW + len(turns[1])
