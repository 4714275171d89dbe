"""``trainguard command``: an operator steers a run by hand.

The command goes where the worker's commands go (the run's partition of the control topic),
signed with the operator's key when one is configured (``TRAINGUARD_OPERATOR_KEY``, or derived
from the secret ``TRAINGUARD_COMMAND_KEY``/``_FILE``), and the trainer acks it like any other.
By default the command waits for that ack and says what the trainer did; ``tail`` shows the
command and the ack as well.

Exit status: 0 applied, 1 rejected or failed by the trainer, 2 bad input or no broker,
3 no ack within ``--wait`` seconds (the command stays valid until it expires).
"""

from __future__ import annotations

import getpass
import math
import os
import socket
import sys
import time
import uuid
from typing import TextIO

from trainguard.core.admin import control_partitions_of
from trainguard.core.clock import local_time
from trainguard.core.kafka import KafkaSettings, partition_for
from trainguard.core.reader import TopicDecoder, topic_reader
from trainguard.schemas import events as ev
from trainguard.schemas.signing import operator_signed
from trainguard.sinks.reports import format_value
from trainguard.terminal import safe, safe_event, safe_json

# Actions an operator sends by hand (the worker's own also include skip_data, checkpoint_now).
MANUAL_ACTIONS = ("pause", "resume", "stop", "rollback", "adjust")

EXIT_APPLIED, EXIT_REFUSED, EXIT_BAD_INPUT, EXIT_NO_ACK = 0, 1, 2, 3


def build_command(run_id: str, action: str, *, reason: str, to_step: int | None = None,
                  path: str | None = None, ttl_s: float = 300.0, params: dict | None = None, env=None) -> dict:
    """The command as it goes out: validated, and signed when a key is configured. ``params``:
    an adjust's scales (``lr_scale`` ...). ValueError names the problem (a rollback without a
    step, an adjust without a scale or outside the limits, a bad run id, several keys)."""
    if action not in MANUAL_ACTIONS:
        raise ValueError(f"action must be one of {', '.join(MANUAL_ACTIONS)}, not {action!r}")
    if action == "rollback" and to_step is None:
        raise ValueError("a rollback needs --to STEP: the checkpoint step to restore")
    if action != "rollback" and (to_step is not None or path):
        raise ValueError(f"--to and --path only go with rollback, not {action}")
    params = {k: v for k, v in (params or {}).items() if v is not None}
    if action == "adjust" and not params:
        raise ValueError("an adjust needs a scale: --lr-scale, --kl-coef-scale or --clip-range-scale")
    if action != "adjust" and params:
        raise ValueError(f"--lr-scale, --kl-coef-scale and --clip-range-scale only go with adjust, not {action}")
    if action == "rollback" and not path:
        raise ValueError("a rollback needs the checkpoint's path, as the trainer reported it "
                         "(resolve_rollback finds it in the run's status)")
    if not reason.strip():
        raise ValueError("--reason must say why (it is kept with the command and shown to the trainer)")
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    target = {"step": to_step, "path": path} if action == "rollback" else None
    try:
        command = ev.command_event(run_id, action, target=target, ttl_s=ttl_s, params=params or None,
                                   detail=f"sent by hand by {who}: {reason.strip()}")
    except ev.SchemaError as exc:
        raise ValueError(str(exc)) from None
    return operator_signed(command, env)


def resolve_rollback(run_id: str, status: dict | None, step: int, path: str | None = None,
                     suspect_ok: bool = False) -> str:
    """The path of the checkpoint ``run_id``'s trainer reported at ``step``, from the run's
    status: a rollback goes only where the trainer itself saved (its own path, absolute as it
    reported it, in the layout its framework loads). ValueError, with the steps it knows and each
    one's verdict, when there is none (or ``path`` is not that checkpoint's), or when the worker
    holds it suspect (saved after a NaN, inside an incident) and ``suspect_ok`` is not given."""
    if status is None:
        raise ValueError(f"no status for run {run_id}: no worker watches it now, so its checkpoints are unknown "
                         f"(`trainguard runs` lists the runs the workers know)")
    known = status.get("saved_checkpoints")
    if known is None:  # a worker of an earlier release publishes only the newest healthy one
        known = [status["last_healthy_checkpoint"]] if status.get("last_healthy_checkpoint") else []
    at_step = [c for c in known if c.get("step") == step]
    if not at_step:
        verdicts = {c["step"]: c.get("healthy") is not False for c in known if type(c.get("step")) is int}
        listed = ", ".join(f"{s}" if healthy else f"{s} (suspect)" for s, healthy in sorted(verdicts.items()))
        raise ValueError(f"run {run_id} reported no checkpoint at step {step}; checkpoints it reported: "
                         f"{listed or 'none reported yet'}")
    chosen = at_step[-1]  # saved again at the same step: the newest
    if path is not None:
        chosen = next((c for c in reversed(at_step) if c["path"] == path), None)
        if chosen is None:
            raise ValueError(f"run {run_id}'s checkpoint at step {step} is {at_step[-1]['path']}, not {path}")
    if chosen.get("healthy") is False and not suspect_ok:
        why = chosen.get("why") or "saved while a P0/P1 alert was open"
        raise ValueError(f"run {run_id}'s checkpoint at step {step} is suspect: {why}; restoring it may restore "
                         f"the fault. --force rolls back to it all the same")
    return chosen["path"]


def send_command(settings: KafkaSettings, command: dict, *, wait_s: float = 60.0,
                 out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Publish ``command`` to its run's control partition and, with ``wait_s`` > 0, wait for
    the trainer's ack. Returns the exit status (see the module's docstring)."""
    from confluent_kafka import KafkaException

    from trainguard.core.publisher import Publisher

    out, err = out or sys.stdout, err or sys.stderr
    run_id = command["run_id"]
    acks = None
    if wait_s > 0:
        # Read the acks from their current end, fixed before the command goes out, so an
        # ack that comes back at once is not missed.
        try:
            acks, missing = topic_reader(settings, [settings.topics.acks], start="now")
            if missing:
                acks.close()
                raise KafkaException(f"no topic {settings.topics.acks}")
        except KafkaException as exc:
            print(f"trainguard command: cannot reach Kafka at {settings.bootstrap} ({exc}); is the broker "
                  f"running and TRAINGUARD_BOOTSTRAP right?", file=err)
            return EXIT_BAD_INPUT
    publisher = Publisher(settings, linger_ms=0)
    try:
        partition = partition_for(run_id, control_partitions_of(settings))
        publisher.publish(settings.topics.control, run_id, ev.encode(command), partition=partition)
        if publisher.flush(10) or publisher.dropped or publisher.delivery_failed:
            print(f"trainguard command: the command did not reach Kafka at {settings.bootstrap} within 10 s; "
                  f"nothing was sent (is the broker running?)", file=err)
            return EXIT_BAD_INPUT
    finally:
        publisher.close(2)
    signed = "signed by key " + command["signature"]["key_id"] if "signature" in command else "unsigned"
    print(f"sent {command['action']} to run {run_id} (command {command['id']}, {signed})", file=out, flush=True)
    if acks is None:
        return EXIT_APPLIED
    if "signature" not in command:
        print("trainguard command: no command key (TRAINGUARD_OPERATOR_KEY, or TRAINGUARD_COMMAND_KEY locally): "
              "listeners refuse unsigned commands "
              "unless TRAINGUARD_ALLOW_UNSIGNED=1", file=err)
    try:
        return _await_ack(acks, command, wait_s, out, err)
    finally:
        acks.close()


def _await_ack(acks, command: dict, wait_s: float, out: TextIO, err: TextIO) -> int:
    deadline = time.monotonic() + wait_s
    print(f"waiting up to {wait_s:.0f} s for the trainer's ack ...", file=err, flush=True)
    while time.monotonic() < deadline:
        for msg in acks.consume(num_messages=100, timeout=0.5):
            if msg.error():
                continue
            try:
                ack = ev.decode(msg.value(), expect=(ev.ACK,))
            except ev.SchemaError:
                continue
            if ack["command_id"] != command["id"]:
                continue
            step = f" at step {ack['step']}" if ack.get("step") is not None else ""
            print(f"{ack['status']}{step}: {safe(ack.get('detail') or '(no detail)')}", file=out, flush=True)
            return EXIT_APPLIED if ack["status"] == "applied" else EXIT_REFUSED
    expires = local_time(command["expires"], "%H:%M:%S")
    print(f"trainguard command: no ack from run {command['run_id']} within {wait_s:.0f} s. Is its trainer "
          f"running with a ControlListener for this run id? The command stays valid until {expires}; "
          f"`trainguard tail --run {command['run_id']}` shows the ack if it comes.", file=err)
    return EXIT_NO_ACK


def main(args) -> int:
    """``trainguard command`` (args from the CLI's parser)."""
    from confluent_kafka import KafkaException

    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    path = args.path
    try:
        statuses: dict[str, dict] | None = None
        try:
            statuses = read_statuses(settings)
        except KafkaException as exc:
            if args.action == "rollback" and args.to is not None:
                print(f"trainguard command: cannot read run {args.run}'s checkpoints from Kafka at "
                      f"{settings.bootstrap}: {exc}", file=sys.stderr)
                return EXIT_BAD_INPUT
        status = (statuses or {}).get(args.run)
        if status and (status.get("finished") or status.get("state_freed")) and not getattr(args, "force", False):
            print(f"trainguard command: run {args.run} has ended ({_state(status)}): no trainer reads its "
                  f"commands any more. A new run under the same id about to start: --force", file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.action == "rollback" and args.to is not None:
            path = resolve_rollback(args.run, status, args.to, args.path, suspect_ok=getattr(args, "force", False))
        scales = {name: getattr(args, name, None) for name in ev.ADJUST_LIMITS}
        command = build_command(args.run, args.action, reason=args.reason, to_step=args.to, path=path,
                                ttl_s=args.ttl, params=scales)
    except ValueError as exc:
        print(f"trainguard command: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return send_command(settings, command, wait_s=args.wait)


# --------------------------------------------------------------------------- runs and status


def read_statuses(settings: KafkaSettings, timeout_s: float = 15.0,
                  decoder: TopicDecoder | None = None) -> dict[str, dict]:
    """The latest status of every run the workers know, from the compacted status topic (read
    to its current end; a tombstone removes a run). A record that is not a valid status of the
    run it is keyed by is skipped and counted in ``decoder``. KafkaException when the broker
    cannot be reached or the topic is missing."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    decoder = decoder or TopicDecoder(settings.topics, "trainguard status")
    topic = settings.topics.status
    consumer = Consumer(settings.confluent(**{"group.id": f"trainguard-status-{uuid.uuid4().hex[:8]}",
                                              "enable.auto.commit": False, "log_level": 2}))
    statuses: dict[str, dict] = {}
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise KafkaException(f"no topic {topic} (create it with `trainguard broker` or the compose "
                                 f"stack's topics job; workers of this release keep it current)")
        ends: dict[int, int] = {}
        parts = []
        for p in sorted(meta.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            if high > low:
                ends[p] = high
                parts.append(TopicPartition(topic, p, low))
        if not parts:
            return statuses
        consumer.assign(parts)
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=1000, timeout=0.5):
                if msg.error():
                    continue
                run_id = (msg.key() or b"").decode("utf-8", "replace")
                decoded = decoder.decode(topic, msg.value())  # a status from another release: skipped
                status = decoded[1] if decoded is not None else None
                if decoded is None:
                    pass
                elif status is None:
                    statuses.pop(run_id, None)
                elif status["run_id"] != run_id:
                    decoder.skip("status: keyed by another run", f"key {run_id[:80]!r}, run_id "
                                                                 f"{status['run_id'][:80]!r}")
                elif (status.get("retained_until") or math.inf) < time.time():
                    statuses.pop(run_id, None)  # a finished run's summary past its retention
                else:
                    statuses[run_id] = status
                partition, offset = msg.partition(), msg.offset()
                if partition is not None and offset is not None and offset + 1 >= ends.get(partition, 0):
                    ends.pop(partition, None)
        if ends:
            raise KafkaException(f"read {topic} for {timeout_s:.0f} s without reaching its end")
    finally:
        consumer.close()
    return statuses


def _ago(ts: float | None, now: float) -> str:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "never"
    s = max(0.0, now - ts)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _clock(ts, fmt: str = "%H:%M:%S") -> str:
    return local_time(ts, fmt)


NOT_APPLIED = ("rejected", "failed", "expired")  # what came of a command the trainer did not apply


def _state(status: dict) -> str:
    breaker = status["breaker"]
    if status.get("state_freed"):  # the run's summary, kept after its detection state was freed
        return f"{status.get('outcome') or 'ended'} (summary)"
    if status.get("finished") or status.get("outcome") == "stopped":
        return status.get("outcome") or "finished"
    command = status.get("command")
    if isinstance(command, dict) and command.get("status") in NOT_APPLIED and isinstance(command.get("said"), str):
        return command["said"]  # the breaker acted, the trainer did not: never "stopped" while it trains on
    state = breaker["status"]
    if state == "stopped":  # the breaker sent a stop; the run has not said it stopped
        state = command["said"] if isinstance(command, dict) and isinstance(command.get("said"), str) else "stop sent"
    if state == "awaiting":
        state = f"awaiting {breaker.get('pending_command') or 'a command'}"
    return state + (" (silenced)" if status.get("silences") else "")


def _by_severity(alerts: list) -> list:
    return sorted(alerts, key=lambda a: (str(a.get("severity") or "P9"), a["rule"]))


def _alerts_brief(status: dict, short: dict[str, str]) -> str:
    return ", ".join(f"{a.get('severity') or '?'} {a['rule']}" + (f" {short[a['id']]}" if a.get("id") in short else "")
                     for a in _by_severity(status["open_alerts"])) or "-"


def _shown(v) -> str:
    return "-" if v is None else format_value(v)


def format_runs(statuses: dict[str, dict], now: float | None = None) -> str:
    """One line per run, the most recently active first. Every string from the topic is made
    terminal-safe; a status whose fields this release cannot show gets a line saying so."""
    now = time.time() if now is None else now
    rows = [("RUN", "STEP", "LAST EVENT", "STATE", "ROLLBACKS", "HEALTHY CKPT", "OPEN ALERTS")]
    order = [safe_event(s) for s in sorted(statuses.values(), key=lambda s: s.get("last_event_ts") or 0, reverse=True)]
    try:  # each open alert with the shortest unique start of its id, which ack and resolve accept
        short = short_ids(a["id"] for s in order for a in s["open_alerts"] if isinstance(a.get("id"), str))
    except Exception:  # a status of a shape this release cannot show: its line says so below
        short = {}
    for s in order:
        try:
            ckpt = s.get("last_healthy_checkpoint")
            rows.append((s["run_id"], _shown(s.get("last_step")), _ago(s.get("last_event_ts"), now), _state(s),
                         _shown(s["breaker"]["rollbacks"]), _shown(ckpt.get("step")) if ckpt else "-",
                         _alerts_brief(s, short)))
        except Exception as exc:  # valid, but of a shape this release cannot show: say so, show the rest
            rows.append((s["run_id"], "?", "?", f"unreadable status ({type(exc).__name__})", "?", "?", "?"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows)


def _eta(eta) -> str:
    """A forecast's ETA as status says it (a worker's own numbers, checked all the same)."""
    if not isinstance(eta, dict):
        return ""
    steps, points, level = eta.get("eta_steps"), eta.get("eta_points"), eta.get("threshold")
    when = f"~{steps} steps" if type(steps) is int else f"~{points} logged points" if type(points) is int else None
    if when is None:
        return ""
    return f", reaches {_shown(level)} in {when}" if type(level) in (int, float) else f", in {when}"


def _suspect_lines(s: dict, shown: int = 5) -> list[str]:
    """The newest checkpoints the worker holds suspect (never a rollback target), each with why."""
    suspect = [c for c in s.get("saved_checkpoints") or [] if isinstance(c, dict) and c.get("healthy") is False]
    lines = [f"    step {_shown(c.get('step'))} suspect: {c.get('why') or 'saved while a P0/P1 alert was open'}"
             for c in suspect[-shown:]]
    if len(suspect) > shown:
        lines.insert(0, f"    ({len(suspect) - shown} older suspect checkpoint(s) not shown)")
    return (["  suspect checkpoints (never a rollback target):"] + lines) if lines else []


def format_status(s: dict, now: float | None = None) -> str:
    """A run's state, a few lines, every string from the topic made terminal-safe."""
    now = time.time() if now is None else now
    s = safe_event(s)
    breaker = s["breaker"]
    lines = [f"run {s['run_id']}: {_state(s)} (as of {_ago(s['ts'], now)}, worker {s.get('worker', '?')})",
             f"  last step {_shown(s.get('last_step'))}, last event {_ago(s.get('last_event_ts'), now)}, "
             f"{_shown(s.get('sources', 0))} source(s)"]
    rolled = f", the last to step {_shown(breaker['restored_step'])}" if breaker.get("restored_step") is not None \
        else ""
    ended = s.get("finished") or s.get("state_freed") or s.get("outcome") in ("finished", "stopped")
    state = f"off (the run {s.get('outcome') or 'ended'})" if ended else breaker["status"]
    if state == "stopped":
        state = "off (it sent a stop)"
    lines.append(f"  breaker {state}; {breaker['rollbacks']} rollback(s){rolled}")
    command = s.get("command")
    if isinstance(command, dict) and isinstance(command.get("said"), str):
        lines.append(f"  last command: {command['said']}")
        if command.get("status") in NOT_APPLIED and not ended:
            lines.append(f"  the run goes on: last step {_shown(s.get('last_step'))}, last event "
                         f"{_ago(s.get('last_event_ts'), now)}")
    if s.get("state_freed"):
        lines.append(f"  ended {s.get('outcome') or '?'}; detection state freed, this summary kept until "
                     f"{_clock(s.get('retained_until'), '%Y-%m-%d %H:%M')}")
        recent = s.get("recent_alerts") or []
        if len(recent) > 5:
            lines.append(f"    the last 5 of its {len(recent)} kept alerts:")
        for a in recent[-5:]:
            lines.append(f"    earlier: {a.get('severity') or '?'} {a.get('rule')} at step {_shown(a.get('step'))}"
                         f"  ({a.get('id') or '-'})")
    if s["open_alerts"]:
        lines.append("  open alerts:")
        for a in _by_severity(s["open_alerts"]):
            where = f" at step {_shown(a['step'])}" if a.get("step") is not None else ""
            value = f" {a['metric']}={_shown(a.get('value'))}" if a.get("metric") else ""
            acked = a.get("acknowledged")
            on_it = (f"  acknowledged by {acked.get('by') or '?'}: {acked.get('reason', '')}"
                     if isinstance(acked, dict) else "")
            lines.append(f"    {a.get('severity') or '?'} {a['rule']}{value}{where}{_eta(a.get('eta'))}  "
                         f"({a.get('id') or '-'}){on_it}")
    else:
        lines.append("  open alerts: none")
    for silence in s.get("silences") or ():
        scope = f"rule {silence['rule']}" if silence.get("rule") else "every rule"
        lines.append(f"  silenced ({scope}) until {_clock(silence.get('until'))} by {silence.get('by') or '?'}: "
                     f"{silence.get('reason', '')}  ({silence.get('id')})")
    from trainguard.streams.engine.state import MAX_CHECKPOINTS

    ckpt = s.get("last_healthy_checkpoint")
    kept = s.get("checkpoints", 0)
    # The worker keeps a run's newest MAX_CHECKPOINTS; at the cap, older ones were seen and let go.
    counted = (f"the newest {kept} checkpoints kept (the worker keeps no more per run)"
               if type(kept) is int and kept >= MAX_CHECKPOINTS else f"{_shown(kept)} checkpoint(s) seen")
    lines.append("  newest healthy checkpoint: "
                 + (f"step {_shown(ckpt.get('step'))} ({ckpt.get('path')})" if ckpt else "none")
                 + f"; {counted}")
    lines += _suspect_lines(s)
    unsigned = [c for c in s.get("unsigned_checkpoints") or [] if isinstance(c, dict)]
    if unsigned:
        lines.append(f"  refused as unsigned (never a rollback target): checkpoint(s) at step(s) "
                     f"{', '.join(_shown(c.get('step')) for c in unsigned)}: {unsigned[-1].get('why') or '?'}")
    unwatched = [n for n in s.get("unwatched_metrics") or [] if isinstance(n, str)]
    if unwatched:
        shown = ", ".join(unwatched[:10]) + (f" (+{len(unwatched) - 10} more)" if len(unwatched) > 10 else "")
        lines.append(f"  logged but judged by no rule: {shown} (add a rule, or map the name to a signal: "
                     f"docs/rules.md)")
    if s.get("dropped_events"):
        lines.append(f"  the trainer's client lost {_shown(s['dropped_events'])} event(s) on the way to the broker "
                     f"(its queue full while the broker was unreachable or slow, or not delivered in time): detection "
                     f"saw gaps; the trainer's close() line counts them by cause")
    return "\n".join(lines)


def _read_statuses_for(name: str, settings: KafkaSettings) -> tuple[dict[str, dict] | None, TopicDecoder]:
    """The statuses (None when Kafka cannot be read, said on stderr) and what was skipped."""
    from confluent_kafka import KafkaException

    decoder = TopicDecoder(settings.topics, name, report=lambda m: print(m, file=sys.stderr))
    try:
        return read_statuses(settings, decoder=decoder), decoder
    except KafkaException as exc:
        print(f"{name}: cannot read run status from Kafka at {settings.bootstrap}: {exc}", file=sys.stderr)
        return None, decoder


def runs_main(args) -> int:
    """``trainguard runs``."""
    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    statuses, decoder = _read_statuses_for("trainguard runs", settings)
    if statuses is None:
        return EXIT_BAD_INPUT
    if decoder.skipped:
        print(f"trainguard runs: {decoder.summary()}", file=sys.stderr)
    if args.json:
        for s in sorted(statuses.values(), key=lambda s: s.get("last_event_ts") or 0, reverse=True):
            print(safe_json(ev.encode(s).decode()))
        return 0
    if not statuses:
        print(f"no runs: the workers on {settings.bootstrap} watch none now (finished runs are forgotten "
              f"after TRAINGUARD_FINISHED_GRACE_S)", file=sys.stderr)
        return 0
    print(format_runs(statuses))
    return 0


def status_main(args) -> int:
    """``trainguard status RUN``."""
    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    statuses, decoder = _read_statuses_for("trainguard status", settings)
    if statuses is None:
        return EXIT_BAD_INPUT
    if decoder.skipped:
        print(f"trainguard status: {decoder.summary()}", file=sys.stderr)
    status = statuses.get(args.run)
    if status is None:
        known = (", ".join(safe(r) for r in sorted(statuses)[:10]) or "none") + \
            (f" and {len(statuses) - 10} more (`trainguard runs` lists them all)" if len(statuses) > 10 else "")
        print(f"trainguard status: no status for run {safe(args.run)}: no worker watches it now (not started, or "
              f"finished and forgotten). Runs known: {known}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(safe_json(ev.encode(status).decode()))
        return 0
    try:
        shown = format_status(status)
    except Exception as exc:  # valid, but of a shape this release cannot show
        print(f"trainguard status: run {safe(args.run)}'s status has fields this release cannot show "
              f"({type(exc).__name__}: {safe(str(exc))[:200]}); --json prints it as it is", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(shown)
    return 0


# --------------------------------------------------------------------------- ids an operator types

MIN_ID_PREFIX = 4


def match_id(given: str, known: dict[str, str], what: str) -> str | None:
    """The id in ``known`` (id -> what it is) that is ``given`` or the only one starting with
    it; None when none is. ValueError for a prefix shorter than ``MIN_ID_PREFIX`` or one that
    several ids start with (they are listed)."""
    if given in known:
        return given
    matches = sorted(i for i in known if i.startswith(given))
    if matches and len(given) < MIN_ID_PREFIX:
        raise ValueError(f"give at least {MIN_ID_PREFIX} characters of the {what} id, not {safe(given)!r}")
    if len(matches) > 1:
        listed = "; ".join(f"{safe(m)} ({safe(known[m])})" for m in matches[:10])
        more = f" and {len(matches) - 10} more" if len(matches) > 10 else ""
        raise ValueError(f"{safe(given)} is the start of {len(matches)} {what} ids: {listed}{more}; give more of it")
    return matches[0] if matches else None


def short_ids(ids, at_least: int = 8) -> dict[str, str]:
    """Each id's shortest prefix (``at_least`` characters or more) that no other of ``ids``
    starts with: what `runs` shows and `ack` / `resolve` accept."""
    ids = sorted(set(ids))
    out = {}
    for i, full in enumerate(ids):
        n = at_least
        for other in (ids[i - 1] if i else "", ids[i + 1] if i + 1 < len(ids) else ""):
            n = max(n, len(os.path.commonprefix([full, other])) + 1)
        out[full] = full[:n]
    return out
