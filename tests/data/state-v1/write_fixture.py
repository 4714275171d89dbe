"""Writes open-alerts.json: a run's state as the release before the one alert book wrote it
(state version 1: open alerts in eight tables), with a NaN page acknowledged by an operator, a
failed rollback's command_failed notice and a trainer gone silent (trainer_hung). Run it from a
checkout of that release: ``git worktree add /tmp/v1 ddf3c72 && cd /tmp/v1 &&
PYTHONPATH=. python tests/data/state-v1/write_fixture.py > open-alerts.json``."""

import base64
import json
import subprocess
import sys

from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

RUN = "v1-run"
TRAINER = ev.source("trainer", "gpu-1", 0)
NODE = ev.source("node", "gpu-1")


def main() -> None:
    now = [1_700_000_000.0]
    engine = Engine(rules_mod.default())
    engine.clock = lambda: now[0]
    offset = [0]

    def feed(event, ack=False):
        offset[0] += 1
        return (engine.handle_ack if ack else engine.handle)(ev.encode(event), 0, offset[0])

    outs = []
    for step in range(1, 31):
        now[0] += 10
        metrics = {"actor/pg_loss": -0.01, "actor/kl_loss": 0.01, "actor/grad_norm": 0.5}
        outs += feed(ev.metrics_event(RUN, step, metrics, src=TRAINER, ts=now[0]))
        outs += feed(ev.metrics_event(RUN, step, {"gpu/memory_used_frac": 0.5}, src=NODE, ts=now[0]))
        if step % 10 == 0:
            outs += feed(ev.checkpoint_event(RUN, step, f"/ckpt/global_step_{step}", ts=now[0]))
    # a NaN: the breaker rolls back at once; the trainer fails the command
    now[0] += 10
    metrics = {"actor/pg_loss": float("nan"), "actor/kl_loss": 0.01, "actor/grad_norm": 0.5}
    outs += feed(ev.metrics_event(RUN, 31, metrics, src=TRAINER, ts=now[0]))
    commands = [o.value for o in outs if o.kind == "command"]
    assert commands and commands[-1]["action"] == "rollback", commands
    outs += feed(ev.ack_event(commands[-1]["id"], RUN, "failed", "no such checkpoint", step=31, ts=now[0]), ack=True)
    # an operator acknowledges the NaN page; then the trainer goes silent
    nan = [o.value for o in outs if o.kind == "alert" and o.value["rule"] == "non_finite"][-1]
    outs += feed(ev.operator_event(RUN, "ack", alert_id=nan["id"], by="ops", reason="looking", ts=now[0]))
    now[0] += 400
    outs += engine.tick()
    fired = [o.value for o in outs if o.kind == "alert" and o.value["status"] == "firing"]
    print(sorted({a["rule"] for a in fired}), file=sys.stderr)
    state = {k.decode(): base64.b64encode(engine.serialize(k)).decode() for k in list(engine.store.keys())}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"written_by": f"trainguard state version 1 @{commit}", "last_offset": offset[0],
                      "last_ts": now[0], "last_step": 31, "nan_alert": nan["id"], "command": commands[-1]["id"],
                      "open": sorted(a["id"] for a in fired), "state": state}, indent=1))


if __name__ == "__main__":
    main()
