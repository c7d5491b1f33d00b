"""Producer throughput and Redis footprint, on a private redis-server.

Prints, for a generated dataset of multi-turn chats (and one of plain texts):
  - samples/s of the whole producer (read JSONL -> chat template -> tokenize -> loss mask ->
    sample id -> idempotent enqueue into Redis) against the tokenizer alone on the same rows in
    the same run (rows already parsed in memory, the tokenizer's own batched call: goal >= 0.8);
    Also the CPU-time ratio (this process's threads, plus redis-server's CPU for the producer),
    which other load on the machine does not skew;
  - Redis bytes per queued sample (used_memory delta, and the sum of MEMORY USAGE over the run's
    keys) against the raw int32 bytes of its tokens (goal <= 1.2).

The tokenizer is a byte-level BPE with a 32k vocabulary trained here on generated text, so token
ids spread over a realistic range; nothing is downloaded.

    python bench/enqueue.py [--rows 5000] [--kinds chat,text] [--rounds 3] [--processes 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import redis  # noqa: E402

from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.config import RunConfig  # noqa: E402
from harvest.producer.producer import produce  # noqa: E402

CHATML = (  # no {% generation %} markers: the mask comes from prefix rendering, the general path
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _words(rng: random.Random, n: int) -> list[str]:
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    return ["".join(rng.choice(letters[: rng.randint(8, 26)]) for _ in range(rng.randint(2, 10))) for _ in range(n)]


def build_tokenizer(rng: random.Random, vocab: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (" ".join(rng.choices(vocab, k=200)) for _ in range(3000))
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=32000,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = CHATML
    return fast


def make_rows(kind: str, n: int, rng: random.Random, vocab: list[str]) -> list[dict]:
    def sent(k: int) -> str:
        return " ".join(rng.choices(vocab, k=k)) + "."

    rows = []
    for _ in range(n):
        if kind == "text":
            rows.append({"text": sent(rng.randint(100, 600))})
        else:
            msgs = [{"role": "system", "content": sent(20)}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": sent(rng.randint(10, 80))})
                msgs.append({"role": "assistant", "content": sent(rng.randint(20, 200))})
            rows.append({"messages": msgs})
    return rows


def tokenizer_alone(tok, kind: str, rows: list[dict], batch: int = 256) -> tuple[float, int]:
    """The tokenizer's own batched call on rows already in memory: (seconds, tokens)."""
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        if kind == "text":
            out = tok([r["text"] for r in part])["input_ids"]
        else:
            out = tok.apply_chat_template([r["messages"] for r in part], tokenize=True, return_dict=True)["input_ids"]
        tokens += sum(map(len, out))
    return time.perf_counter() - t0, tokens


def _cpu() -> float:
    """CPU seconds of this process's threads and of its finished child processes (--processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _redis_cpu(conn: redis.Redis) -> float:
    info = conn.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def redis_bytes(conn: redis.Redis, run: str) -> int:
    total = 0
    from rq.job import Job

    from harvest.state.jobs import run_queue
    from harvest.state.keys import Keys

    for pattern in (f"{Keys(run).prefix}:*", f"{Job.redis_job_namespace_prefix}*", run_queue(conn, run).key):
        for key in conn.scan_iter(match=pattern, count=1000):
            total += conn.memory_usage(key, samples=0) or 0
    return total


def bench(kind: str, n: int, tok, vocab, conn: redis.Redis, tmp: str, rounds: int, processes: int) -> dict:
    rng = random.Random(1)
    rows = make_rows(kind, n, rng, vocab)
    path = os.path.join(tmp, f"{kind}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tokenizer_alone(tok, kind, rows[:200])  # warm up (template compilation, thread pool)
    cfg = RunConfig(run=f"bench-{kind}", model="-", capture_points=[2], hidden_size=8, out_url=tmp)
    t_tok = t_all = c_tok = c_all = float("inf")
    for _ in range(rounds):  # alternate, and keep each one's best: other load on the machine hits both alike
        c0 = _cpu()
        t_tok = min(t_tok, tokenizer_alone(tok, kind, rows)[0])
        c_tok = min(c_tok, _cpu() - c0)
        conn.flushall()
        before, redis_cpu = conn.info("memory")["used_memory"], _redis_cpu(conn)
        t0, c0 = time.perf_counter(), _cpu()
        s = produce(conn, cfg, path, tokenizer=tok, max_queued=n + 1, progress=False, processes=processes)
        t_all = min(t_all, time.perf_counter() - t0)
        c_all = min(c_all, _cpu() - c0 + _redis_cpu(conn) - redis_cpu)
        delta = conn.info("memory")["used_memory"] - before
        assert s.enqueued == n, s.text()
    raw = 4 * s.tokens / n
    return {
        "kind": kind,
        "rows": n,
        "tokens/sample": s.tokens / n,
        "tokenizer samples/s": n / t_tok,
        "producer samples/s": n / t_all,
        "ratio": t_tok / t_all,
        "cpu ratio": c_tok / c_all,
        "tokenizer cpu s": c_tok,
        "producer cpu s": c_all,
        "raw int32 B/sample": raw,
        "redis B/sample (used_memory)": delta / n,
        "redis B/sample (MEMORY USAGE)": redis_bytes(conn, cfg.run) / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--kinds", default="chat,text")
    ap.add_argument("--processes", type=int, default=1, help="the producer's tokenizer processes")
    ap.add_argument("--rounds", type=int, default=3, help="alternating measurements; the best of each is kept")
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = _words(rng, 60000)
    tok = build_tokenizer(rng, vocab)
    with tempfile.TemporaryDirectory(prefix="harvest-bench-") as tmp:
        server = RedisServer(os.path.join(tmp, "redis")).start()
        try:
            conn = redis.Redis.from_url(server.url)
            for kind in args.kinds.split(","):
                r = bench(kind, args.rows, tok, vocab, conn, tmp, args.rounds, args.processes)
                print(f"[{r['kind']}] {r['rows']} rows, {r['tokens/sample']:.0f} tokens/sample")
                print(f"  tokenizer alone   {r['tokenizer samples/s']:9.0f} samples/s")
                print(
                    f"  producer          {r['producer samples/s']:9.0f} samples/s   ratio {r['ratio']:.2f} (goal >= 0.8)"
                )
                print(
                    f"  CPU seconds       {r['tokenizer cpu s']:9.2f} tokenizer, {r['producer cpu s']:.2f} producer "
                    f"(incl. redis-server): ratio {r['cpu ratio']:.2f}"
                )
                print(
                    f"  redis per sample  {r['redis B/sample (used_memory)']:9.0f} B (used_memory delta), "
                    f"{r['redis B/sample (MEMORY USAGE)']:.0f} B (MEMORY USAGE of the run's keys)"
                )
                print(
                    f"  raw int32 tokens  {r['raw int32 B/sample']:9.0f} B   ratio "
                    f"{r['redis B/sample (used_memory)'] / r['raw int32 B/sample']:.2f} / "
                    f"{r['redis B/sample (MEMORY USAGE)'] / r['raw int32 B/sample']:.2f} (goal <= 1.2)"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
