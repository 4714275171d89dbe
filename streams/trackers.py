"""What opens and closes across events: incidents (rules that fire together), stragglers (a
rank far from its peers) and silent sources (a hung trainer, a dead node).

Pure decisions over the run's state, like ``policy.py``: no I/O, no alert building. The
engine feeds them and turns each verdict into an alert or a resolution.

- An **incident** opens when every member rule is open, or fired within ``within_s`` of now;
  it closes when that stops holding.
- A **step across ranks** is judged once every rank reported it, or once it is two steps behind
  the newest (a rank that never reports must not hold the judgement back); a rank flagged at a
  judged step opens its straggler alert, a rank no longer flagged closes it.
- A **source is silent** when its kind has not been heard for longer than the rule's
  ``timeout_s``; each silence opens once, and hearing from the source again closes it.
"""

from __future__ import annotations

from typing import Any, Sequence

OPEN, CLOSE = "open", "close"


def incident_verdict(rules: Sequence[str], within_s: float, active: dict, is_open: bool,
                     ts: float) -> tuple[str | None, list[Any]]:
    """``(OPEN | CLOSE | None, members)``: ``members`` are the member rules' activity records
    (``{open, last_ts, alert}``), all present when the incident opens.

    >>> active = {"a": {"open": 1, "last_ts": 100.0}, "b": {"open": 0, "last_ts": 90.0}}
    >>> incident_verdict(["a", "b"], 30.0, active, False, 110.0)[0]
    'open'
    >>> incident_verdict(["a", "b"], 30.0, active, True, 115.0)[0] is None
    True
    >>> incident_verdict(["a", "b"], 30.0, active, True, 121.0)[0]
    'close'
    >>> incident_verdict(["a", "c"], 30.0, active, False, 110.0)[0] is None  # "c" never fired
    True
    """
    members = [active.get(r) for r in rules]
    together = all(m is not None and (m["open"] > 0 or ts - m["last_ts"] <= within_s) for m in members)
    if together and not is_open:
        return OPEN, members
    if is_open and not together:
        return CLOSE, members
    return None, members


def steps_to_judge(pending: dict, ranks: int, newest_step: int) -> list[int]:
    """Steps across ranks ready to be judged: every rank reported, or two steps behind.

    >>> steps_to_judge({10: {"0": 1.0, "1": 1.1}, 11: {"0": 1.0}, 12: {"1": 1.0}}, 2, 14)
    [10, 11]
    """
    return [s for s in pending if len(pending[s]) >= ranks or s < newest_step - 2]


def straggler_changes(flagged: dict, ranks, open_ranks: set) -> tuple[list, list]:
    """``(ranks to open, ranks to close)`` after judging one step: ``flagged`` maps the ranks
    far from their peers to their figures; ``open_ranks`` already have an open alert.

    >>> straggler_changes({"3": (9.0, 1.0, 8.2)}, ["0", "1", "2", "3"], {"1"})
    (['3'], ['1'])
    """
    opens = [r for r in ranks if r in flagged and r not in open_ranks]
    closes = [r for r in ranks if r in open_ranks and r not in flagged]
    return opens, closes


def silent_sources(last_seen: dict, timeout_s: float, sources, already_open, now: float) -> list[tuple]:
    """``(source kind, silent for s, last step, source)`` of each source kind watched by a
    stale rule (``sources``: the kinds it watches, empty for all) that has been silent longer
    than ``timeout_s`` and has no open alert yet (``already_open``: kinds with one).

    >>> seen = {"trainer": [100.0, 41, {"kind": "trainer"}], "node": [290.0, 40, {"kind": "node"}]}
    >>> [(k, s) for k, s, _, _ in silent_sources(seen, 120.0, (), set(), 300.0)]
    [('trainer', 200.0)]
    >>> silent_sources(seen, 120.0, ("node",), set(), 300.0), silent_sources(seen, 120.0, (), {"trainer"}, 300.0)
    ([], [])
    """
    out = []
    for kind, (seen_at, step, src) in last_seen.items():
        if (sources and kind not in sources) or kind in already_open:
            continue
        silent = now - seen_at
        if silent > timeout_s:
            out.append((kind, silent, step, src))
    return out
