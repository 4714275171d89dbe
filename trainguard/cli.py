"""The ``trainguard`` command. Each subcommand imports only what it needs, so the trainer
side (producers, schemas) works without the worker's dependencies installed."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _broker(args) -> int:
    from trainguard.broker import run_forever

    return run_forever(args.host, args.port, args.partitions)


def _worker(args) -> int:
    from trainguard.kafka import KafkaSettings
    from trainguard.streams.app import run_worker

    return run_worker(KafkaSettings.from_env(bootstrap=args.bootstrap), rules_path=args.rules,
                      loglevel=args.loglevel, app_id=args.app_id)


def _node(args) -> int:
    from trainguard.producers.node import main as node_main

    return node_main(args.rest)


def _demo(args) -> int:
    from trainguard.demo import main as demo_main

    return demo_main(args)


def _check_rules(args) -> int:
    from trainguard.streams.rules import RulesError, load

    try:
        ruleset = load(args.file)
    except RulesError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 2
    print(f"{ruleset.path}: {len(ruleset.rules)} rules, {len(ruleset.baselines)} baselines: OK")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="run the embedded Kafka-compatible broker (Tansu) on loopback")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9092)
    p.add_argument("--partitions", type=int, default=4, help="partitions of the topics it creates")
    p.set_defaults(func=_broker)

    p = sub.add_parser("worker", help="run the stream worker (Faust)")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $TRAINGUARD_BOOTSTRAP or 127.0.0.1:9092)")
    p.add_argument("--rules", help="rules YAML (default: the packaged rules/default.yaml)")
    p.add_argument("--app-id", default=os.environ.get("TRAINGUARD_APP_ID", "trainguard"),
                   help="consumer group and state-topic prefix; workers with one id share the work")
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(func=_worker)

    p = sub.add_parser("node", help="run the node agent (GPU via NVML, host via psutil)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_node)

    p = sub.add_parser("demo", help="broker + worker + simulated PPO run with a fault, end to end")
    p.add_argument("--fault", default="kl_explosion",
                   help="kl_explosion, empty_responses, rollout_stall or nan_loss")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--fault-step", type=int, default=75)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--bootstrap", help="use a running broker instead of starting the embedded one")
    p.add_argument("--jsonl", default="out/demo-alerts.jsonl", help="where alerts, commands and acks are kept")
    p.set_defaults(func=_demo)

    p = sub.add_parser("check-rules", help="validate a rules file and exit")
    p.add_argument("file")
    p.set_defaults(func=_check_rules)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
