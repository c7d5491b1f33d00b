"""The producer's main loop: read rows, tokenize them a batch at a time, enqueue, report.

Rows that give no sample are counted by kind: `bad` (broken input: it sets the exit status,
and `--strict` stops at the first), `empty` and `overlong` (reported, never enqueued;
`--overlong fail` stops at the first). A sample's length limit is `--max-len` or the model's
context, the smaller (harvest.producer.tokenize.LengthPolicy): a row past what the engine can take is
handled here, before it is enqueued, not by a job that holds the engine for minutes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from harvest.config import RunConfig
from harvest.errors import ConfigurationError
from harvest.formats.datasetids import SampleIds
from harvest.producer.enqueue import DEFAULT_MAX_QUEUED, Enqueuer
from harvest.producer.parallel import ProcessTokenizer
from harvest.producer.prefetch import prefetch
from harvest.producer.rowkinds import FieldMap, RowError
from harvest.producer.rows import BadRow
from harvest.producer.sources import read_dataset
from harvest.producer.tokenize import LengthPolicy, RowTokenizer
from harvest.progress import progress as progress_display
from harvest.sample import Sample
from harvest.settings import ProducerSettings

if TYPE_CHECKING:
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerBase

    from harvest.progress import PlainProgress

log = logging.getLogger("harvest.producer")
BATCH_ROWS = 256  # rows tokenized together (one encode_batch call)
KEEP_BAD_ROWS = 1000  # the first ones are kept for the summary; all are logged and counted


@dataclass
class ProduceSummary:
    rows: int = 0
    samples: int = 0  # rows that gave a sample (before the ledger check)
    sample_tokens: int = 0
    enqueued: int = 0
    skipped: int = 0
    bad: int = 0
    empty: int = 0
    overlong: int = 0
    truncated: int = 0
    tokens: int = 0  # tokens enqueued
    jobs: int = 0
    dry_run: bool = False
    bad_rows: list[str] = field(default_factory=list)

    def text(self) -> str:
        head = f"rows {self.rows}: {self.samples} samples ({self.sample_tokens} tokens)"
        if self.dry_run:
            body = "dry run, nothing enqueued"
        else:
            body = f"enqueued {self.enqueued} in {self.jobs} jobs ({self.tokens} tokens), skipped {self.skipped} already known"
        tail = f"bad {self.bad}, empty {self.empty}, overlong {self.overlong} skipped, truncated {self.truncated}"
        return f"{head}; {body}; {tail}"


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # no tokenizer files there, or one transformers cannot load
        raise ConfigurationError(str(e)) from e


def _batches(rows: Iterable, n: int) -> Iterator[list]:
    it = iter(rows)
    while batch := list(itertools.islice(it, n)):
        yield batch


def produce(
    conn: redis.Redis | None, cfg: RunConfig | None, dataset: str, *args: Any, dry_run: bool = False, **kw: Any
) -> ProduceSummary:
    """Tokenize DATASET and enqueue its samples for the run (or only count them, with dry_run);
    the arguments are `produce_pass`'s.

    Enqueues are idempotent, so a pass during which the Redis server changed (a restart that may
    have lost its last second of writes with `appendfsync everysec`, a failover: its INFO run_id
    differs) is simply followed by another, which enqueues only what the server does not know;
    the passes repeat until one ran on one server throughout."""
    if dry_run:
        return produce_pass(conn, cfg, dataset, *args, dry_run=True, **kw)
    from harvest.ops.recovery import server_id
    from harvest.state.passes import pass_finished, pass_started

    earlier = ProduceSummary()
    pass_started(conn, cfg.run)  # no node takes the run for done while this pass may still enqueue
    while True:
        before = server_id(conn)
        s = produce_pass(conn, cfg, dataset, *args, **kw)
        s.skipped = max(0, s.skipped - earlier.enqueued)  # what an earlier pass enqueued is not "already known"
        s.enqueued, s.tokens, s.jobs = s.enqueued + earlier.enqueued, s.tokens + earlier.tokens, s.jobs + earlier.jobs
        if server_id(conn) == before:
            pass_finished(conn, cfg.run)
            return s
        log.warning(
            "Redis restarted while %s was enqueued (a new server run_id): its last writes may be lost, so "
            "the dataset is enqueued again (samples Redis knows are skipped)",
            dataset,
        )
        earlier = s


def produce_pass(
    conn: redis.Redis | None,
    cfg: RunConfig | None,
    dataset: str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_queued: int = DEFAULT_MAX_QUEUED,
    progress: bool = True,
    strict: bool = False,
    *,
    fields: FieldMap = FieldMap(),
    chat_template: str | None = None,
    length: LengthPolicy = LengthPolicy(),
    dry_run: bool = False,
    on_bad: Callable[[BadRow], None] | None = None,
    processes: int = ProducerSettings.processes,
    on_wait: Callable[[int], None] | None = None,
    regenerate: bool | None = None,
    ids: SampleIds | None = None,
) -> ProduceSummary:
    """One pass over DATASET: tokenize it and enqueue its samples for the run (or only count
    them, with dry_run).

    `chat_template` is the template's text (overrides the tokenizer's). A dry run needs neither `conn`
    nor `cfg` when `tokenizer` is given. `on_wait(queued)` is called while the queue is full (the
    producer is waiting on the workers). `processes` > 1 tokenizes in that many worker processes
    (see harvest.producer.parallel for when that pays); otherwise one thread tokenizes ahead of the enqueue.
    `regenerate`: chat rows become conversations whose answers the workers write (default: as the
    run says, harvest.config.RunIdentity.regenerate; a dry run without a run says it here).
    `ids`: every sample's id is added to it (the dataset's samples, as `harvest run` keeps them).
    """
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer or cfg.model)
    # The model's context bounds every sample too; a dry run given only a tokenizer reads the
    # model folder it was loaded from.
    length = length.with_model(cfg.model if cfg is not None else getattr(tokenizer, "name_or_path", None))
    rows = read_dataset(dataset)
    s = ProduceSummary(dry_run=dry_run)
    bar = progress_display("produce", " rows", enabled=progress)
    enq = None
    if not dry_run:

        def waiting(q: int) -> None:
            bar.set_postfix_str(f"waiting: {q} queued")
            if on_wait:
                on_wait(q)

        enq = Enqueuer(conn, cfg, max_queued=max_queued, on_wait=waiting)
    if regenerate is None:
        regenerate = cfg is not None and cfg.regenerate is not None
    kw = dict(fields=fields, chat_template=chat_template, length=length, regenerate=regenerate)
    if processes > 1:
        to_samples = ProcessTokenizer(tokenizer, processes, **kw)
        tokenized = to_samples.map(_batches(rows, BATCH_ROWS))
    else:
        to_samples = RowTokenizer(tokenizer, **kw)
        tokenized = prefetch((b, to_samples(b)) for b in _batches(rows, BATCH_ROWS))
    fail_overlong = length.overlong == "fail"
    try:
        for batch, results in tokenized:
            for result in results:
                _count(s, result, enq, strict, fail_overlong, on_bad)
                if ids is not None and isinstance(result, Sample):
                    ids.add(result.id)
            s.rows += len(batch)
            _postfix(bar, s, enq, refresh=False)  # before the update, which draws it: never a batch behind
            bar.update(len(batch))
        if enq:
            enq.flush()
        _postfix(bar, s, enq, refresh=True)  # the final counts, the last flush's jobs among them
    finally:
        tokenized.close()  # stops the prefetch thread or the worker processes, also on --strict or an error
        bar.close()
    s.truncated = to_samples.truncated
    if enq:
        s.enqueued, s.skipped, s.tokens, s.jobs = (
            enq.stats.enqueued,
            enq.stats.skipped,
            enq.stats.tokens,
            enq.stats.jobs,
        )
    return s


def _postfix(bar: tqdm | PlainProgress, s: ProduceSummary, enq: Enqueuer | None, refresh: bool) -> None:
    """The display's counts as they are now (a dry run shows what it found)."""
    if enq:
        bar.set_postfix(enqueued=enq.stats.enqueued, skipped=enq.stats.skipped, bad=s.bad, refresh=refresh)
    else:
        bar.set_postfix(samples=s.samples, bad=s.bad, refresh=refresh)


def _count(
    s: ProduceSummary,
    result: Sample | BadRow,
    enq: Enqueuer | None,
    strict: bool,
    fail_overlong: bool,
    on_bad: Callable[[BadRow], None] | None,
) -> None:
    if isinstance(result, Sample):
        s.samples += 1
        s.sample_tokens += result.num_tokens
        if enq:
            enq.add(result)
        return
    setattr(s, result.kind, getattr(s, result.kind) + 1)
    if result.kind == "overlong" and fail_overlong:
        raise RowError(f"overlong row: {result}")
    if result.kind == "bad":
        if strict:
            raise RowError(f"bad row (--strict): {result}")
        if len(s.bad_rows) < KEEP_BAD_ROWS:
            s.bad_rows.append(str(result))
    (on_bad or _log_bad)(result)


def _log_bad(r: BadRow) -> None:
    log.warning("%s row %s", r.kind, r)
