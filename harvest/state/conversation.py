"""A conversation to regenerate: the payload of the regeneration stage, and how its turns splice.

A chat row of a `--regenerate` run does not travel as finished tokens: the target model writes its
assistant turns on the worker first. The producer renders the conversation with the chat template
once, as it does for any chat row, and cuts the text at the assistant turns' spans (each span is a
turn's content and its end-of-turn token, harvest.producer.templates). What lies between the spans is
tokenized piece by piece and travels as the sample's tokens (the *skeleton*): `cuts` says where
one piece ends. For a conversation of n assistant turns there are n + 1 pieces:

    p_0 | turn 1 | p_1 | turn 2 | ... | turn n | p_n

p_0 ends with the first assistant header (the template's generation prompt), p_k (0 < k < n) runs
from after turn k's end-of-turn token through turn k+1's header, p_n is what follows the last
turn. Turn k is generated from `p_0 g_1 p_1 ... g_(k-1) p_(k-1)`, where g_j is turn j as the
conversation holds it: the tokens the model generated, ending with the stop token it ended the
turn with (one of `stop`); the regenerated sample is `p_0 g_1 p_1 ... g_n p_n`, its loss mask 1 on
exactly the generated tokens.

**A cut turn** (`--on-length keep`: the model reached max_new_tokens without a stop token) is
closed by `close`, the template's end-of-turn token, loss mask 0 (the model did not write it). So
one rule holds for every turn: the tokens are the chat template's rendering of the stored messages
(each assistant turn's content, then the template's end-of-turn; a turn the model ended with EOS
keeps its EOS there), and the next turn's context, the extracted sample and the generated
dataset's `messages` agree. Left open, a cut turn would give the next turn a context that no
rendering of those messages has. The worker splices tokens, never text, so what the model saw
while generating is what is extracted, token for token: no decode and re-encode can change a
token at a seam. The template is applied once, on the
producer, and the one assumption it makes is the one the loss mask already makes: the template
renders a conversation's earlier turns as a prefix of the whole (templates that rewrite history
are refused unless they carry `{% generation %}` markers). Each piece is tokenized on its own: a
piece starts and ends at a template seam (a role header, an end-of-turn token), where a fast
tokenizer does not merge across anyway.

A conversation's id is a content hash of its skeleton, cuts, stop tokens, end-of-turn token and
messages, so the same row gives the same id on every rerun, and every seed derives from it
(`turn_seed`): a sample regenerated after a failure samples the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from harvest.errors import InputError

GEN_RID_PREFIX = "hg-"  # generation requests: engines dump hidden states only for `hv-` rids


class ConversationError(InputError, ValueError):
    """A conversation payload that is not what a producer writes."""


@dataclass(frozen=True)
class Conversation:
    cuts: tuple[int, ...]  # the length of each piece p_0..p_n of the skeleton (n assistant turns)
    stop: tuple[int, ...]  # token ids that end a turn: the template's end-of-turn token(s) and EOS
    messages: tuple[dict, ...]  # the conversation as given; assistant turns' content is what is regenerated
    close: int  # the template's end-of-turn token (one of `stop`): what closes a turn cut at max_new_tokens

    def __post_init__(self) -> None:
        if len(self.cuts) < 2 or any(not isinstance(c, int) or c < 0 for c in self.cuts):
            raise ConversationError(f"a conversation needs at least one turn: cuts {list(self.cuts)}")
        if not self.stop or any(not isinstance(t, int) or t < 0 for t in self.stop):
            raise ConversationError(f"stop tokens must be token ids, got {list(self.stop)}")
        if self.close not in self.stop:
            raise ConversationError(
                f"the end-of-turn token {self.close!r} is not one of the stop tokens {list(self.stop)}"
            )
        roles = [m.get("role") for m in self.messages if isinstance(m, dict)]
        if len(roles) != len(self.messages) or roles.count("assistant") != self.turns:
            raise ConversationError(f"{roles.count('assistant')} assistant messages for {self.turns} turns")

    @property
    def turns(self) -> int:
        return len(self.cuts) - 1

    def to_json(self) -> dict:
        return {"cuts": list(self.cuts), "stop": list(self.stop), "messages": list(self.messages), "close": self.close}

    @classmethod
    def from_json(cls, doc: object) -> Conversation:
        if not isinstance(doc, dict):
            raise ConversationError("conversation must be an object")
        try:
            return cls(tuple(doc["cuts"]), tuple(doc["stop"]), tuple(doc["messages"]), doc["close"])
        except (KeyError, TypeError) as e:
            raise ConversationError(f"malformed conversation: {e}") from None

    def digest(self) -> bytes:
        """What the sample id hashes besides the skeleton's tokens (harvest.ids.sample_id's `extra`)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    def pieces(self, skeleton: np.ndarray) -> list[np.ndarray]:
        if sum(self.cuts) != skeleton.size:
            raise ConversationError(
                f"cuts {list(self.cuts)} add up to {sum(self.cuts)}, the skeleton has {skeleton.size} tokens"
            )
        bounds = np.cumsum([0, *self.cuts])
        return [skeleton[bounds[i] : bounds[i + 1]] for i in range(len(self.cuts))]

    def splice(self, pieces: list[np.ndarray], generated: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of the regenerated conversation: the pieces with the generated turns
        between them, the mask 1 on exactly the generated tokens; a turn that does not end with a stop
        token (cut at max_new_tokens) is closed by `close`, mask 0. With fewer turns than slots (while
        generating), the prompt of the next turn: it ends with that turn's header."""
        ids: list[np.ndarray] = []
        mask: list[np.ndarray] = []
        for k, g in enumerate(generated):
            shut = [] if g and g[-1] in self.stop else [self.close]
            ids += [pieces[k], np.asarray([*g, *shut], np.int32)]
            mask += [np.zeros(pieces[k].size, np.uint8), np.ones(len(g), np.uint8), np.zeros(len(shut), np.uint8)]
        ids.append(pieces[len(generated)])
        mask.append(np.zeros(pieces[len(generated)].size, np.uint8))
        return np.concatenate(ids).astype(np.int32), np.concatenate(mask)


def turn_seed(sample_id: str, turn: int) -> int:
    """Turn `turn`'s sampling seed: from the sample id, so a rerun samples the same tokens."""
    h = hashlib.blake2b(f"{sample_id}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def gen_rid(sample_id: str, attempt: int, turn: int) -> str:
    """The rid of turn `turn`'s generation request: unique per attempt, and not an `hv-` rid, so no
    engine dumps it (harvest.engines.batch.cut_batch)."""
    return f"{GEN_RID_PREFIX}{sample_id}-{int(attempt)}-{int(turn)}"
