"""The regeneration stage under faults: kills, and the seeds that make a retry sample the same tokens.

Kill chaos: `RegenTrial`, tests/support/chaos.py's Trial on a `--regenerate` run of chat rows
(private Redis, reference engine, workers, collectors, producer as processes), with a fault aimed
at the stage: a worker SIGKILLed while its job is in the generation step, or a node lost, for
good, once its spool holds conversations written and extracted but not committed. The harness's
accounting (every sample committed once or failed with a reason, nothing left behind) gains the
generated dataset: exactly one entry per committed sample, in the committed generated files and
through `iter_generated`, none for anything else, no generated file without an index, and each
entry's turns spliced into the producer's skeleton are exactly the committed input_ids and
loss_mask (so the turns' tokens are the loss-masked tokens). A tampered copy of a finished run
shows the accounting catches a doubled and a wrong entry.

Seeds: at temperature 1.0, samples that fail after their turns were written (the engine's
test-only dump faults) are requeued and written again under new attempt numbers; their turns
equal an independent clean run's of the same dataset (same sample ids: same per-turn seeds).
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import redis

from harvest.cli.demo import write_jsonl
from harvest.cli.redisproc import free_port
from harvest.formats.generated import GENERATED, decode_generated, encode_generated, entry
from harvest.formats.spool import read_sample
from harvest.health import healthy
from harvest.node.spooldir import list_spooled
from harvest.read.generated import iter_generated
from harvest.read.reader import RunReader
from harvest.state.conversation import turn_seed
from harvest.state.keys import Keys, worker_key
from harvest.state.ledger import SPOOLED, Ledger
from harvest.storage import Location
from tests.support.chaos import Trial
from tests.support.chaos_result import TrialResult
from tests.support.cli import harvest_cli
from tests.support.ops import Procs
from tests.support.wait import wait_for

REGEN = ("--max-new-tokens", "32", "--on-length", "keep")  # the tiny random model seldom stops before
WORDS = (
    "the",
    "model",
    "writes",
    "its",
    "own",
    "answers",
    "before",
    "states",
    "are",
    "taken",
    "from",
    "every",
    "layer",
    "and",
    "nothing",
    "is",
    "lost",
)


def make_chats(n: int, rng: random.Random, min_turns: int = 1, max_turns: int = 3) -> list[dict]:
    """Chat rows of `min_turns`..`max_turns` answered user turns; about a third end on the user (one
    more answer to write), about a third have a system prompt."""

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": say(4)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(min_turns, max_turns)):
            msgs += [
                {"role": "user", "content": say(rng.randint(2, 12))},
                {"role": "assistant", "content": say(rng.randint(2, 12))},
            ]
        rows.append({"messages": msgs[:-1] if rng.random() < 0.3 else msgs})
    return rows


def chat_samples(model: str, rows: list[dict]) -> dict:
    """Sample id -> the sample (skeleton and conversation) a `--regenerate` producer makes of each row."""
    from transformers import AutoTokenizer

    from harvest.producer.rows import BadRow, Row
    from harvest.producer.tokenize import LengthPolicy, RowTokenizer

    tok = RowTokenizer(AutoTokenizer.from_pretrained(model), length=LengthPolicy().with_model(model), regenerate=True)
    samples = tok([Row(r, f"row {i}") for i, r in enumerate(rows)])
    assert not [s for s in samples if isinstance(s, BadRow)], samples
    return {s.id: s for s in samples}


def check_generated(sample, g: dict, ids: np.ndarray, mask: np.ndarray) -> str:
    """Why entry `g` and the committed (`ids`, `mask`) disagree with the producer's `sample`, or ""."""
    conv, turns = sample.conv, [list(t["tokens"]) for t in g["turns"]]
    if len(turns) != conv.turns:
        return f"{len(turns)} turns for {conv.turns} assistant slots"
    if [t for turn in turns for t in turn] != ids[mask == 1].tolist():
        return f"its {sum(map(len, turns))} turn tokens are not the {int(mask.sum())} loss-masked tokens"
    want_ids, want_mask = conv.splice(conv.pieces(sample.input_ids), turns)
    if want_ids.tolist() != ids.tolist() or want_mask.tolist() != mask.tolist():
        return "the skeleton spliced with its turns is not the committed sample"
    for k, t in enumerate(g["turns"]):
        if t["seed"] != turn_seed(sample.id, k) or (t["finish_reason"] == "stop") != (t["tokens"][-1] in conv.stop):
            return f"turn {k}: seed {t['seed']}, finish reason {t['finish_reason']}, last token {t['tokens'][-1]}"
    if [m["role"] for m in g["messages"]] != [m["role"] for m in conv.messages]:
        return "its messages' roles are not the conversation's"
    return ""


def _written(log: str, job: str) -> bool:
    """Whether a worker's log says job `job`'s conversations were all written (harvest.workers.regenerate)."""
    return any(f"job {job}: " in line and " conversations written, " in line for line in log.splitlines())


@dataclass
class RegenResult(TrialResult):
    generated_missing: list[str] = field(default_factory=list)  # committed, with no entry
    generated_doubled: list[str] = field(default_factory=list)  # entries beyond one per committed sample
    generated_wrong: list[str] = field(default_factory=list)  # entries that are not their sample's turns
    generated_without_index: list[str] = field(default_factory=list)  # generated files no index names
    kills_mid_generation: int = 0  # worker kills whose job had not written all its turns

    @property
    def ok(self) -> bool:
        return super().ok and not (
            self.generated_missing or self.generated_doubled or self.generated_wrong or self.generated_without_index
        )

    def summary(self) -> str:
        return (
            f"{super().summary()}; generated: missing {self.generated_missing[:3]}, doubled "
            f"{self.generated_doubled[:3]}, wrong {self.generated_wrong[:3]}, files without index "
            f"{self.generated_without_index[:3]}, kills mid-generation {self.kills_mid_generation}"
        )


class RegenTrial(Trial):
    """A Trial of a `--regenerate` run (the producer's flags: `regenerate`) over `samples` chat rows
    of at least `min_turns` turns, with one strike aimed at the stage instead of random kills:
    `mid_generation` SIGKILLs a worker whose heartbeat names a job that its log has not said is
    written and whose engine has finished a turn since (the job is in its generation step);
    `lose_spooled` loses the first node whose spool holds samples the ledger has spooled. `args`:
    more flags for a process, by name (`collector1`) or kind (`producer`); a later flag wins."""

    def __init__(
        self,
        root: str,
        model: str,
        seed: int,
        *,
        regenerate: tuple[str, ...] = REGEN,
        mid_generation: bool = False,
        lose_spooled: bool = False,
        args: dict[str, tuple[str, ...]] | None = None,
        min_turns: int = 1,
        **kw,
    ) -> None:
        super().__init__(root, model, seed, kills=0, **kw)
        self.result = RegenResult(seed, self.n)
        self.flags, self.args, self.min_turns = regenerate, args or {}, min_turns
        self.mid_generation, self.lose_spooled = mid_generation, lose_spooled
        self.struck, self.target, self.lost, self.conn, self.t0 = 0, None, None, None, 0.0
        self.log_from: dict[str, int] = {}  # process -> where its current incarnation's log begins
        self.base: dict[tuple[str, str], int] = {}  # (worker, job) -> its engine's generated tokens when first seen

    def _write_dataset(self, vocab: int) -> dict:
        chats = make_chats(self.n, self.rng, self.min_turns, max(3, self.min_turns))
        write_jsonl(self.data, chats + chats[: max(1, self.n // 10)])  # duplicate rows: one conversation
        self.conversations = chat_samples(self.model, chats)
        return dict(self.conversations)

    def _cmd(self, name: str) -> list[str]:
        extra = [*self.args.get(name.rstrip("0123456789."), ()), *self.args.get(name, ())]
        return [*super()._cmd(name), *(["--regenerate", *self.flags] if name == "producer" else []), *extra]

    def _start(self, name: str) -> None:
        path = os.path.join(self.logs, f"{name}.log")
        self.log_from[name] = os.path.getsize(path) if os.path.exists(path) else 0
        super()._start(name)

    def _log(self, name: str, start: int, end: int | None = None) -> str:
        with open(os.path.join(self.logs, f"{name}.log"), "rb") as f:
            f.seek(start)
            return f.read(-1 if end is None else end - start).decode(errors="replace")

    def _names(self, kind: str) -> list[str]:
        return [self.target] if kind == "worker" and self.target else super()._names(kind)

    def _lose_node(self, now: float, n: int | None = None) -> None:
        super()._lose_node(now, self.lost if n is None else n)

    def execute(self) -> RegenResult:
        self.t0 = time.monotonic()  # the base's clock, to the millisecond
        return super().execute()

    def _supervise(self) -> None:
        super()._supervise()
        if self.struck or not (self.mid_generation or self.lose_spooled):
            return
        self.conn = self.conn or redis.Redis.from_url(self.redis.url)
        now = time.monotonic() - self.t0
        if self.mid_generation and (aim := self._generating()):
            self.target, job = aim
            began = self.log_from[self.target]
            self.result.timeline.append(f"{now:.1f}s kill {self.target} in job {job}'s generation step")
            self._kill_one("worker", now)
            written = _written(self._log(self.target, began, self.log_from[self.target]), job)
            self.result.kills_mid_generation += not written
            self.struck, self.target = 1, None
        elif self.lose_spooled and (held := [(k, n) for k in self._up() if (n := self._spooled_on(k))]):
            self.lost, n = held[0]
            self.result.timeline.append(f"{now:.1f}s node{self.lost}'s spool holds {n} spooled samples")
            self._kill_one("node", now)
            self.struck = 1

    def _generating(self) -> tuple[str, str] | None:
        live = {str(p.pid): name for name, p in self.procs.items() if name.startswith("worker") and p.poll() is None}
        for w in self.conn.smembers(Keys(self.run).workers):
            b = {k.decode(): v.decode() for k, v in self.conn.hgetall(worker_key(w.decode())).items()}
            name, job = live.get(b.get("pid", "")), b.get("job", "")
            if (
                name is None
                or b.get("state") != "busy"
                or not job
                or _written(self._log(name, self.log_from[name]), job)
            ):
                continue
            n = int(name.removeprefix("worker").split(".")[0])
            tokens = _get(f"http://127.0.0.1:{self.port + n}/get_server_info").get("generated_tokens")
            if tokens is not None and tokens > self.base.setdefault((name, job), tokens):
                return name, job
        return None

    def _spooled_on(self, n: int) -> int:
        ids = [sid for sid, _, _ in list_spooled(self.spool(n))]
        return sum(st == SPOOLED for st in Ledger(self.conn, self.run).states(ids)) if ids else 0

    def _finished(self, conn: redis.Redis) -> bool:
        done = super()._finished(conn)
        if done and not self.struck and (self.mid_generation or self.lose_spooled):
            self.result.error = "the run finished before the aimed fault could strike"
        return done

    def _account(self, conn: redis.Redis) -> None:
        try:
            entries = self.account_generated()
        except Exception as e:  # noqa: BLE001 - a generated dataset that cannot be read: counted, as the base does
            self.result.unreadable, entries = f"generated dataset: {type(e).__name__}: {e}", {}
        # The base compares each committed sample's input_ids with `expected`: the skeleton with its turns.
        self.expected = {
            sid: s.conv.splice(s.conv.pieces(s.input_ids), [t["tokens"] for t in entries[sid]["turns"]])[0].tolist()
            if sid in entries
            else s.input_ids.tolist()
            for sid, s in self.conversations.items()
        }
        super()._account(conn)

    def account_generated(self) -> dict[str, dict]:
        """The generated dataset against the committed samples, from the output alone; returns the
        entries `iter_generated` reads, by sample id."""
        res, url = self.result, f"{self.out}/{self.run}"
        loc = Location.from_url(url)
        docs = {n.removesuffix(".json"): loc.read_json(f"index/{n}") for n in loc.list("index", ".json")}
        copies, raw, named = Counter(), Counter(), set()
        res.generated_missing, res.generated_doubled, res.generated_wrong = [], [], []
        for name, doc in docs.items():  # counted from the committed files themselves
            copies.update(doc["samples"])
            if (gen := doc.get("generated")) is not None:
                named.add(gen["file"])
                ids = [r["id"] for r in decode_generated(loc.read_bytes(gen["file"]), gen["file"], gen["sha256"])]
                raw.update(ids)
                if sorted(ids) != sorted(doc["samples"]) or len(ids) != gen["rows"]:
                    res.generated_wrong.append(f"shard {name}: its generated file's ids are not its index's samples")
        res.generated_without_index = sorted({f"{GENERATED}/{n}" for n in loc.list(GENERATED)} - named)
        entries, read, reader = {}, Counter(), RunReader(url)
        for g in iter_generated(url):
            read[g["id"]] += 1
            entries[g["id"]] = g
            if g["id"] in self.conversations and copies[g["id"]]:
                got = reader.get(g["id"])
                if why := check_generated(self.conversations[g["id"]], g, got["input_ids"], got["loss_mask"]):
                    res.generated_wrong.append(f"{g['id']}: {why}")
        for sid in copies | raw | read:
            if raw[sid] > copies[sid] or read[sid] > min(1, copies[sid]):
                res.generated_doubled.append(sid)
            elif raw[sid] < copies[sid] or read[sid] < min(1, copies[sid]):
                res.generated_missing.append(sid)
        return entries


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}  # an engine restarting, or killed: no news


def test_a_worker_killed_mid_generation_loses_and_doubles_no_conversation(tiny_model, tmp_path):
    # Jobs of 4 chats of 2-3 turns of 64 tokens: each spends a second or more in its generation step, a
    # window the strike (polled every 0.2 s) hits, and verifies from the killed worker's log that it did.
    trial = RegenTrial(
        str(tmp_path),
        tiny_model,
        51,
        samples=10,
        workers=1,
        deadline_s=240,
        mid_generation=True,
        regenerate=("--max-new-tokens", "64", "--on-length", "keep"),
        min_turns=2,
        args={"producer": ("--batch-samples", "4")},
    )
    result = trial.execute()
    assert result.ok, result.summary() + "\n" + "\n".join(result.timeline)
    assert result.kills == {"worker": 1} and result.kills_mid_generation == 1, "\n".join(result.timeline)
    assert result.done == len(trial.conversations) == 10 and result.failed == 0, result.summary()
    _accounting_catches_tampering(trial)


def _accounting_catches_tampering(trial: RegenTrial) -> None:
    """The accounting fails the finished run once an entry is doubled into another shard's generated
    file, or once a turn's token is changed (each file rewritten with its index's sha256 and rows)."""
    loc = Location.from_url(f"{trial.out}/{trial.run}")
    names = [n.removesuffix(".json") for n in loc.list("index", ".json")]
    assert len(names) >= 2, names  # several jobs, max-wait 1 s: several shards
    kept = {
        n: {p: loc.read_bytes(p) for p in (f"index/{n}.json", loc.read_json(f"index/{n}.json")["generated"]["file"])}
        for n in names
    }

    def rewrite(name: str, edit) -> None:
        doc = loc.read_json(f"index/{name}.json")
        gen = doc["generated"]
        rows = edit(decode_generated(loc.read_bytes(gen["file"]), gen["file"]))
        data = encode_generated(rows)
        doc["generated"] = entry(gen["file"], data, len(rows))
        for p, b in ((gen["file"], data), (f"index/{name}.json", json.dumps(doc).encode())):
            with open(loc.path(p), "wb") as f:
                f.write(b)

    trial.account_generated()
    assert trial.result.ok, trial.result.summary()  # as the trial left it
    first = next(iter_generated(f"{trial.out}/{trial.run}"))  # the first shard's first conversation
    rewrite(names[-1], lambda rows: [*rows, first])
    trial.account_generated()
    assert trial.result.generated_doubled == [first["id"]] and not trial.result.ok, trial.result.summary()
    for files in kept.values():
        for p, b in files.items():
            with open(loc.path(p), "wb") as f:
                f.write(b)
    trial.account_generated()
    assert trial.result.ok, trial.result.summary()

    def change_a_token(rows: list[dict]) -> list[dict]:
        rows[0]["turns"][-1]["tokens"][0] ^= 1
        return rows

    rewrite(names[0], change_a_token)
    trial.account_generated()
    wrong = trial.result.generated_wrong
    assert len(wrong) == 1 and "loss-masked" in wrong[0] and not trial.result.ok, trial.result.summary()


def test_a_lost_node_with_written_uncommitted_conversations_commits_each_once_elsewhere(tiny_model, tmp_path):
    # The collectors would wait an hour for a shard (they commit early only once nothing is queued): the
    # first node whose spool holds conversations its worker wrote and extracted is lost, for good, then.
    # Sampled (temperature 1): the other node writes the reclaimed conversations again with the same seeds.
    trial = RegenTrial(
        str(tmp_path),
        tiny_model,
        52,
        samples=10,
        workers=1,
        nodes=2,
        returns=("never",),
        grace_s=5,
        deadline_s=240,
        lose_spooled=True,
        regenerate=(*REGEN, "--temperature", "1.0", "--top-p", "0.9"),
        args={"producer": ("--batch-samples", "2"), "collector": ("--max-wait", "3600")},
    )
    result = trial.execute()
    assert result.ok, result.summary() + "\n" + "\n".join(result.timeline)
    assert result.kills == {"node": 1} and result.node_returns == {"never": 1}, result.summary()
    assert result.spools_reclaimed == 1, result.summary()  # node 1's spool, its samples put back
    assert result.done == len(trial.conversations) == 10 and result.failed == 0, result.summary()
    # The lost disk as it was left: conversations written, extracted and spooled there, never committed
    # from there; node 0 wrote each again, token for token, and committed it once.
    committed = {g["id"]: g["turns"] for g in iter_generated(f"{trial.out}/{trial.run}")}
    stranded = [read_sample(path) for _, path, _ in list_spooled(trial.spool(trial.lost))]
    assert stranded, f"node {trial.lost} was lost with nothing on its spool"
    for s in stranded:
        assert [t["tokens"] for t in json.loads(s.generation)["turns"]] == [t["tokens"] for t in committed[s.id]]


SEEDED = (
    "--regenerate",
    "--temperature",
    "1.0",
    "--top-p",
    "0.9",
    "--max-new-tokens",
    "8",
    "--on-length",
    "keep",
    "--batch-samples",
    "1",
)


def _turns(run_url: str) -> dict[str, list[list[int]]]:
    return {g["id"]: [t["tokens"] for t in g["turns"]] for g in iter_generated(run_url)}


def test_a_failed_sample_written_again_samples_the_same_tokens(tiny_model, tmp_path):
    """Two samples fail after their turns were written (the engine's test-only dump faults: wrong
    token ids in one sample's dump, a NaN in another's); `harvest requeue` puts them back and the
    same `harvest run` again writes and extracts them, under new attempt numbers (new rids): their
    turns equal those of a clean run of the same dataset in another run folder. One engine serves
    the three runs in turn (the first spends its two faults); it keeps nothing between requests but
    each request's own KV cache and seeded generator."""
    chats = make_chats(4, random.Random(7), min_turns=2)
    data = write_jsonl(str(tmp_path / "chats.jsonl"), chats)
    out, dumps, ids = f"file://{tmp_path}/out", str(tmp_path / "dumps"), set(chat_samples(tiny_model, chats))
    procs = Procs(str(tmp_path / "logs"))
    try:
        port = free_port()
        engine = procs.start(
            "engine",
            "engine",
            "--model",
            tiny_model,
            "--dump-dir",
            dumps,
            "--port",
            str(port),
            env={"HARVEST_ENGINE_FAULTS": "bad-ids:1,nan:1"},
        )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(url, 1) or engine.poll() is not None, 120, "the engine healthy")
        assert engine.poll() is None, procs.log("engine")

        def run(name: str, work: str):
            return harvest_cli(
                "run",
                data,
                "--model",
                tiny_model,
                "--out",
                out,
                "--run",
                name,
                "--dtype",
                "fp32",
                "--workers",
                "1",
                "--no-progress",
                "--engine-url",
                url,
                "--dump-dir",
                dumps,
                "--work-dir",
                str(tmp_path / work),
                *SEEDED,
            )

        res = run("faulted", "w1")
        assert res.returncode == 1 and "samples: 2 done, 2 failed" in res.stdout, res.stdout + res.stderr
        assert "failed because nonfinite: 1" in res.stdout and "failed because token-mismatch: 1" in res.stdout
        failed = sorted(ids - set(_turns(f"{out}/faulted")))
        assert len(failed) == 2, failed
        res = harvest_cli("requeue", "--run", "faulted", "--work-dir", str(tmp_path / "w1"), "--all")
        assert res.returncode == 0 and res.stdout.startswith("requeued 2 failed samples"), res.stdout + res.stderr
        res = run("faulted", "w1")
        assert res.returncode == 0 and "samples: 4 done, 0 failed" in res.stdout, res.stdout + res.stderr
        assert "generated: 6 conversations written" in res.stdout, res.stdout  # the run's: 4, then the 2 again
        res = run("clean", "w2")
        assert res.returncode == 0 and "samples: 4 done, 0 failed" in res.stdout, res.stdout + res.stderr
    finally:
        procs.close()
    clean, rerun = _turns(f"{out}/clean"), _turns(f"{out}/faulted")
    assert sorted(clean) == sorted(rerun) == sorted(ids)  # the same sample ids, so the same seeds
    assert [rerun[sid] for sid in failed] == [clean[sid] for sid in failed]
    assert rerun == clean
    # Sampled: every turn longer than a token and no two alike, so the equality is about the seeds.
    turns = [tuple(t) for ts in clean.values() for t in ts]
    assert min(map(len, turns)) > 1 and len(set(turns)) == len(turns)
