"""Chat templates and loss masks, token by token, for four template styles written here, plus the
tokenizer's own template with `{% generation %}` markers.

Each expectation is a list of (text, mask) pieces cut where the tokenizer cuts anyway (special
tokens, newlines, word starts), so encoding the pieces one by one gives the exact token ids the
whole conversation must have, and the mask every one of those tokens must carry.
"""

import pytest
from transformers import AutoTokenizer

from harvest.producer.rows import BadRow, Row
from harvest.producer.templates import ChatRenderer, mask_from_spans
from harvest.producer.tokenize import RowTokenizer
from tests.support.templates import CHATML

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] + '\n\n' %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{{ bos_token }}{% for m in msgs %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ (sys if loop.first else '') + m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

SYS = {"role": "system", "content": "Be brief."}
TWO_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "the model"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "a data token."},
]
EMPTY_LAST = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]


@pytest.fixture(scope="module")
def tok(tiny_model):
    """The tiny tokenizer with Llama-3's header tokens added as special tokens."""
    t = AutoTokenizer.from_pretrained(tiny_model)
    t.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    return t


def expected(tok, pieces):
    ids, mask = [], []
    for text, m in pieces:
        e = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        ids += e
        mask += [m] * len(e)
    return ids, mask


def check(tok, template, messages, pieces):
    s = RowTokenizer(tok, chat_template=template).one(Row({"messages": messages}, "t:1"))
    assert not isinstance(s, BadRow), s
    ids, mask = expected(tok, pieces)
    assert s.input_ids.tolist() == ids
    assert s.loss_mask.tolist() == mask
    return s


def test_chatml_multi_turn_with_system(tok):
    check(
        tok,
        CHATML,
        [SYS, *TWO_TURNS],
        [
            ("<|im_start|>system\nBe brief.<|im_end|>\n", 0),
            ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("the model<|im_end|>", 1),
            ("\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n", 0),
            ("a data token.<|im_end|>", 1),
            ("\n", 0),
        ],
    )


def test_chatml_token_strings(tok):
    """The same thing spelled as token strings, for one short chat: headers 0, content and <|im_end|> 1."""
    s = RowTokenizer(tok, chat_template=CHATML).one(Row({"messages": TWO_TURNS[:2]}, "t:1"))
    pairs = [(tok.convert_ids_to_tokens(int(i)), int(m)) for i, m in zip(s.input_ids, s.loss_mask, strict=False)]
    assert pairs == [
        ("<|im_start|>", 0),
        ("u", 0),
        ("s", 0),
        ("er", 0),
        ("Ċ", 0),
        ("h", 0),
        ("i", 0),
        ("<|im_end|>", 0),
        ("Ċ", 0),
        ("<|im_start|>", 0),
        ("a", 0),
        ("s", 0),
        ("s", 0),
        ("i", 0),
        ("s", 0),
        ("ta", 0),
        ("n", 0),
        ("t", 0),
        ("Ċ", 0),
        ("t", 1),
        ("h", 1),
        ("e", 1),
        ("Ġmodel", 1),
        ("<|im_end|>", 1),
        ("Ċ", 0),
    ]


def test_llama3_headers(tok):
    check(
        tok,
        LLAMA3,
        [SYS, *TWO_TURNS],
        [
            ("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>", 0),
            ("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", 0),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
            ("the model<|eot_id|>", 1),
            ("<|start_header_id|>user<|end_header_id|>\n\nand?<|eot_id|>", 0),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
            ("a data token.<|eot_id|>", 1),
        ],
    )


def test_mistral_inst(tok):
    """System prompt folded into the first [INST]; the assistant's leading space and </s> are its tokens."""
    check(
        tok,
        MISTRAL,
        [SYS, *TWO_TURNS],
        [
            ("<s>[INST] Be brief.\n\nhi [/INST]", 0),
            (" the model</s>", 1),
            ("[INST] and? [/INST]", 0),
            (" a data token.</s>", 1),
        ],
    )


def test_mistral_template_error_is_a_bad_row(tok):
    r = RowTokenizer(tok, chat_template=MISTRAL).one(Row({"messages": [TWO_TURNS[1]]}, "t:9"))
    assert isinstance(r, BadRow)
    assert str(r) == "t:9: chat template failed: roles must alternate user/assistant"


def test_default_system_prompt(tok):
    """The template adds its own system prompt when the chat has none: never masked."""
    check(
        tok,
        QWEN_DEFAULT_SYSTEM,
        TWO_TURNS,
        [
            ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", 0),
            ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("the model<|im_end|>", 1),
            ("\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n", 0),
            ("a data token.<|im_end|>", 1),
            ("\n", 0),
        ],
    )
    check(
        tok,
        QWEN_DEFAULT_SYSTEM,
        [SYS, *TWO_TURNS[:2]],
        [
            ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("the model<|im_end|>", 1),
            ("\n", 0),
        ],
    )


@pytest.mark.parametrize(
    "template,pieces",
    [
        (CHATML, [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0), ("<|im_end|>", 1), ("\n", 0)]),
        (
            LLAMA3,
            [
                ("<s><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", 0),
                ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
                ("<|eot_id|>", 1),
            ],
        ),
        (MISTRAL, [("<s>[INST] hi [/INST]", 0), (" </s>", 1)]),
    ],
    ids=["chatml", "llama3", "mistral"],
)
def test_empty_assistant_turn_masks_only_its_end_of_turn(tok, template, pieces):
    check(tok, template, EMPTY_LAST, pieces)


def test_generation_markers_are_used_when_present(tok, tokenizer):
    """The demo tokenizer's ChatML template marks assistant turns with {% generation %}: the same mask
    as transformers' own assistant mask, content and <|im_end|> only."""
    msgs = [SYS, *TWO_TURNS]
    r = ChatRenderer(tokenizer)
    assert r.markers
    s = RowTokenizer(tokenizer).one(Row({"messages": msgs}, "t:1"))
    enc = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert s.input_ids.tolist() == list(enc["input_ids"])
    assert s.loss_mask.tolist() == list(enc["assistant_masks"])
    ids, mask = expected(
        tokenizer,
        [
            ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("the model<|im_end|>", 1),  # trim_blocks eats the newline after {% endgeneration %}
            ("<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n", 0),
            ("a data token.<|im_end|>", 1),
        ],
    )
    assert (s.input_ids.tolist(), s.loss_mask.tolist()) == (ids, mask)


def test_prefix_derivation_agrees_with_markers(tokenizer):
    """The same ChatML rendering without markers: prefix comparison finds the very same mask."""
    # (an empty block in place of each marker keeps the rendering identical: trim_blocks still applies)
    no_markers = tokenizer.chat_template.replace("{% generation %}", "{% if true %}{% endif %}").replace(
        "{% endgeneration %}", "{% if true %}{% endif %}"
    )
    msgs = [SYS, *TWO_TURNS]
    a = RowTokenizer(tokenizer).one(Row({"messages": msgs}, "t:1"))
    b = RowTokenizer(tokenizer, chat_template=no_markers).one(Row({"messages": msgs}, "t:1"))
    assert not ChatRenderer(tokenizer, no_markers).markers
    assert (a.input_ids.tolist(), a.loss_mask.tolist()) == (b.input_ids.tolist(), b.loss_mask.tolist())


THINKING = (  # reads `reasoning_content`, which transformers fills from `thinking` / `reasoning`
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REASONING_CHAT = [
    SYS,
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yes", "thinking": "hm"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "no", "reasoning": "so"},
]


@pytest.mark.parametrize(
    "template",
    [CHATML, LLAMA3, MISTRAL, QWEN_DEFAULT_SYSTEM, THINKING],
    ids=["chatml", "llama3", "mistral", "qwen", "thinking"],
)
def test_prefix_renders_match_transformers_public_path(tok, template, monkeypatch):
    """The renderer calls the compiled template itself, once per prefix, on one copy of the
    conversation: every prefix (with and without the generation prompt) must be the text
    transformers' `render_jinja_template` gives, and the public-path fallback (a transformers
    without the private helpers) must give the same samples."""
    from transformers.utils.chat_template_utils import render_jinja_template

    import harvest.producer.templates as templates

    msgs = REASONING_CHAT if template in (THINKING, CHATML, QWEN_DEFAULT_SYSTEM) else [SYS, *TWO_TURNS]
    r = ChatRenderer(tok, template)
    assert r._compiled is not None  # the fast path is the one under test
    chat = r._prepare(msgs)
    for i in range(len(msgs) + 1):
        for gen in (False, True):
            try:
                want = render_jinja_template(
                    [msgs[:i]], chat_template=template, add_generation_prompt=gen, **tok.special_tokens_map
                )[0][0]
            except Exception:
                continue  # a prefix this template refuses (Mistral: a lone system turn)
            assert r._render(chat[:i], gen) == want, (i, gen)
    if template == THINKING:
        assert "<think>hm</think>yes" in r.render(msgs)[0] and "<think>so</think>no" in r.render(msgs)[0]
    fast = RowTokenizer(tok, chat_template=template).one(Row({"messages": msgs}, "t:1"))
    monkeypatch.setattr(templates, "_compile_jinja_template", None)
    slow = RowTokenizer(tok, chat_template=template).one(Row({"messages": msgs}, "t:1"))
    assert (fast.input_ids.tolist(), fast.loss_mask.tolist()) == (slow.input_ids.tolist(), slow.loss_mask.tolist())
    assert sum(fast.loss_mask.tolist()) > 0


def test_unparseable_template_refuses_each_chat_row(tok):
    """A template Jinja cannot parse fails the chat rows (bad rows), not the producer's start."""
    rt = RowTokenizer(tok, chat_template="{% for m in messages %}{{ m['content'] }")
    r = rt.one(Row({"messages": TWO_TURNS}, "t:5"))
    assert isinstance(r, BadRow) and str(r).startswith("t:5: chat template failed: ")
    assert rt.one(Row({"text": "plain text"}, "t:6")).num_tokens > 0


def test_template_that_rewrites_earlier_turns_is_refused(tok):
    counting = "{{ messages | length }}" + CHATML  # every prefix renders a different head
    r = RowTokenizer(tok, chat_template=counting).one(Row({"messages": TWO_TURNS}, "t:3"))
    assert str(r) == (
        "t:3: the chat template does not render the conversation up to message 1 as a prefix of the whole, "
        "so the assistant tokens cannot be found; add {% generation %} markers to the template"
    )


def test_no_chat_template(tok):
    r = RowTokenizer(tok, chat_template="").one(Row({"messages": TWO_TURNS}, "t:4"))
    assert str(r) == "t:4: the tokenizer has no chat template; pass --chat-template FILE"


class _Encoding:
    """Tokens at fixed character offsets, answering char_to_token like tokenizers.Encoding."""

    def __init__(self, offsets):
        self.ids = list(range(len(offsets)))
        self.offsets = offsets

    def char_to_token(self, c):
        return next((t for t, (a, b) in enumerate(self.offsets) if a <= c < b), None)


def test_mask_from_spans_counts_straddling_tokens():
    enc = _Encoding([(0, 3), (3, 6), (6, 9), (9, 9), (9, 12), (14, 16)])  # chars 12-13 in no token
    assert mask_from_spans(enc, [(4, 7)]).tolist() == [0, 1, 1, 0, 0, 0]
    assert mask_from_spans(enc, [(0, 3), (9, 12)]).tolist() == [1, 0, 0, 0, 1, 0]
    assert mask_from_spans(enc, [(3, 6)]).tolist() == [0, 1, 0, 0, 0, 0]
    assert mask_from_spans(enc, [(2, 4), (8, 10)]).tolist() == [1, 1, 1, 1, 1, 0]
    assert mask_from_spans(enc, [(12, 15)]).tolist() == [0, 0, 0, 0, 0, 1]
    assert mask_from_spans(enc, [(12, 14)]).tolist() == [0, 0, 0, 0, 0, 0]
    assert mask_from_spans(enc, []).tolist() == [0, 0, 0, 0, 0, 0]


def test_chat_opening_with_an_assistant_turn(tok):
    """The header (and a default system prompt) before a first assistant turn stay unmasked."""
    first = [{"role": "assistant", "content": "the model"}, {"role": "user", "content": "hi"}]
    check(
        tok,
        QWEN_DEFAULT_SYSTEM,
        first,
        [
            ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\n", 0),
            ("the model<|im_end|>", 1),
            ("\n<|im_start|>user\nhi<|im_end|>\n", 0),
        ],
    )
    check(
        tok,
        LLAMA3,
        first,
        [
            ("<s><|start_header_id|>assistant<|end_header_id|>\n\n", 0),
            ("the model<|eot_id|>", 1),
            ("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", 0),
        ],
    )
