"""Judging: one metrics event through baselines, detectors and intervals to alerts."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainguard.schemas import events as ev
from trainguard.streams import keys
from trainguard.streams.alerts import Track
from trainguard.streams.baseline import BaselineBlock
from trainguard.streams.engine.breaker import Breaker
from trainguard.streams.engine.correlation import Correlation
from trainguard.streams.engine.outputs import _json_value
from trainguard.streams.engine.state import (
    MAX_UNWATCHED,
    Limits,
    RunState,
    SourceState,
    add_to_snapshot,
    snapshot_entry,
)
from trainguard.streams.minutes import MinuteWindows
from trainguard.streams.rules import Rule

log = logging.getLogger("trainguard.engine")


@dataclass(slots=True)
class EventContext:
    """One metrics event while the engine judges it: where it came from, where its source's
    state lives, its values in the baseline's row order, and what judging it produced so far."""
    event: dict
    run: RunState
    run_id: str
    partition: int
    outputs: list
    sid: str                 # the source's id within the run
    key: bytes               # the source's state key (``run|source``)
    state: "SourceState"
    names: tuple             # metric names, in the event's order
    rows: Any                # their rows in the source's baseline block
    x: Any                   # their values, float array
    stats: tuple             # the baseline's (anomalous, finite, mean, std, lower, upper, ready)
    holding: set = field(default_factory=set)        # (rule, row) slots that hold at this event
    critical: list = field(default_factory=list)     # (alert id, rule, summary) of critical rules that hold
    opened: dict = field(default_factory=dict)       # rule -> the alert it opened at this event
    immediate: bool = False                          # a critical rule marked immediate holds



class Judging(Correlation, Breaker):
    """A metrics event, in phases: folded into its source's baselines, judged by the rules that
    read them and by those with a detector of their own, episodes ended, then correlated and
    handed to the breaker."""

    samples: int
    windows: MinuteWindows
    _params_cache: dict[str, tuple[int, float, bool]]
    _judged: dict[tuple[str, str], bool]

    def _metrics(self, event: dict, run: RunState, run_id: str, partition: int, outputs: list) -> None:
        """A metrics event, in phases: fold it into its source's baselines, judge the rules that
        read the baselines, then those with a detector of their own (every sample, or each
        interval as it closes), end the episodes that no longer hold, correlate (stragglers
        across ranks, incidents across rules), and let the breaker decide on a trainer step."""
        ctx = self._ingest(event, run, run_id, partition, outputs)
        self._judge_baselines(ctx)
        state = ctx.state
        if state.det_rows or state.res_rows:
            plain, per_interval, res_j, res_names = state.det_positions(ctx.rows)
            self._judge_detectors(ctx, plain)
            if per_interval:
                self._judge_intervals(ctx, per_interval, res_j, res_names)
        self._end_broken_episodes(ctx)
        self._correlate(ctx)
        if event["source"]["kind"] in self.rules.policy.step_sources:
            self._breaker_step(ctx)

    def _ingest(self, event: dict, run: RunState, run_id: str, partition: int, outputs: list) -> "EventContext":
        """Fold the event's values into its source's baselines (new metrics get rows, and the
        log says once which of them no rule watches); a node's values are kept as they came
        for the snapshot alerts carry."""
        src = event["source"]
        sid = self._apart() + ev.source_id(src)
        key = keys.source_key(run_id, sid)
        state = self._source(key, src["kind"])
        state.points += 1
        self._changed(key, partition)
        metrics = event["metrics"]
        names = tuple(metrics)
        x = np.fromiter(metrics.values(), float, len(names))
        self.samples += len(names)
        kept = self._rows_kept(state, key, run, run_id, sid, names)
        if kept is not None:  # names no rule judges, or past a cap: no rows of the baseline
            names, x = kept[0], x[kept[1]]
        block = state.block
        before = len(block)
        rows = block.rows(names, self._baseline_params)
        if len(block) != before:
            state.bind(self.rules)
            run.rows += len(block) - before
        stats = block.update(rows, x)
        if state.given_rows:
            state.remember(rows, x)
        if state.history.rows and type(event["step"]) is int:
            state.history.record(rows, x, event["step"])
        if src["kind"] == "node":  # bounded in bytes, by the worker's clock (state.py: snapshot_entry)
            add_to_snapshot(run.nodes, src.get("host") or sid,
                            snapshot_entry(metrics, event["ts"], event["step"], self.clock()))
        return EventContext(event, run, run_id, partition, outputs, sid, key, state, names, rows, x, stats)

    def _admit(self, run: RunState, run_id: str, src: dict) -> bool:
        """Whether the run keeps state for this source (False past its source cap)."""
        sid = self._apart() + ev.source_id(src)
        if sid in run.sources:
            return True
        if len(run.sources) < self.limits.sources_per_run:
            run.sources.append(sid)
            return True
        self._left_out(run, run_id, "sources_per_run", self.limits.sources_per_run, 1, "events",
                       f"events of source {sid!r} and every further source are counted, not judged")
        return False

    def _rows_kept(self, state: SourceState, key: bytes, run: RunState, run_id: str, sid: str,
                   names: tuple) -> tuple | None:
        """Which of an event's names are rows of the source's baseline, as ``(names, positions)``;
        None when all are. A name no rule judges takes no row (it is named once in the log and
        in the status), nor does one past the source's or the run's row cap. Worked out once per
        shape of event (a trainer logs the same names every step)."""
        shape = (len(names), hash(names))
        cached = self._kept.get(key)
        if cached is not None and cached[0] == shape:
            return cached[1]
        index = state.block.index
        new = [n for n in names if n not in index]
        result = None
        if new:
            judged, rules, kind = self._judged, self.rules, state.kind
            if len(judged) > 100_000:
                judged.clear()
            given = rules.given_signals
            wanted: list[str] = []
            unwatched: list[str] = []
            for n in new:
                j = judged.get((kind, n))
                if j is None:
                    j = judged[(kind, n)] = rules.judges_as_logged(n, kind) or rules.signal_for(n) in given
                (wanted if j else unwatched).append(n)
            if unwatched:  # a name no dialect knows, judged as the signal its words suggest
                inferred = rules.inferred([*index, *names], kind)
                if any(n in inferred for n in unwatched):
                    said = [f"{n} as {inferred[n]}" for n in unwatched if n in inferred]
                    log.info("trainguard: run %s, %s: judging %d metric(s) no framework's vocabulary names by the "
                             "signal their names suggest: %s%s (pin or refuse one under names: in the rules file)",
                             run_id, sid, len(said), ", ".join(said[:20]), " ..." if len(said) > 20 else "")
                    wanted += [n for n in unwatched if n in inferred]
                    unwatched = [n for n in unwatched if n not in inferred]
            if unwatched:
                known = set(run.unwatched)
                fresh = [n for n in unwatched if n not in known]
                if fresh:
                    log.info("trainguard: run %s, %s: %d metric(s) no rule watches: %s%s", run_id, sid, len(fresh),
                             ", ".join(fresh[:20]), " ..." if len(fresh) > 20 else "")
                    run.unwatched += fresh[:max(0, MAX_UNWATCHED - len(run.unwatched))]
            lim = self.limits
            source_room, run_room = lim.rows_per_source - len(index), lim.rows_per_run - run.rows
            over = wanted[max(0, min(source_room, run_room)):]
            if over:
                cap, limit = (("rows_per_source", lim.rows_per_source) if source_room <= run_room
                              else ("rows_per_run", lim.rows_per_run))
                self._left_out(run, run_id, cap, limit, len(over), "names",
                               f"{sid!r}: metric names past it ({over[0][:80]!r} ...) are counted, not judged")
            if unwatched or over:
                drop = {*unwatched, *over}
                positions = [i for i, n in enumerate(names) if n not in drop]
                result = (tuple(names[i] for i in positions), np.array(positions, dtype=np.intp))
        if len(self._kept) > 100_000:
            self._kept.clear()
        self._kept[key] = (shape, result)
        return result

    def _left_out(self, run: RunState, run_id: str, cap: str, limit: int, count: int, of: str, what: str) -> None:
        """Count what a cap left out; the first time for the run, say so."""
        entry = run.limits.get(cap)
        if entry is None:
            entry = run.limits[cap] = {"cap": limit, "left_out": 0, "of": of}
            log.warning("trainguard: run %s reached its %s cap (%d, %s): %s", run_id, cap, limit,
                        Limits.SETTINGS[cap], what)
        entry["left_out"] += count

    def _judge_baselines(self, ctx: "EventContext") -> None:
        """Rules judged against the rolling baseline. Only rows that some rule could fire on get
        Python-level work (comparisons with NaN are False, without a warning)."""
        state, rows, x = ctx.state, ctx.rows, ctx.x
        anomalous, finite, mean, std, lower, upper, ready = ctx.stats
        block = state.block
        candidate = (anomalous | ~finite | (x > state.gate_hi[rows]) | (x < state.gate_lo[rows])
                     | state.always[rows])
        if state.any_cv:  # "fluctuating": only where the window's spread is already wide enough
            candidate |= std > state.gate_cv[rows] * np.abs(mean)
        if state.any_eq:  # "equals": e.g. a gradient norm of exactly 0
            candidate |= np.abs(x - state.gate_eq[rows]) <= state.eq_tol[rows]
        if state.firing:  # open episodes are re-judged every sample, anomalous or not
            if rows is block.all_rows:  # positions are rows
                candidate[[row for _, row in state.firing]] = True
            else:
                candidate |= np.isin(rows, [row for _, row in state.firing])
        rules = self.rules.rules
        for j in np.flatnonzero(candidate).tolist():
            row = int(rows[j])
            value = float(x[j])
            for ri in state.rule_rows[row]:
                slot = (ri, row)
                # The baseline must flag a sample to open an episode; the thresholds alone keep
                # it open (a sustained fault soon enters the window and stops looking unusual).
                holds = rules[ri].holds(value, bool(anomalous[j]) or slot in state.firing,
                                        mean[j] if ready[j] else math.nan, std[j])
                if holds and rules[ri].seen_finite is not None and rules[ri].seen_finite != state.seen_finite(row):
                    holds = False  # e.g. NaN since the first point (not computed) vs NaN after finite values
                self._judge(ctx, slot, rules[ri], holds, ctx.names[j], value,
                            lambda j=j, row=row, value=value: self._evidence(
                                value, bool(finite[j]), mean[j], std[j], lower[j], upper[j], block, row))

    def _judge_detectors(self, ctx: "EventContext", plain) -> None:
        """Rules with a detector of their own, which learns from every sample of its metric.
        Detectors never learn from non-finite values; as with the baselines, the detector opens
        an episode and a threshold keeps it open."""
        state, x, rules = ctx.state, ctx.x, self.rules.rules
        detectors, firing, ts = state.detectors, state.firing, ctx.event["ts"]
        for j, row, watching in plain:
            value = float(x[j])
            finite = value == value and value != math.inf and value != -math.inf
            for ri in watching:
                rule, slot = rules[ri], (ri, row)
                det = detectors.get(slot)
                if det is None:
                    det = detectors[slot] = rule.make_detector()
                if rule.paired is not None:  # e.g. the trained-on reward beside a validation score
                    det.pair(state.known.get(rule.paired))
                if det.takes_step:  # a forecast's ETA in training steps, not only in points
                    det.at_step(ctx.event["step"])
                flagged = finite and det.update(value, ts)
                if not flagged and rule.has_threshold and slot in firing:
                    flagged = True
                elif not flagged and finite and rule.anomalous:
                    continue  # nothing can hold: an open episode of this slot resolves later
                self._judge(ctx, slot, rule, rule.holds(value, flagged), ctx.names[j], value,
                            lambda slot=slot, rule=rule, name=ctx.names[j]: self._detector_evidence(
                                state, ctx.key, slot, rule, name))

    def _judge_intervals(self, ctx: "EventContext", per_interval, res_j, res_names) -> None:
        """Resampled rules: each event adds to the source's open window (whole arrays), and an
        interval is judged from the windowed table when it closes."""
        state, key, rules = ctx.state, ctx.key, self.rules.rules
        closed = self._roll_window(state, key, ctx.event["ts"], ctx.partition)
        assert state.minute is not None  # _roll_window always leaves a window open
        self.windows.add(key, state.minute, ctx.partition, res_names, ctx.x[res_j])
        if closed is None:  # no new judgement: open episodes and streaks carry on
            for slot in (*state.firing, *state.streaks):
                if rules[slot[0]].resample_s:
                    ctx.holding.add(slot)
            return
        for j, row, watching in per_interval:
            value = float(ctx.x[j])
            for ri in watching:
                rule, slot = rules[ri], (ri, row)
                verdict = self._resampled(state, key, slot, rule, ctx.names[j], closed)
                if verdict is None:  # the interval held no sample of it
                    if slot in state.firing or slot in state.streaks:
                        ctx.holding.add(slot)
                    continue
                self._judge(ctx, slot, rule, rule.holds(value, verdict), ctx.names[j], value,
                            lambda slot=slot, rule=rule, name=ctx.names[j]: self._detector_evidence(
                                state, key, slot, rule, name))

    def _end_broken_episodes(self, ctx: "EventContext") -> None:
        """Episodes of this event's metrics that no longer hold are resolved; streaks that broke
        start again."""
        state = ctx.state
        if not state.streaks and not state.firing:
            return
        present = set(ctx.rows.tolist())
        for slot in [s for s in state.streaks if s not in ctx.holding and s[1] in present]:
            del state.streaks[slot]
        rules = self.rules.rules
        for slot in [s for s in state.firing if s not in ctx.holding and s[1] in present]:
            if not self._clean_point(state, slot, rules[slot[0]], ctx.event):
                continue  # keep_firing_for, flapping, or still far from the healthy level
            opened = state.firing.pop(slot)
            if any(a["id"] == opened["id"] for a in state.firing.values()):
                continue  # the alert still holds on another of its metrics
            value = float(ctx.event["metrics"].get(opened["metric"], math.nan))
            self._add(ctx.outputs, self._resolve(ctx.run, opened, ctx.event, value=_json_value(value)))

    @staticmethod
    def _healthy_level(ctx: "EventContext", row: int) -> float | None:
        """The baseline's window mean of a row before this event, where the window is ready."""
        positions = np.flatnonzero(ctx.rows == row)
        if not len(positions):
            return None
        j = int(positions[0])
        _, _, mean, _, _, _, ready = ctx.stats
        return float(mean[j]) if ready[j] else None

    @staticmethod
    def _clean_point(state: SourceState, slot, rule: Rule, event: dict) -> bool:
        """A point where the open episode's condition does not hold: True when the episode
        resolves with it (``streams/alerts.py``: keep_firing_for, flapping, and for rules that
        judge against the run's own history, recovery: a threshold rule's threshold says itself
        when it is over)."""
        track = state.tracks.get(slot)
        if track is None:  # an episode from state written before lifecycles: resolves as it did
            return True
        value = event["metrics"].get(state.block.names[slot[1]]) if rule.anomalous else None
        return track.clean(rule.lifecycle, state.points, None if value is None else float(value))

    def _judge(self, ctx: "EventContext", slot, rule: Rule, holds: bool, metric: str, value: float,
               evidence) -> None:
        """One sample of one rule on one metric: streaks, durations, opening an episode.
        ``evidence()`` is called only when an alert opens.

        Metrics of one rule that open in the same step share one alert, which names them all
        (a NaN step with five NaN losses pages once)."""
        state = ctx.state
        if not holds or (rule.given and not rule.given_holds(state.known)):
            return
        ctx.holding.add(slot)
        # The checkpoints saved after it are suspect, unless only a forger says so.
        if rule.critical and not math.isfinite(value) and self._steers():
            ctx.run.nonfinite = [ctx.event["step"], metric]
        if slot in state.firing:  # the open episode holds again: its clean points start over
            track = state.tracks.get(slot)
            if track is not None:
                track.held(value)
        ts = ctx.event["ts"]
        streak = state.streaks.get(slot)
        if streak is None:
            streak = state.streaks[slot] = [0, ts]
        streak[0] += 1
        if streak[0] < rule.for_samples or (rule.for_seconds and ts - streak[1] < rule.for_seconds):
            return
        alert = state.firing.get(slot)
        if alert is None:
            alert = ctx.opened.get(rule.name)
            if alert is None:
                run = ctx.run
                alert = self._alert(ctx.event, run, ctx.run_id, ctx.sid, rule, metric, value, evidence(),
                                    run.breaker.attempt)
                track = state.tracks.get(slot)
                if track is None:
                    track = state.tracks[slot] = Track()
                if track.open(rule.lifecycle, state.points, value, self._healthy_level(ctx, slot[1])) == "flapping":
                    alert["flapping"] = True
                ctx.opened[rule.name] = alert
                self._add(ctx.outputs, self._fire(run, alert, rule))
            else:  # the alert this step already opened for the rule names this metric too
                alert["metrics"].append(metric)
                alert["values"][metric] = _json_value(value)
                track = state.tracks.get(slot)
                if track is None:
                    track = state.tracks[slot] = Track()
                track.open(rule.lifecycle, state.points, value, self._healthy_level(ctx, slot[1]))
            state.firing[slot] = alert
        if rule.critical:
            if rule.immediate:
                ctx.immediate = True
            ctx.critical.append((alert["id"], rule.name, f"{rule.summary} ({metric}={value:.4g})"))

    def _roll_window(self, state: SourceState, key: bytes, ts: float, partition: int) -> float | None:
        """Move the source's open window to the one holding ``ts``; the start of the window
        that closed, if one did. Late samples count in the open window; windows older than
        the longest horizon are deleted (event time, so replays age the same way)."""
        start = self.windows.start(ts)
        if state.minute is None:
            state.minute = start
            return None
        if start <= state.minute:
            return None
        closed = state.minute
        self.windows.close(key, closed, start)
        state.windows.append(closed)
        state.minute = start
        while state.windows and state.windows[0] <= closed - self.windows.keep_s:
            self.windows.delete(key, state.windows.pop(0), partition)
        return closed

    def _resampled(self, state: SourceState, key: bytes, slot, rule: Rule, name: str, closed: float) -> bool | None:
        """Judge a resampled rule on the window that just closed; None when that ends no
        interval of the rule or held no sample of it. A detector created now (a rule added or
        retuned since the windows were filled) first learns the history the windowed table
        still holds."""
        det = state.detectors.get(slot)
        if det is None:
            det = state.detectors[slot] = rule.make_detector()
            for start in state.windows:
                if start != closed:
                    self._feed_interval(det, key, rule, name, start)
        return self._feed_interval(det, key, rule, name, closed)

    def _feed_interval(self, det, key: bytes, rule: Rule, name: str, last_start: float) -> bool | None:
        assert rule.resample_s is not None  # only resampled rules are fed intervals
        end = last_start + self.windows.size
        if end % rule.resample_s:  # an interval of several windows ends only at its boundary
            return None
        mean = self.windows.mean(key, last_start, rule.resample_s, name)
        return None if mean is None else det.update(mean, end)

    def _detector_evidence(self, state: SourceState, key: bytes, slot, rule: Rule, name: str) -> dict:
        evidence = {**state.detectors[slot].evidence(), "detector": rule.kind}
        if rule.resample_s:  # the per-interval history the verdict was drawn from
            evidence["per_window"] = {"window_s": self.windows.size,
                                      "means": self.windows.series(key, state.windows, name)}
        return evidence

    def _evidence(self, value, finite, mean, std, lower, upper, block: BaselineBlock, row: int) -> dict:
        if not finite:
            return {"detector": "non_finite", "value": _json_value(value)}
        return {"detector": "rolling_z", "value": value, "mean": float(mean), "std": float(std),
                "lower": float(lower), "upper": float(upper), "window": int(block.window[row]),
                "k": float(block.k[row]), "samples": int(min(block.count[row], block.window[row]))}

    def _baseline_params(self, metric: str) -> tuple[int, float, bool]:
        p = self._params_cache.get(metric)
        if p is None:
            b = self.rules.baseline_for(metric)
            p = self._params_cache[metric] = (b.window, b.k, b.clip_lower)
        return p
