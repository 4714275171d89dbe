"""Correlation: stragglers across ranks, incidents across rules, sources that speak again."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from trainguard.schemas import events as ev
from trainguard.schemas.signing import NODE, TRAINER
from trainguard.streams import trackers
from trainguard.streams.detectors import CrossRank
from trainguard.streams.engine.book import CROSS, INCIDENT, STALE, AlertBook
from trainguard.streams.engine.state import Limits, RunState
from trainguard.streams.rules import Rule
from trainguard.streams.signals import base_name, rank_of

if TYPE_CHECKING:
    from trainguard.streams.engine.judging import EventContext

def _incident_authority(members: list[dict]) -> str | None:
    """Who vouches for an incident: the run's trainer when its key vouches for a member (a node's
    evidence joins, never steers alone), else a node's. Unauthenticated alerts join no incident
    (``_fire``). None without keys."""
    said = [m.get("authority") for m in members]
    if all(a is None for a in said):
        return None
    return TRAINER if TRAINER in said else NODE


class Correlation(AlertBook):
    """Alerts across sources and rules: silent sources coming back, stragglers among ranks,
    incidents of rules that fire together."""

    _cross_rules: list[Rule]
    _cross_min_ranks: int
    _cross_pairs: dict[tuple, list]
    limits: Limits
    _left_out: Callable[..., None]

    def _seen(self, run: RunState, run_id: str, event: dict, outputs: list) -> None:
        """A source spoke: remember when, and close a staleness alert if it was silent."""
        src = event["source"]
        kind = src["kind"]
        run.last_seen[kind] = [self.clock(), event.get("step"), src]
        if src.get("rank") is not None and kind in self.rules.policy.step_sources:
            rank = str(src["rank"])
            if run.ranks.get(rank) != src and (rank in run.ranks or len(run.ranks) < self.limits.sources_per_run):
                run.ranks[rank] = src  # a rank's own events say where it runs; a folded event only infers it
        elif src.get("ranks") and kind in self.rules.policy.step_sources:  # a node's ranks folded in one event
            for r in src["ranks"]:
                if str(r) in run.ranks:
                    continue
                if len(run.ranks) >= self.limits.sources_per_run:  # a rank counts as a source does
                    self._left_out(run, run_id, "sources_per_run", self.limits.sources_per_run, 1, "ranks",
                                   "further ranks of folded events are not compared with their peers")
                    break
                run.ranks[str(r)] = ev.source(kind, src.get("host", ""), r)
        if run.dismissed:  # it speaks again: its next silence is news
            run.dismissed = [k for k in run.dismissed if not k.endswith("|" + kind)]
        if run.book:
            for key, alert in self._in_room(run, STALE).items():
                if key.endswith("|" + kind):
                    self._add(outputs, self._resolve(run, alert, {"ts": event["ts"], "step": event.get("step")},
                                                     resolution=f"{kind} is publishing again"))

    def _correlate(self, ctx: "EventContext") -> None:
        """Stragglers (one rank far from its peers) and incidents (rules that fire together)."""
        run, src = ctx.run, ctx.event["source"]
        if (self._cross_rules and (src.get("rank") is not None or src.get("ranks"))
                and len(run.ranks) >= self._cross_min_ranks
                and src["kind"] in self.rules.policy.step_sources):
            self._cross_rank(run, ctx.run_id, ctx.event, ctx.outputs)
        # An incident can only open when one of its members fires, and only an open one can end.
        if self.rules.incidents and (self._fired or self._in_room(run, INCIDENT)):
            self._incidents(run, ctx.run_id, ctx.event, ctx.outputs, ctx.critical)

    def _cross_rank(self, run: RunState, run_id: str, event: dict, outputs: list) -> None:
        """Stragglers: one rank far from its peers at the same step. A folded event (a node's
        ranks in one, ``source.ranks``) carries each rank's values in ``per_rank`` as ``name[rank]``."""
        src, step = event["source"], event["step"]
        folded = src.get("rank") is None
        values = event.get("per_rank", {}) if folded else event["metrics"]
        names = tuple(values)
        pairs = self._cross_pairs.get((folded, names))
        if pairs is None:  # which (rule, metric, rank) an event of this shape feeds, worked out once
            # bounded by the names it holds, not only its shapes: a shape of a folded event may
            # name thousands of metrics (~1 MB), and invented shapes come from anyone who can write
            if len(self._cross_pairs) > 1024 or sum(len(k[1]) for k in self._cross_pairs) + len(names) > 65_536:
                self._cross_pairs.clear()
            pairs = self._cross_pairs[(folded, names)] = [
                (rule, name, base_name(name), rank_of(name) if folded else None)
                for rule in self._cross_rules for name in names
                if rule.watches(name) and (not folded or rank_of(name) is not None)]
        own = None if folded else str(src["rank"])
        for rule, name, metric, rank in pairs:
            value = values[name]
            if rank is not None and rank not in run.ranks:
                continue  # a rank past the run's cap: not compared (said once by _seen)
            if math.isfinite(value):
                key = f"{rule.name}|{metric}"
                cr = run.cross.get(key)
                if cr is None:
                    params = {k: v for k, v in rule.detector.items() if k != "kind"}
                    cr = run.cross[key] = CrossRank(**params)
                cr.add(step, rank or own, value)
                for s in trackers.steps_to_judge(cr.pending, len(run.ranks), step):
                    flagged = {str(r): (v, med, z) for r, v, med, z in cr.complete(s)}
                    firing = self._in_room(run, CROSS)
                    open_ranks = {r for r in run.ranks if f"{key}|{r}" in firing}
                    opens, closes = trackers.straggler_changes(flagged, run.ranks, open_ranks)
                    for r in opens:
                        v, med, z = flagged[r]
                        src = run.ranks[r]
                        alert = self._alert({**event, "step": s, "source": src}, run, run_id, ev.source_id(src),
                                            rule, metric, v, {**cr.evidence(), "detector": "cross_rank",
                                                              "median": med, "robust_z": z, "rank": r},
                                            run.breaker.attempt)
                        self._add(outputs, self._fire(run, alert, rule, CROSS, f"{key}|{r}"))
                    for r in closes:
                        self._add(outputs, self._resolve(run, firing[f"{key}|{r}"], {"ts": event["ts"], "step": s}))

    def _incidents(self, run: RunState, run_id: str, event: dict, outputs: list, critical: list) -> None:
        """Alerts of several rules that belong together become one incident with a root cause."""
        ts = event["ts"]
        for incident in self.rules.incidents:
            opened = self._in_room(run, INCIDENT, incident.name).get(incident.name)
            verdict, members = trackers.incident_verdict(incident.rules, incident.within_s, run.active,
                                                         opened is not None, ts)
            if verdict == trackers.OPEN:  # every member present
                alert = ev.alert_event(
                    run_id, incident.name, alert_id=ev.alert_id(run_id, incident.name, event["step"],
                                                                run.breaker.attempt),
                    severity=incident.severity, critical=incident.critical, kind="incident",
                    summary=incident.summary, metric="incident", value=len(members),
                    layer=members[0]["alert"]["layer"], layers=sorted({m["alert"]["layer"] for m in members}),
                    source=event["source"], step=event["step"], ts=ts,
                    onset={"step": min(m["alert"]["step"] for m in members),
                           "ts": min(m["last_ts"] for m in members)},
                    evidence={"detector": "incident",
                              "members": [{"rule": r, **m["alert"]}
                                          for r, m in zip(incident.rules, members, strict=True)]},
                    diagnosis=incident.diagnosis, suggestion=incident.suggestion, node_snapshot=dict(run.nodes))
                self._vouched(alert, _incident_authority([m["alert"] for m in members]))
                opened = alert
                self._add(outputs, self._fire(run, alert, incident, INCIDENT, incident.name))
            elif verdict == trackers.CLOSE and opened is not None:
                self._add(outputs, self._resolve(run, opened, event))
                opened = None
            if incident.critical and opened is not None and opened.get("authority", TRAINER) == TRAINER:
                critical.append((opened["id"], incident.name, incident.summary))
