"""Spool files of samples the ledger does not know: taken up again, not left on the spool.

Why. A Redis that forgets its last second (a rollback, a failover) can forget both the enqueue
of a job and the settle call of the worker that ran it. The samples' spool files are durable on
the node, the ledger has no state for them, and no job will run them again: the producer saw its
enqueue succeed. A worker's own settle takes samples the ledger forgot (Ledger.mark_spooled moves
absent ones); this is the same move for those whose settle was forgotten too.

Who owns what. The collector of the spool: it marks such samples spooled, owned by its spool,
each with a payload row read from its file (so a later reclaim can enqueue it again; none for a
regenerated conversation, whose row was the conversation), and packs them like any other. A file
whose sample has any state is not touched here: queued (its worker has yet to settle), spooled,
done or failed all have an owner already. A sample that another node committed meanwhile is
kept from a second commit by the claims in storage (harvest.formats.claims), as every sample is.

What fences a late return. A node back after its spool was revoked takes nothing up: the ledger
refuses a revoked spool as an owner, and the collector rotates to a new id at its next lease
renewal; the files of samples reclaimed meanwhile are then spooled or committed by others and go.
A Redis that forgets this move (its last second lost again) leaves the samples unknown, and the
next poll takes them up again: the move is idempotent.
"""

from __future__ import annotations

import logging

from harvest.sample import Sample, SampleError
from harvest.state.ledger import Ledger
from harvest.state.payload import payload_row

log = logging.getLogger("harvest.collector")


def take_up(ledger: Ledger, run: str, spool_id: str, files: list[tuple[str, str]]) -> list[str]:
    """Mark the samples of `files` ((sample id, spool file)) spooled by `spool_id`, those the
    ledger still does not know. Returns the ids it marked."""
    if not files:
        return []
    rows = [_row(run, sid, path) for sid, path in files]
    marked = ledger.mark_spooled([sid for sid, _ in files], owner=spool_id, rows=rows)
    if marked:
        log.warning(
            "%d spool files of samples the ledger did not know (a Redis that forgot their job and its "
            "settle), e.g. %s: marked spooled by spool %s, to be packed",
            len(marked),
            marked[0],
            spool_id,
        )
    return marked


def _row(run: str, sid: str, path: str) -> str:
    """The sample's payload row from its spool file's tokens; '' where they are not the sample's
    own content (a regenerated conversation) or the file cannot be read (its commit will say)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="np") as f:
            s = Sample.build(f.get_tensor("input_ids"), f.get_tensor("loss_mask"))
    except (OSError, SafetensorError, SampleError, KeyError, ValueError):
        return ""
    return payload_row(run, s) if s.id == sid else ""
