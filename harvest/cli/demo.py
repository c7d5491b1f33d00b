"""A tiny real model and dataset, built offline, for the demo and the tests.

The model is a Llama-architecture causal LM with random weights (fixed seed), its RMSNorm weights
drawn uniformly from [0.3, 2.0] rather than left at HF's all-ones init: with unit norms a state
before the final norm and one after it differ only by a scale, so code that applied the norm
twice, or not at all, would still pass every argmax test. The tokenizer is a byte-level BPE trained on text generated here, with a ChatML chat template that
marks assistant turns with `{% generation %}`. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
from typing import TYPE_CHECKING

from harvest.atomic import atomic_folder

if TYPE_CHECKING:
    import torch

DEMO_VERSION = "2"  # 2: random non-unit norm weights
DEMO_CHUNKED_PREFILL = 64  # the reference engine's chunk in `harvest demo`: demo_rows' lengths straddle it
# `harvest demo --regenerate`: the tiny model's turns, cut at this many tokens (a random model rarely
# ends a turn by itself, so the demo keeps cut turns: --on-length keep)
DEMO_MAX_NEW_TOKENS = 32
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the model reads a long prompt and writes hidden states for every token so that a small "
    "draft network can learn to guess what the large target network will say next while the "
    "queue holds batches of samples and workers claim dump files from the engine then the "
    "collector packs shards into object storage with an index file that commits each shard "
    "alpha beta gamma delta river mountain forest city code data token layer number seven"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def default_model_dir() -> str:
    base = os.environ.get("HARVEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "harvest")
    return os.path.join(base, f"demo-model-v{DEMO_VERSION}")


def build_tiny_model(path: str | None = None, *, layers: int = 8, hidden: int = 64, seed: int = 0) -> str:
    """Build (once) the tiny model and tokenizer into `path`; returns the path."""
    path = path or default_model_dir()
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [_sentence(rng, rng.randint(4, 30)) for _ in range(3000)]
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = CHAT_TEMPLATE

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    _randomize_norms(model, seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        with atomic_folder(path, prefix=".build-") as tmp:
            model.save_pretrained(tmp)
            fast.save_pretrained(tmp)
    except OSError:
        if not os.path.exists(os.path.join(path, "config.json")):  # lost a race to another builder: fine
            raise
    return path


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Every RMSNorm weight (each layer's two and the final one) uniform in [0.3, 2.0], fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.empty(param.shape).uniform_(0.3, 2.0, generator=gen))


def demo_chats(n: int = 12, seed: int = 1) -> list[dict]:
    """The chats of `demo_rows` (`harvest demo --regenerate`: only chats have answers to write)."""
    return [r for r in demo_rows(4 * n, seed) if "messages" in r][:n]


def demo_rows(n: int = 40, seed: int = 1, vocab_size: int = 512) -> list[dict]:
    """A mix of the row kinds the producer reads: plain text, multi-turn chats, pre-tokenized ids."""
    rng = random.Random(seed)
    rows: list[dict] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            rows.append({"text": " ".join(_sentence(rng, rng.randint(3, 25)) for _ in range(rng.randint(1, 4)))})
        elif kind in (1, 2):
            msgs = []
            if rng.random() < 0.5:
                msgs.append({"role": "system", "content": _sentence(rng, 6)})
            for _ in range(rng.randint(1, 3)):
                msgs.append({"role": "user", "content": _sentence(rng, rng.randint(3, 15))})
                msgs.append({"role": "assistant", "content": _sentence(rng, rng.randint(3, 30))})
            rows.append({"messages": msgs})
        else:
            length = (1, 2, 17, 64, 65, 130, 129, 3, 320, 8)[(i // 4) % 10]  # chunk edges at 64
            rows.append({"input_ids": [rng.randrange(5, vocab_size) for _ in range(length)]})
    rows.append({"text": " ".join(_sentence(rng, 20) for _ in range(20))})  # a long one, > 300 tokens
    return rows


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path
