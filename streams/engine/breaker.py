"""The breaker: steps in, commands and reports out, acks back."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from trainguard.schemas import events as ev
from trainguard.schemas.signing import (
    NODE,
    TRAINER,
    UNAUTHENTICATED,
    SigningKey,
    authenticate,
    sign,
    verify,
    verify_trainer,
)
from trainguard.streams import keys, policy
from trainguard.streams.detectors.changepoint import change_onset
from trainguard.streams.engine.book import NOTICE, AlertBook
from trainguard.streams.engine.outputs import Output, OutputKind, dead_letter
from trainguard.streams.engine.state import RunState
from trainguard.streams.engine.status import StatusRoom
from trainguard.streams.minutes import MinuteWindows

if TYPE_CHECKING:
    from trainguard.streams.engine.judging import EventContext

log = logging.getLogger("trainguard.engine")

# Lifecycle events that change what the breaker does: only the run's trainer key may send them.
STEERING_LIFECYCLE = ("started", "finished", "stopped", "rolled_back")
# The notice of a command the trainer did not apply (command_failed: its name in state of earlier releases).
NOT_APPLIED_RULES = ("command_not_applied", "command_failed")
MAX_UNSIGNED_CHECKPOINTS = 10  # checkpoints refused as unsigned, kept per run to name them
# A trainer clock further than this from the broker's is said in the command_not_applied alert.
CLOCK_SKEW_SAID_S = 60.0


def _onset_step(alert: dict) -> int:
    """Where an alert's episode began (a repeated spike's first one), else its firing step."""
    step = (alert.get("onset") or {}).get("step")
    return step if isinstance(step, int) and step <= alert["step"] else alert["step"]


def _clock_skew(trainer_ts: float, appended_at: float | None) -> str | None:
    """"the trainer's clock is 10 min ahead of the broker's", from an ack's own time and the
    broker's append time (both read as the ack was written); None within a minute or unknown."""
    if appended_at is None:
        return None
    d = trainer_ts - appended_at
    if abs(d) <= CLOCK_SKEW_SAID_S:
        return None
    size = f"{abs(d) / 3600:.1f} h" if abs(d) >= 5400 else f"{abs(d) / 60:.0f} min"
    return (f"the trainer's clock is {size} {'ahead of' if d > 0 else 'behind'} the broker's (and so the "
            f"worker's); commands are judged on the broker's clock where the control topic uses LogAppendTime")



class Breaker(AlertBook, StatusRoom):
    """The engine's side of the circuit breaker: a trainer step to the breaker, its decision out
    as a signed command with its report, the trainer's acks back, a rollback applied; and who may
    steer it (signed checkpoints, lifecycle changes, acks and operator events)."""

    signing_key: SigningKey | None
    verify_keys: dict[str, SigningKey]
    forged: int
    windows: MinuteWindows
    # Who vouches for the metrics event being judged: (None, None) without keys (every event is
    # taken as it comes, as the zero-setup demo needs), else (trainer | node | unauthenticated, why).
    _authority: tuple[str | None, str | None] = (None, None)

    def _vouch(self, event: dict) -> None:
        """Find who vouches for a metrics event (its MAC), for judging it."""
        if not (self.require_signed and self.verify_keys):
            self._authority = (None, None)
            return
        principal, problem = authenticate(event, self.verify_keys)
        if principal == NODE and event["source"]["kind"] in self.rules.policy.step_sources:
            principal, problem = None, "signed with a node agent's key, which speaks for no trainer"
        self._authority = (principal or UNAUTHENTICATED, problem)

    def _steers(self) -> bool:
        """Whether the event being judged may move the breaker: the run's trainer key vouches for
        it (or no keys are configured)."""
        return self._authority[0] in (None, TRAINER)

    def _apart(self) -> str:
        """The prefix under which the event's source keeps its state and its last-seen time: none
        for an event a key vouches for; otherwise its own, so that a forged value neither moves
        the genuine source's baselines nor ends its alerts nor keeps it looking alive."""
        return UNAUTHENTICATED + "~" if self._authority[0] == UNAUTHENTICATED else ""

    def _vouched(self, alert: dict, authority: str | None = None) -> dict:
        """The alert marked with who vouched for its evidence (keys configured only); an
        unauthenticated one says so in its summary and diagnosis, since it can never steer."""
        if authority is None:
            authority = self._authority[0]
        if authority is None:
            return alert
        alert["authority"] = authority
        if authority == UNAUTHENTICATED:
            why = self._authority[1] or "a member alert's metrics carry no valid trainer or node key"
            alert["summary"] = f"Unauthenticated metrics: {alert['summary']}"
            alert["diagnosis"] = (f"{alert.get('diagnosis') or ''} Unauthenticated: no valid MAC of the run's "
                                  f"trainer key vouches for these metrics ({why}); the alert is raised for a "
                                  f"person to check, and the breaker sends no command on it.").strip()
        return alert

    def _unauthentic(self, event: dict, raw: bytes | None, topic: str = "", partition: int = -1,
                     offset: int = -1) -> Output | None:
        """The dead letter of a steering event or ack that its sender's key did not sign (None
        when it is signed, or does not need to be): a checkpoint, a lifecycle change or an ack by
        the run's trainer key, an operator event by an operator key."""
        kind = event["schema"]
        if kind == ev.OPERATOR:
            who = "an operator"
        elif kind in (ev.CHECKPOINT, ev.ACK) or (kind == ev.LIFECYCLE and event["event"] in STEERING_LIFECYCLE):
            who = "the run's trainer"
        else:
            return None
        if not self.require_signed:
            return None
        if kind == ev.OPERATOR:
            problem = verify(event, self.verify_keys, operators_only=True)
        else:
            problem = verify_trainer(event, self.verify_keys)
        if problem is None:
            return None
        self.forged += 1
        what = kind + (f" {event['event']}" if kind == ev.LIFECYCLE else "")
        reason = f"refused {what}: not signed by {who}'s key ({problem}); it changes nothing"
        log.warning("trainguard: run %s: %s", event.get("run_id"), reason)
        if raw is None:  # applied from code (a replay): the event as JSON, or as Python wrote it
            try:
                raw = ev.encode(event)
            except (TypeError, ValueError):
                raw = repr(event).encode("utf-8", "backslashreplace")
        return dead_letter(raw, reason, topic, partition, offset)

    def _breaker_step(self, ctx: "EventContext") -> None:
        """A trainer step, critical or not, goes to the breaker; a decision goes out as a
        command (signed) with its diagnosis report. With keys, only a step the run's trainer key
        vouches for: a forged one neither trips the breaker nor, healthy, resets its count."""
        if not self._steers():
            return
        event, critical = ctx.event, ctx.critical
        decision = policy.on_step(ctx.run.breaker, self.rules.policy, run_id=ctx.run_id, step=event["step"],
                                  ts=event["ts"], critical=bool(critical), immediate=ctx.immediate,
                                  alert_ids=[c[0] for c in critical], rules=[c[1] for c in critical],
                                  checkpoints=ctx.run.checkpoints, diagnosis=critical[0][2] if critical else "",
                                  now=self.clock(), ids=self._command_id,
                                  began=self._warned_since(ctx) if critical else None,
                                  changed=self._change_point(ctx) if critical else None,
                                  host=(event.get("source") or {}).get("host"))
        if decision is not None:
            ctx.outputs += self._decided(ctx.run, ctx.run_id, decision, event)

    def _certified(self, run: RunState, event: dict) -> dict:
        """A checkpoint the trainer reported, with the worker's verdict: healthy only when the
        trainer did not judge it otherwise, no NaN/Inf reached a critical signal since the checkpoint
        before it, and no incident was open or under way; else suspect, and why."""
        step, b = event["step"], run.breaker
        before = max((c["step"] for c in run.checkpoints if c["step"] < step), default=-1)
        critical = sorted({e["rule"] for e in run.book.values() if e["critical"]})
        why = None
        if event.get("healthy") is False:
            why = f"the trainer judged it unhealthy: {event.get('why') or 'no reason given'}"
        elif run.nonfinite is not None and run.nonfinite[0] > before:
            why = f"saved after a NaN/Inf in {run.nonfinite[1]} at step {run.nonfinite[0]}"
        elif self._critical_open(run) or self._paging(run):
            why = "saved while a P0/P1 alert was open" + (f" ({', '.join(critical[:3])})" if critical else "")
        elif b.streak > 0 and b.onset_step is not None:
            why = f"saved inside an incident (critical since step {b.onset_step})"
        checkpoint = {"step": step, "path": event["path"], "ts": event["ts"], "healthy": why is None}
        if why is not None:
            checkpoint["why"] = why[:300]
        return checkpoint

    def _unsigned_checkpoint(self, event: dict, reason: str) -> None:
        """A checkpoint of a run the worker knows, refused as unsigned: never a target, but named
        where the breaker has none (a trainer started without its key saves, and signs nothing)."""
        run_key = event["run_id"].encode()
        if run_key not in self.store:
            return  # an invented run gets no state from an unsigned event
        run = self._run(run_key)
        run.unsigned_checkpoints = [*run.unsigned_checkpoints, {"step": event["step"], "path": event["path"][:300],
                                                                "why": reason[:300]}][-MAX_UNSIGNED_CHECKPOINTS:]
        self._changed(run_key, run.partition)

    def _decided(self, run: RunState, run_id: str, decision: policy.Decision, event: dict) -> list[Output]:
        """A decision out: its report, then its commands (the rollback, then the ladder's adjust), signed.
        The checkpoints saved since the incident began hold it: suspect from now on."""
        refused = run.unsigned_checkpoints if decision.checkpoint is None else []
        if refused:  # a stop for want of a checkpoint: say which ones were refused, and why
            steps = ", ".join(str(c["step"]) for c in refused)
            note = (f"; {len(refused)} checkpoint(s) the trainer reported (steps {steps}) were refused as unsigned: "
                    f"not signed by the run's trainer key (a trainer started without its key signs nothing: "
                    f"docs/security.md)")
            decision.why += note
            decision.command = {**decision.command, "detail": (decision.command["detail"] + note)[:4000]}
        if decision.onset is not None:
            for c in run.checkpoints:
                if c["step"] >= decision.onset and c.get("healthy", True):
                    c["healthy"], c["why"] = False, f"saved after the incident began at step {decision.onset}"
        report = self._report(run, run_id, decision, event)
        outputs = [Output(OutputKind.REPORT, run_id, report)]
        self._command_sent(run, decision.command, event.get("step"))
        for command in [decision.command, *decision.then]:
            command = {**command, "report": report["id"]}
            if self.signing_key is not None:
                command = sign(command, self.signing_key)
            outputs.append(Output(OutputKind.COMMAND, run_id, command))
        return outputs

    def _warned_since(self, ctx: "EventContext") -> tuple[int, str] | None:
        """The first onset of the alerts still open on the critical alerts' metrics, and its rule:
        a change is often warned about steps before it turns critical (a KL spike, then the
        explosion), and a checkpoint saved in between already holds it. A critical incident
        begins with its first member (the gradient spike a collapse followed)."""
        metrics = {a.get("metric") for a in ctx.state.firing.values() if a["id"] in {c[0] for c in ctx.critical}}
        warned = [(_onset_step(a), a["rule"]) for a in ctx.state.firing.values()
                  if a.get("metric") in metrics and isinstance(a.get("step"), int)]
        named = {c[1] for c in ctx.critical}
        for incident in self.rules.incidents:
            if incident.name in named:
                for rule in incident.rules:
                    member = (ctx.run.active.get(rule) or {}).get("alert")
                    if member and isinstance(member.get("step"), int):
                        warned.append((member["step"], rule))
        return min(warned) if warned else None

    @staticmethod
    def _change_point(ctx: "EventContext") -> Callable[[int], tuple[int, str] | None]:
        """Where the critical alerts' metrics began to move, searched back from the critical
        onset over their kept history (``History``): a drift starts tens of steps before anything
        fires. Called when the breaker chooses a checkpoint, not for every critical step."""
        def before(onset: int) -> tuple[int, str] | None:
            ids, found = {c[0] for c in ctx.critical}, []
            history, index = ctx.state.history, ctx.state.block.index
            for metric, value in {str(a.get("metric")): a.get("value") for a in ctx.state.firing.values()
                                  if a["id"] in ids}.items():
                steps, values = history.series(index.get(metric, -1))
                kept = steps < onset
                if not kept.any():
                    continue
                level = float(np.nanmedian(values[kept])) if np.isfinite(values[kept]).any() else math.nan
                direction = (1 if value > level else -1) if type(value) is float and math.isfinite(value) \
                    and math.isfinite(level) else 0
                step = change_onset(steps[kept], values[kept], direction=direction)
                if step is not None:
                    found.append((step, f"a change point of {metric} (searched over its last {int(kept.sum())} "
                                        f"values)"))
            return min(found) if found else None
        return before

    def _ack(self, ack: dict, raw: bytes, partition: int, offset: int, topic: str,
             appended_at: float | None = None) -> list[Output]:
        run_key = ack["run_id"].encode()
        if run_key not in self.store:
            return []
        run = self._run(run_key)
        ours = run.command is not None and ack["command_id"] == run.command["id"]
        if ack["status"] == "applied" and not ours and not self._in_room(run, NOTICE) \
                and run.breaker.status != policy.RERUN:
            return []
        problem = self._unauthentic(ack, raw, topic, partition, offset)
        if problem is not None:
            # A refusal of the breaker's command that its key did not sign changes nothing the breaker
            # does; it only keeps the worker from claiming the command was applied.
            why = "its ack is not signed with the run's trainer key" if ours else None
            return [problem, *self._unverified_refusal(run, run_key, ack, why)]
        if ack.get("cause") in ("unauthenticated", "replayed"):
            # The trainer refused a forged copy or a second delivery under this id: the command
            # the breaker waits for is untouched by it.
            log.warning("trainguard: run %s: the trainer refused a %s copy of command %s: %s", ack["run_id"],
                        ack["cause"], ack["command_id"], ack.get("detail", ""))
            unverified = ours and ack["cause"] == "unauthenticated"  # a replayed copy's first one was applied
            return self._unverified_refusal(run, run_key, ack, "the trainer could not authenticate the command it "
                                                               "received" if unverified else None)
        rerun = self._rerun_verdict(run, run_key, ack)
        if rerun is not None:
            self._command_answered(run, ack)
            return rerun
        if ack["status"] == "applied":  # a later command worked: the refused one's alert is over
            # Only a refused command's notice ends when a later command works (or this one, when its
            # refusal could not be authenticated); a rerun's verdict (cordon the host) is a person's to
            # close, and a second delivery of the ack that raised a notice is no later command.
            self._command_answered(run, ack)
            over = [a for a in self._in_room(run, NOTICE).values() if a.get("rule") in NOT_APPLIED_RULES
                    and ((a.get("evidence") or {}).get("command_id") != ack["command_id"]
                         or (a.get("evidence") or {}).get("unverified"))]
            self._changed(run_key, run.partition)
            return [o for o in (self._resolve(run, alert, {"ts": ack["ts"], "step": ack.get("step")},
                                              resolution=f"the trainer applied command {ack['command_id']}")
                                for alert in over) if o is not None]
        b = run.breaker
        if b.status == policy.AWAITING and ack["command_id"] == b.command_id and b.ladder:
            # The rollback's checkpoint could not be loaded (torn, deleted, not this trainer's):
            # no longer a rollback target, so the next decision takes the one before it.
            for c in run.checkpoints:
                if c["step"] == b.ladder[-1]["step"] and c.get("healthy"):
                    c["healthy"], c["refused"] = False, str(ack.get("detail") or ack["status"])[:200]
                    c["why"] = f"the trainer could not load it ({c['refused']})"
        handled, stop = policy.on_command_refused(run.breaker, self.rules.policy, run_id=ack["run_id"],
                                                  command_id=ack["command_id"], status=ack["status"],
                                                  detail=ack.get("detail", ""), ts=ack["ts"], now=self.clock(),
                                                  ids=self._command_id)
        unanswered = ours and run.command is not None and (run.command["status"] == "sent"
                                                           or bool(run.command.get("unverified")))
        if not handled and not unanswered:
            return []  # not the breaker's, or an answer it already has (an ack read twice)
        self._command_answered(run, ack)
        self._changed(run_key, run.partition)
        if stop is not None:
            then = "the breaker stops the run"
        elif handled:
            then = "the breaker counts critical steps afresh"
        else:
            then = "the breaker has nothing further to send; the run goes on as the trainer runs it"
        alert = self._not_applied_alert(run, ack, f"The trainer answered {ack['status']}: "
                                                 f"{ack.get('detail') or 'no detail'}; {then}.",
                                        _clock_skew(ack["ts"], appended_at))
        outputs = [Output(OutputKind.ALERT, ack["run_id"], alert)]
        if stop is not None:
            self._command_sent(run, stop, ack.get("step"))
            if self.signing_key is not None:
                stop = sign(stop, self.signing_key)
            outputs.append(Output(OutputKind.COMMAND, ack["run_id"], stop))
        return outputs

    def _not_applied_alert(self, run: RunState, ack: dict, diagnosis: str, skew: str | None = None,
                           unverified: bool = False) -> dict:
        """``command_not_applied`` (P1): the breaker's command was refused, failed, or expired unacked."""
        command = run.command or {}
        what = command.get("action") or "command"
        evidence = {"detector": "ack", "command_id": ack["command_id"], "status": ack["status"],
                    "detail": ack.get("detail", ""), "action": what, "sent_at_step": command.get("step")}
        if unverified:
            evidence["unverified"] = True
        alert = ev.alert_event(
            ack["run_id"], "command_not_applied",
            alert_id=ev.alert_id(ack["run_id"], "command_not_applied", ack["command_id"] + ("?" if unverified else "")),
            severity="P1", critical=False, summary=f"The breaker's {what} was not applied ({ack['status']})",
            metric="ack", value=None, signal=None, metrics=[], values={}, layer="data", source=None,
            step=ack.get("step"), ts=ack["ts"], evidence=evidence,
            diagnosis=diagnosis + (f" Note: {skew}." if skew else ""),
            suggestion="Check the trainer's log and its keys (a trainer started without its key refuses every "
                       "command and signs nothing: docs/security.md); a rollback that cannot be applied needs a "
                       "person (or set on_command_failure: stop).")
        self._book(run, alert, NOTICE, alert["id"])
        return alert

    def _unverified_refusal(self, run: RunState, run_key: bytes, ack: dict, why: str | None) -> list[Output]:
        """A refusal of the breaker's last command that the worker cannot authenticate (``why``; None:
        not a refusal of that command): recorded and paged as not applied; the breaker does nothing."""
        command = run.command
        if why is None or command is None or ack["status"] == "applied" or command.get("status") != "sent":
            return []  # not a refusal of it, or its fate is already known (said once)
        self._command_answered(run, ack, unverified=why)
        self._changed(run_key, run.partition)
        alert = self._not_applied_alert(
            run, ack, f"The trainer answered {ack['status']}: {ack.get('detail') or 'no detail'}, but {why}: the "
                      f"breaker does not act on it and does not count the {command['action']} as applied.",
            unverified=True)
        return [Output(OutputKind.ALERT, ack["run_id"], alert)]

    @staticmethod
    def _command_sent(run: RunState, command: dict, step) -> None:
        """The breaker's last command, for what status says it came to."""
        run.command = {"id": command["id"], "action": command["action"], "step": step if type(step) is int else None,
                       "expires": command["expires"], "status": "sent",
                       "to_step": (command.get("target") or {}).get("step"), "skip": command.get("skip_batches")}

    @staticmethod
    def _command_answered(run: RunState, ack: dict, unverified: str | None = None) -> None:
        command = run.command
        if command is None or ack["command_id"] != command["id"]:
            return
        if command.get("status") == "applied" and ack["status"] != "applied":
            return  # a refused copy after the command was applied changes nothing
        command.update({"status": ack["status"], "detail": str(ack.get("detail") or "")[:300],
                        "acked_step": ack.get("step") if type(ack.get("step")) is int else None})
        if unverified:
            command["unverified"] = unverified[:300]
        else:
            command.pop("unverified", None)

    def _expired_commands(self, run: RunState, run_id: str, now: float) -> list[Output]:
        """The breaker's last command, unacked past its expiry: not applied, and paged."""
        command = run.command
        if command is None or command.get("status") != "sent" or now <= command["expires"]:
            return []
        command["status"] = "expired"
        ack = {"command_id": command["id"], "run_id": run_id, "status": "expired", "ts": now,
               "detail": "no ack before the command expired"}
        alert = self._not_applied_alert(run, ack, f"No ack from the trainer before the {command['action']} expired: "
                                                  f"its listener is not running, cannot read the control topic, or "
                                                  f"never reached a step boundary.")
        return [Output(OutputKind.ALERT, run_id, alert)]

    def _rerun_verdict(self, run: RunState, run_key: bytes, ack: dict) -> list[Output] | None:
        """The trainer's answer to the rerun the breaker waits for (None for any other ack): the
        verdict in an alert, and the breaker's decision. Only an ack the run's trainer key signed
        gets here, and a hardware verdict still rolls back (plainly), so a forged one skips nothing."""
        handled, decision = policy.on_rerun_verdict(
            run.breaker, self.rules.policy, run_id=ack["run_id"], command_id=ack["command_id"], status=ack["status"],
            result=ack.get("result"), ts=ack["ts"], checkpoints=run.checkpoints, now=self.clock(),
            ids=self._command_id)
        if not handled:
            return None
        self._changed(run_key, run.partition)
        outputs: list[Output] = []
        verdict, b = decision.verdict if decision else None, run.breaker
        if verdict is not None:
            result = ack.get("result") or {}
            hardware = verdict == policy.HARDWARE
            said = (f"the NaN of step {result.get('step', b.last_step)} did not come back when the trainer reran "
                    f"it on the same batch and seed ({result.get('first', '?')} then {result.get('again', '?')})"
                    if hardware else
                    f"the NaN of step {result.get('step', b.last_step)} came back when the trainer reran it on the "
                    f"same batch and seed")
            alert = ev.alert_event(
                ack["run_id"], "rerun_verdict", alert_id=ev.alert_id(ack["run_id"], "rerun_verdict", ack["command_id"]),
                severity="P1" if hardware else "P2", critical=False,
                summary=f"Rerun verdict: {verdict}" + (f" (host {b.suspect})" if hardware and b.suspect else ""),
                metric="rerun", value=None, signal=None, metrics=[], values={},
                layer="resource" if hardware else "data", source=None, step=ack.get("step"), ts=ack["ts"],
                evidence={"detector": "rerun", "command_id": ack["command_id"], "verdict": verdict,
                          "host": b.suspect if hardware else None, "reproduced": not hardware},
                diagnosis=f"A {verdict} fault: {said}.",
                suggestion=(f"Cordon host {b.suspect} and check its GPUs (ECC, XID errors); the run rolls back "
                            f"plainly." if hardware and b.suspect else
                            "Check the GPUs of the run's nodes (ECC, XID errors); the run rolls back plainly."
                            if hardware else "The recovery ladder handles it: a rollback, wider rewinds, an adjust."))
            self._book(run, alert, NOTICE, alert["id"])  # open until a person resolves it or the run ends
            outputs.append(Output(OutputKind.ALERT, ack["run_id"], alert))
        if decision is not None:
            event = {"ts": ack["ts"], "step": b.last_step if b.last_step is not None else ack.get("step") or 0}
            outputs += self._decided(run, ack["run_id"], decision, event)
        return outputs

    def _remedy(self, run: RunState, alert: dict, rule) -> dict:
        """What the breaker can do about an alert as it opens: ``{"by": "breaker", ...}`` when a
        rollback is within its reach should the alert persist, else ``{"by": "human", "why": ...}``,
        which the chat sinks put in the page's first line (a page nobody acts on must say so)."""
        def human(why: str) -> dict:
            return {"by": "human", "why": why}

        if not rule.critical:
            return human("trainguard takes no action on this rule")
        if alert.get("authority") == UNAUTHENTICATED:
            return human("its metrics are unauthenticated, and the breaker sends no command on them")
        if alert.get("kind") != "incident" and (alert.get("source") or {}).get("kind") not in \
                self.rules.policy.step_sources:
            return human("the breaker acts on the trainer's steps, not on this source's")
        b, pol = run.breaker, self.rules.policy
        if b.status == policy.STOPPED:
            return human("the breaker already stopped the run")
        healthy = [c["step"] for c in run.checkpoints if c.get("healthy")]
        if not healthy:
            return human("no healthy checkpoint to roll back to: the breaker would stop the run")
        if len(policy.recent_rollbacks(b, alert["ts"])) >= pol.max_rollbacks_per_hour:
            return human(f"the run was rolled back {pol.max_rollbacks_per_hour} times in the last hour "
                         f"(max_rollbacks_per_hour): the breaker would stop the run")
        return {"by": "breaker", "action": "rollback", "newest_healthy_step": max(healthy),
                "after_steps": 1 if getattr(rule, "immediate", False) else pol.consecutive_critical}

    @staticmethod
    def _rollback_said(run: RunState, restored) -> dict:
        """What resolved the alerts a rollback ended, in words and as fields: the rollback the
        breaker sent (where to, how many batches skipped, at which step), or the trainer's own."""
        command = run.command if run.command and run.command.get("action") == "rollback" else None
        if command is not None and isinstance(restored, int) and command.get("to_step") not in (None, restored):
            command = None  # the trainer restored another step than the breaker's last rollback named
        to = restored if isinstance(restored, int) else (command or {}).get("to_step")
        if command is None:
            said = "the trainer rolled back" + (f" to step {to}" if isinstance(to, int) else "")
            return {"resolution": said, "resolved_by": {"action": "rollback", "by": "trainer", "to_step": to}}
        skip, at = command.get("skip"), command.get("step")
        said = (f"resolved by the rollback to step {to}" + (f", {policy.skipping(skip)}" if skip else "")
                + (f", at step {at}" if isinstance(at, int) else ""))
        return {"resolution": said, "resolved_by": {"action": "rollback", "by": "breaker", "to_step": to,
                                                    "skip_batches": skip or 0, "at_step": at,
                                                    "command_id": command["id"]}}

    def _command_id(self, stable: str) -> str:
        return self.signing_key.command_id(stable) if self.signing_key is not None else stable

    def _rolled_back(self, event: dict, run: RunState, run_id: str, partition: int, outputs: list) -> None:
        policy.on_rolled_back(run.breaker, event.get("step"))
        restored = event.get("step")
        if isinstance(restored, int):  # checkpoints past it belong to the branch the rollback abandoned
            run.checkpoints = [c for c in run.checkpoints if c["step"] <= restored]
            if run.nonfinite is not None and run.nonfinite[0] > restored:
                run.nonfinite = None  # a NaN of the abandoned branch
        resolved_by = self._rollback_said(run, restored)
        for sid in run.sources:  # the restored model is not what the windows saw
            key = keys.source_key(run_id, sid)
            src = self._source(key, "") if key in self.store else None
            if src is not None and src.kind in self.rules.policy.step_sources:
                for alert in {a["id"]: a for a in src.firing.values()}.values():
                    self._add(outputs, self._resolve(run, alert, event, **resolved_by))
                    member = run.active.get(alert["rule"])
                    if member is not None and member["open"] <= 0:
                        member["last_ts"] = 0.0  # undone by the rollback: it joins no incident any more
                names = src.block.names
                src.finite_before.update(names[row] for row in np.flatnonzero(src.block.count).tolist())
                src.block.reset()
                src.history.forget_after(restored if isinstance(restored, int) else None)
                src.streaks.clear()
                src.firing.clear()
                src.tracks.clear()
                src.detectors.clear()
                for start in [*src.windows, *([] if src.minute is None else [src.minute])]:
                    self.windows.delete(key, start, partition)
                src.windows, src.minute = [], None
                self._changed(key, partition)
        run.cross.clear()
