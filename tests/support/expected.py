"""What a row must become, computed independently of harvest's producer: the tokenizer's own
encoding and, for chats, transformers' assistant mask."""


def expected_tokens(tokenizer, row):
    if "input_ids" in row:
        ids = row["input_ids"]
        return ids, [1] * len(ids)
    if "messages" in row:
        enc = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(enc["input_ids"]), list(enc["assistant_masks"])
    ids = tokenizer(row["text"])["input_ids"]
    return ids, [1] * len(ids)
