"""What a row must become, computed independently of harvest's producer: the tokenizer's own
encoding and, for chats, transformers' assistant mask; for a --regenerate run, transformers' own
chat template rendering and HF `generate`, turn by turn."""


def expected_tokens(tokenizer, row):
    if "input_ids" in row:
        ids = row["input_ids"]
        return ids, [1] * len(ids)
    if "messages" in row:
        enc = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(enc["input_ids"]), list(enc["assistant_masks"])
    ids = tokenizer(row["text"])["input_ids"]
    return ids, [1] * len(ids)


def expected_regenerated(
    tokenizer, model, messages: list[dict], max_new: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """The regenerated conversation by transformers alone: each turn's prompt is the template's
    rendering of the conversation so far with its generation prompt, where the earlier answers are
    the model's own tokens, each closed by the template's <|im_end|> (the model's own stop token when
    it stopped); the text between turns is the template's, tokenized on its own."""
    import torch

    if messages[-1]["role"] != "assistant":
        messages = [*messages, {"role": "assistant", "content": "x"}]
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    ids: list[int] = []
    mask: list[int] = []
    turns: list[list[int]] = []
    done_text = ""  # the template's rendering of the turns before, as far as they are written
    for i in slots:
        head = render(messages[:i], gen=True)
        piece = encode(head[len(done_text) :])
        ids += piece
        mask += [0] * len(piece)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=stop,
                pad_token_id=0,
            )
        g = out[0, len(ids) :].tolist()
        turns.append(g)
        ids += g
        mask += [1] * len(g)
        if g[-1] not in stop:  # cut at max_new: the template closes the turn (its <|im_end|>), unmasked
            ids.append(stop[0])
            mask.append(0)
        done_text = render(messages[: i + 1])  # whatever the answer, the template goes on after its <|im_end|>
    tail = encode(render(messages)[len(done_text) :])
    return ids + tail, mask + [0] * len(tail), turns
