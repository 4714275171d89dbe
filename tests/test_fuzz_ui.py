"""Whatever is written to any topic, the run page's record handling holds: records built by
hypothesis from the schemas of every kind, with any strings (injection payloads, control
characters, lone surrogates) and any values where the schema leaves a field open, read from
any of the five topics. The board takes every record without its catch-all firing, every page
renders, and no page holds markup a record put there. About 10 s."""

from __future__ import annotations

import json

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.scenarios import _UI_PAYLOADS, _ui_injections_in
from trainguard.core.kafka import Topics
from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.ui import Board, render_index, render_report_page, render_run

RULES = rules_mod.default()
TOPICS = Topics()
TOPIC_NAMES = [TOPICS.events, TOPICS.alerts, TOPICS.control, TOPICS.acks, TOPICS.status]

payloads = st.sampled_from([p.format(i=7) for p in _UI_PAYLOADS] + ["\x1b]8;;x\x1b\\", "a&amp;b", "\u202e", ""])
anything = st.text(st.characters(codec=None, exclude_categories=()), max_size=30)
text = st.one_of(payloads, anything, st.builds(lambda a, b: a + b, payloads, anything))
run_ids = st.one_of(st.sampled_from(["run-a", "run-b", '"><b>x</b>', "javascript:alert(1)"]),
                    st.from_regex(ev.RUN_ID, fullmatch=True), text)
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                    st.sampled_from(["NaN", "Infinity", None, True]))
steps = st.one_of(st.integers(0, 60), st.integers(0, 60), st.integers(-2**70, 2**70), text, st.none())
times = st.one_of(st.floats(1.0e9, 2.0e9), st.floats(1.0e9, 2.0e9), st.floats(), text)
leaf = st.one_of(text, numbers, st.none(), st.booleans())
values = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(text, inner, max_size=4)), max_leaves=12)
names = st.one_of(text, st.sampled_from(["actor/pg_loss", "actor/kl_loss", "gpu/utilization_pct", "loss"]))
sources = st.one_of(st.fixed_dictionaries({"kind": st.sampled_from(["trainer", "node"]), "host": text,
                                           "rank": st.one_of(st.none(), st.integers(0, 3))}), values)


def kind(schema: str, required: dict, optional: dict):
    return st.fixed_dictionaries({"schema": st.just(schema), **required}, optional=optional)


# Each kind with the topic it belongs on; most records go there, the rest anywhere.
BY_TOPIC = [
    (TOPICS.events, kind(ev.METRICS, {"run_id": run_ids, "source": sources, "step": steps, "ts": times,
                                      "metrics": st.one_of(st.dictionaries(names, numbers, max_size=6), values)},
                         {"tags": values, "layer": text})),
    (TOPICS.events, kind(ev.CHECKPOINT, {"run_id": run_ids, "step": steps, "path": text, "ts": times},
                         {"source": sources})),
    (TOPICS.events, kind(ev.LIFECYCLE, {"run_id": run_ids, "event": st.sampled_from(ev.LIFECYCLE_EVENTS),
                                        "ts": times}, {"detail": values})),
    (TOPICS.alerts, kind(ev.ALERT, {"id": text, "run_id": run_ids, "rule": text,
                                    "severity": st.sampled_from(ev.SEVERITIES),
                                    "status": st.sampled_from(ev.ALERT_STATUSES), "ts": times, "step": steps,
                                    "onset": st.fixed_dictionaries({"ts": times}),
                                    "evidence": st.dictionaries(text, values)},
                         {"metric": values, "metrics": values, "value": values, "silenced": values,
                          "diagnosis": text})),
    (TOPICS.alerts, kind(ev.REPORT, {"id": text, "run_id": run_ids, "action": st.sampled_from(ev.ACTIONS),
                                     "command_id": text, "ts": times, "incident": st.dictionaries(text, values),
                                     "checkpoint": st.dictionaries(st.sampled_from(["chosen", "why"]), values),
                                     "alerts": st.lists(values, max_size=3)},
                         {"step": values, "windows": values, "summary": text, "history": values,
                          "resource_snapshot": values})),
    (TOPICS.control, kind(ev.COMMAND, {"id": text, "run_id": run_ids, "action": st.sampled_from(ev.ACTIONS),
                                       "target": st.none(), "reason": st.lists(text, max_size=2),
                                       "issued": st.just(1.5e9), "expires": st.just(1.6e9)},
                          {"detail": values, "signature": values})),
    (TOPICS.acks, kind(ev.ACK, {"command_id": text, "run_id": run_ids, "status": st.sampled_from(ev.ACK_STATUSES),
                                "ts": times}, {"detail": text, "step": steps})),
    (TOPICS.status, kind(ev.STATUS, {"run_id": run_ids, "ts": st.floats(1.0e9, 2.0e9),
                                     "last_step": st.one_of(st.none(), st.integers(0, 60)),
                                     "breaker": st.fixed_dictionaries({"status": text,
                                                                       "rollbacks": st.integers(0, 3)}),
                                     "open_alerts": st.lists(st.fixed_dictionaries({"rule": text},
                                                                                   optional={"severity": values}),
                                                             max_size=2)},
                         {"unwatched_metrics": values, "last_healthy_checkpoint": values, "finished": values})),
]
placed = st.one_of(*(st.tuples(st.just(topic), record) for topic, record in BY_TOPIC))
misplaced = st.tuples(st.sampled_from(TOPIC_NAMES), st.one_of(values, *(record for _, record in BY_TOPIC)))
records = st.one_of(placed, placed, placed, misplaced)


def wire(record) -> bytes:
    """As any producer might write it (json escapes what orjson refuses)."""
    return json.dumps(record, allow_nan=True).encode()


@settings(max_examples=140, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(records, min_size=1, max_size=12))
def test_any_records_on_any_topic_leave_every_page_whole_and_inert(batch):
    board = Board(RULES, TOPICS, max_runs=5, max_alerts=3, max_series=4, max_points=8, max_reports=2)
    for topic, record in batch:
        raw = wire(record)
        run_id = record.get("run_id") if isinstance(record, dict) else None
        board.take(topic, run_id.encode("utf-8", "surrogatepass") if isinstance(run_id, str) else b"k", raw)
    _, causes = board.skipped()
    assert not [c for c in causes if c.startswith("handling")], f"a record the views could not take: {causes}"
    assert len(board.runs_by_id) <= 5
    pages = [render_index(board)]
    for row in board.runs():
        view = board.snapshot(row["run_id"])
        pages.append(render_run(board, row["run_id"], view))
        orjson.dumps(board.run(row["run_id"]), default=str)  # /api/run/<run>
        pages += [render_report_page(board, row["run_id"], r["id"]) for r in view["reports"]]
    for page in pages:
        found, _ = _ui_injections_in(page)
        assert not found, found
