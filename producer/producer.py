"""The producer's main loop: read, tokenize, enqueue, report."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis
from tqdm import tqdm

from harvest.config import RunConfig
from producer.enqueue import Enqueuer
from producer.sources import BadRow, read_dataset
from producer.tokenize import RowTokenizer

log = logging.getLogger("harvest.producer")


@dataclass
class ProduceSummary:
    rows: int = 0
    enqueued: int = 0
    skipped: int = 0
    bad: int = 0
    tokens: int = 0
    jobs: int = 0
    sample_ids: list[str] = field(default_factory=list)
    bad_rows: list[str] = field(default_factory=list)


def load_tokenizer(path: str, chat_template: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if chat_template:
        with open(chat_template, encoding="utf-8") as f:
            tok.chat_template = f.read()
    return tok


def produce(
    conn: redis.Redis,
    cfg: RunConfig,
    dataset: str,
    tokenizer=None,
    max_queued: int = 20000,
    progress: bool = True,
    strict: bool = False,
) -> ProduceSummary:
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer or cfg.model)
    to_sample = RowTokenizer(tokenizer)
    summary = ProduceSummary()
    bar = tqdm(desc="produce", unit=" rows", disable=not progress, leave=False)
    enq = Enqueuer(conn, cfg, max_queued=max_queued, on_wait=lambda q: bar.set_postfix_str(f"waiting: {q} queued"))
    for item in read_dataset(dataset):
        summary.rows += 1
        bar.update(1)
        result = item if isinstance(item, BadRow) else to_sample(item)
        if isinstance(result, BadRow):
            summary.bad += 1
            summary.bad_rows.append(str(result))
            log.warning("bad row %s", result)
            if strict:
                raise ValueError(f"bad row (--strict): {result}")
            continue
        summary.sample_ids.append(result.id)
        enq.add(result)
    enq.flush()
    bar.close()
    summary.enqueued, summary.skipped = enq.stats.enqueued, enq.stats.skipped
    summary.tokens, summary.jobs = enq.stats.tokens, enq.stats.jobs
    return summary
