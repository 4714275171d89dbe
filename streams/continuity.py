"""A worker whose broker came back empty starts afresh, instead of dying or going blind.

The embedded broker keeps everything in memory: restarted under a running worker, it comes
back with every topic created anew and every offset starting again at 0. The worker had read
its events topic and changelogs far beyond those offsets, and everything that remembers an
offset is now wrong: Faust's recovery found a changelog ending below what it had read and
stopped the worker with ``ConsistencyError``; its consumer drops records below the offsets it
has read; each run's state skips events at offsets it has applied as replays. The same
happens on any cluster whose topics are deleted and created again.

Such a broker is recognised by its topics' ids: a topic created again has a new one. The worker
compares the ids of the topics it reads (events, acks, its changelogs) with those it first saw,
before every recovery (a broker restart always makes the group join again) and every few
seconds. On a new id it says so in one line, delivers what it still holds for the alerts
topic, and starts again in place (the same process, executed afresh). By then what it had in
flight when the broker went away (state flushed to a changelog, offsets committed, all about
the old logs) may have reached the new broker: so the fresh start, told by a marker file in the
worker's data folder, restores none of the changelogs' records and reads its events and acks
partitions from their beginning, not from the group's committed offsets, in its first
assignment. Everything on the new topics is read once more, with nothing remembered of offsets
that no longer exist. The runs' state (baselines, breakers, open alerts) lived on the
changelogs the broker lost, so it is rebuilt from the events that come, as a worker started on
that broker would; an alert raised again has the id it had.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from trainguard.core.admin import topic_ids
from trainguard.core.kafka import KafkaSettings

log = logging.getLogger("trainguard.worker")

# Exit status of a worker that must start afresh and cannot execute itself again (one built
# with create_app outside `trainguard worker`): EX_TEMPFAIL, for a supervisor to restart it.
EXIT_START_AFRESH = 75
VERIFY_EVERY_S = 5.0


class Continuity:
    """Whether the broker still holds the logs this worker read, by their topic ids.
    ``afresh(why)`` is called (and does not return) when one of ``topics`` has another id than
    the one first seen; a broker without topic ids (Kafka before 2.8) is never judged.

    ``sources`` are the topics the worker consumes (the rest are its changelogs). ``pending``:
    this process was started afresh (the marker in ``folder`` names it) and has not finished its
    first recovery: the changelogs are not restored and the sources are read from their
    beginning (``WorkerRecovery``, ``WorkerConsumer``)."""

    MARKER = "started-afresh"

    def __init__(self, settings: KafkaSettings, sources: list[str], changelogs: list[str],
                 afresh: Callable[[str], Any], folder: str | Path | None = None):
        from confluent_kafka.admin import AdminClient

        self.sources = set(sources)
        self.topics = [*sources, *changelogs]
        self.afresh = afresh
        self.ids: dict[str, str] = {}
        self.marker = Path(folder) / self.MARKER if folder is not None else None
        self.pending = self._take_marker()
        # quiet: the worker's own lines say when the broker is away; this only asks for ids
        self.admin = AdminClient(settings.confluent(log_level=0, error_cb=lambda _err: None))

    def _take_marker(self) -> bool:
        """Whether the marker names this process (the one that executed itself afresh); it is
        removed either way, so only the first start after it reads from the beginning."""
        if self.marker is None:
            return False
        try:
            pid = self.marker.read_text().strip()
        except OSError:
            return False
        self.marker.unlink(missing_ok=True)
        return pid == str(os.getpid())

    def mark(self) -> None:
        """Tell the next start of this process to trust nothing it finds (see the module)."""
        if self.marker is None:
            return
        try:
            self.marker.write_text(f"{os.getpid()}\n")
        except OSError as exc:  # it then resumes at committed offsets: what it processed is not read again
            log.error("trainguard worker: cannot write %s (%s): after starting afresh it resumes where this one "
                      "committed on the new topics", self.marker, exc)

    def done(self) -> None:
        """The first recovery after starting afresh is over: offsets and state are this process's own."""
        self.pending = False

    async def verify(self, timeout: float = 2.0) -> None:
        """Compare the ids with those remembered; start afresh on a new one. Quiet while the
        broker does not answer: the next rebalance or tick asks again."""
        try:
            ids = await asyncio.wait_for(asyncio.to_thread(topic_ids, self.admin, self.topics, timeout),
                                         timeout + 2.0)
        except Exception as exc:
            log.debug("trainguard: topic ids not read: %s", exc)
            return
        renewed = [t for t in self.topics if ids.get(t) and self.ids.get(t) and ids[t] != self.ids[t]]
        if renewed:
            self.afresh(f"{', '.join(renewed)} came back with new topic ids")
            return  # a test's afresh returns: what it saw is remembered below
        self._update(ids)

    def _update(self, ids: dict[str, str]) -> None:
        self.ids.update({t: i for t, i in ids.items() if i})


def start_afresh(app, why: str, *, in_place: bool) -> NoReturn:
    """Say why in one line, deliver the alerts and commands still queued (the broker answers:
    that is how its new topics were seen), and start again: executed afresh in the same process
    by ``trainguard worker`` (``in_place``), else exit with ``EXIT_START_AFRESH``."""
    log.error("trainguard worker: the broker lost what this worker had read (%s: it restarted without its data, "
              "or the topics were created again); starting afresh: the new topics are read from their beginning, "
              "and each run's baselines, breaker and open alerts are rebuilt from the events that come", why)
    outputs = getattr(app, "trainguard_outputs", None)
    if outputs is not None:
        left = outputs.flush(5.0)
        if left:
            log.error("trainguard worker: %d alert(s)/command(s) not delivered before starting afresh", left)
    members = getattr(app, "trainguard_members", None)
    if members is not None:  # the next start ends this membership at once, as a worker that stopped
        members.mark_stopped()
    continuity = getattr(app, "trainguard_continuity", None)
    if in_place and continuity is not None:
        continuity.mark()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if in_place:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    os._exit(EXIT_START_AFRESH)
