"""``trainguard silence``, ``ack`` and ``resolve``: an operator's word on a run, as ``operator/1``
events on the events topic.

Keyed by the run and signed with the operator's key, so the worker that owns the run applies it
in order with the run's events: a silence (no sink pages for the run's alerts, or one rule's,
until it ends; the breaker still acts), an open alert acknowledged (``status`` shows who is on it)
or resolved by hand. Exit status as ``trainguard command``'s (``trainguard/operate.py``).
"""

from __future__ import annotations

import getpass
import socket
import sys
import time

from trainguard.core.clock import local_time
from trainguard.core.kafka import KafkaSettings
from trainguard.core.reader import topic_reader
from trainguard.operate import EXIT_APPLIED, EXIT_BAD_INPUT, EXIT_NO_ACK, EXIT_REFUSED, _clock, match_id, read_statuses
from trainguard.schemas import events as ev
from trainguard.schemas.signing import operator_signed
from trainguard.terminal import safe

# --------------------------------------------------------------------------- silences

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``1d`` or plain seconds; ValueError saying what is accepted."""
    text = text.strip().lower()
    unit = _UNITS.get(text[-1:]) if text else None
    number = text[:-1] if unit else text
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        raise ValueError(f"--for expects a duration such as 90s, 30m, 2h or 1d, not {text!r}") from None
    if not 0 < seconds <= 30 * 86400:
        raise ValueError(f"--for must be between 1 s and 30 days, not {text!r}")
    return seconds


def _silence_id(settings: KafkaSettings, run_id: str, given: str) -> str:
    """The id of ``run_id``'s silence that is ``given`` or starts with it; ``given`` itself when
    the run's status lists none (or cannot be read)."""
    from confluent_kafka import KafkaException

    try:
        status = read_statuses(settings).get(run_id) or {}
    except KafkaException:
        return given
    known = {x["id"]: f"{'rule ' + str(x['rule']) if x.get('rule') else 'every rule'} until {_clock(x.get('until'))}"
             for x in status.get("silences") or () if isinstance(x, dict) and isinstance(x.get("id"), str)}
    return match_id(given, known, "silence") or given


def _known_rule(rule: str, rules_path: str | None) -> None:
    """ValueError naming the closest rules when ``rule`` is in no rule or incident of the rules
    file (the packaged one unless ``--rules``): a typo would silence nothing, quietly."""
    import difflib

    from trainguard.streams import rules as rules_mod

    ruleset = rules_mod.load(rules_path)
    names = [r.name for r in ruleset.rules] + [i.name for i in ruleset.incidents]
    if rule not in names:
        close = difflib.get_close_matches(rule, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"no rule {rule!r} in {ruleset.path}{hint} (a worker with its own rules file: "
                         f"--rules FILE)")


def _say_if_unknown(settings: KafkaSettings, run_id: str) -> None:
    """A line on stderr when no worker knows the run: a silence for a run not started yet is
    kept for it, but a mistyped id silences nothing."""
    try:
        known = read_statuses(settings, timeout_s=5)
    except Exception:  # the broker answered the silence: a status topic it cannot list is not worth failing
        return
    if run_id not in known:
        print(f"trainguard silence: no worker knows a run {run_id!r} yet (`trainguard runs` lists them); the "
              f"silence is kept for it if it starts", file=sys.stderr)


def silence_main(args) -> int:
    """``trainguard silence RUN --for 2h --reason ...`` (or ``--end ID``)."""
    from trainguard.core.publisher import Publisher

    who = f"{getpass.getuser()}@{socket.gethostname()}"
    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    try:
        if not args.reason.strip():
            raise ValueError("--reason must say why (it is kept with the silence and shown in status)")
        if args.end:
            args.end = _silence_id(settings, args.run, args.end)
            event = ev.operator_event(args.run, "unsilence", silence_id=args.end, reason=args.reason, by=who)
        else:
            if args.duration is None:
                raise ValueError("say how long with --for (90s, 30m, 2h, 1d), or end one with --end ID")
            if args.rule:
                _known_rule(args.rule, getattr(args, "rules", None))
            now = time.time()
            event = ev.operator_event(args.run, "silence", rule=args.rule, until=now + parse_duration(args.duration),
                                      reason=args.reason, by=who, ts=now)
    except (ValueError, ev.SchemaError) as exc:
        print(f"trainguard silence: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    publisher = Publisher(settings, linger_ms=0)
    try:
        # Keyed by the run, on the events topic: the worker that owns the run applies it in order.
        publisher.publish(settings.topics.events, args.run, ev.encode(operator_signed(event)))
        if publisher.flush(10) or publisher.dropped or publisher.delivery_failed:
            print(f"trainguard silence: it did not reach Kafka at {settings.bootstrap} within 10 s; nothing "
                  f"changed (is the broker running?)", file=sys.stderr)
            return EXIT_BAD_INPUT
    finally:
        publisher.close(2)
    if args.end:
        print(f"ended silence {args.end} of run {args.run}")
    else:
        _say_if_unknown(settings, args.run)
        scope = f"rule {args.rule} of run {args.run}" if args.rule else f"run {args.run}"
        until = local_time(event["until"])
        print(f"silenced {scope} until {until} (silence {event['id']}): its alerts are recorded and shown, "
              f"no sink pages for them; the breaker still acts. End it early: "
              f"trainguard silence {args.run} --end {event['id']} --reason ...")
    return EXIT_APPLIED


# --------------------------------------------------------------------------- ack and resolve


def _open_alert(settings: KafkaSettings, given: str, run_id: str | None) -> tuple[str, str] | None:
    """``(alert id, run id)`` of the open alert whose id is ``given`` or starts with it, among
    the runs' statuses (``run_id``'s only, when given); None when no open alert is."""
    known, run_of = {}, {}
    for status in read_statuses(settings).values():
        if run_id is not None and status["run_id"] != run_id:
            continue
        for a in status["open_alerts"]:
            if isinstance(a.get("id"), str):
                known[a["id"]] = f"{a.get('severity') or '?'} {a.get('rule')} of run {status['run_id']}"
                run_of[a["id"]] = status["run_id"]
    found = match_id(given, known, "open alert")
    return (found, run_of[found]) if found else None


def alert_main(args) -> int:
    """``trainguard ack ALERT`` and ``trainguard resolve ALERT``: an open alert acknowledged
    (someone is on it; `status` shows who) or resolved by hand (the worker publishes its
    resolution; a condition that still holds fires again after the rule's duration)."""
    from confluent_kafka import KafkaException

    from trainguard.core.publisher import Publisher

    action, name = args.command, f"trainguard {args.command}"
    if not args.reason.strip():
        print(f"{name}: --reason must say why (kept with the alert, shown in status)", file=sys.stderr)
        return EXIT_BAD_INPUT
    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    run_id = args.run
    alert_id = args.alert
    try:
        try:
            found = _open_alert(settings, alert_id, run_id)
        except KafkaException:
            if run_id is None:
                raise
            found = None  # the run is given: the id goes as it is
        if found is not None:
            alert_id, run_id = found
        elif run_id is None:
            print(f"{name}: no open alert of any run is or starts with {safe(alert_id)} (`trainguard runs` lists "
                  f"each run's open alerts with their ids; give --run if the run's status is not out yet)",
                  file=sys.stderr)
            return EXIT_REFUSED
        event = ev.operator_event(run_id, action, alert_id=alert_id, reason=args.reason,
                                  by=f"{getpass.getuser()}@{socket.gethostname()}")
        alerts = None
        if action == "resolve" and args.wait > 0:
            alerts, _missing = topic_reader(settings, [settings.topics.alerts], start="now")
    except (KafkaException, ev.SchemaError, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    publisher = Publisher(settings, linger_ms=0)
    try:
        # In order with the run's events; signed, or the worker refuses it.
        publisher.publish(settings.topics.events, run_id, ev.encode(operator_signed(event)))
        if publisher.flush(10) or publisher.dropped or publisher.delivery_failed:
            print(f"{name}: it did not reach Kafka at {settings.bootstrap} within 10 s (is the broker running?)",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
    finally:
        publisher.close(2)
    if alerts is None:
        print(f"{'acknowledged' if action == 'ack' else 'resolve sent for'} {alert_id} of run {run_id}; "
              f"`trainguard status {run_id}` shows it within a few seconds")
        return EXIT_APPLIED
    try:
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            for msg in alerts.consume(num_messages=100, timeout=0.5):
                if msg.error():
                    continue
                try:
                    alert = ev.decode(msg.value(), expect=(ev.ALERT, ev.REPORT))
                except ev.SchemaError:
                    continue
                if alert.get("id") == alert_id and alert.get("status") == "resolved":
                    print(f"resolved {alert_id} of run {run_id}: {safe(str(alert.get('resolution', '')))}")
                    return EXIT_APPLIED
    finally:
        alerts.close()
    print(f"{name}: the worker did not publish the resolution within {args.wait:.0f} s: the alert was not open "
          f"any more, or no worker owns run {run_id} now (`trainguard status {run_id}`)", file=sys.stderr)
    return EXIT_NO_ACK
