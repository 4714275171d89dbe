"""The README's training loop, run as written: its code block, a worker, a toy model.

The loop gets a toy model (one weight) whose training turns NaN on a poisoned batch, and
checkpoints that are real files. With a fault: the first poisoned batch makes the worker roll
the run back at once (NaN is immediate) and skip the batches that led into it; the second, soon
after, is the same incident coming back after a rollback, so the worker climbs its recovery
ladder: a wider rewind with twice the skip, then a rollback with an adjust, which this loop
refuses, so the worker stops the run. The loop must rewind its step and its data, and leave
the training loop itself on the stop.
Run to its end, the loop says it finished and is never paged as hung; killed, it is paged
once. Steered by hand (`trainguard command`), it rolls back to the checkpoint it reported,
acks a checkpoint that does not load as `failed` and trains on, and refuses `pause`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.integration import TopicReader, WorkerProcess, wait_until
from trainguard.operate import read_statuses
from trainguard.schemas import events as ev

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "readme_loop.py"
_spec = importlib.util.spec_from_file_location("readme_loop", EXAMPLE)
assert _spec is not None and _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
ToyTrainer = _example.ToyTrainer  # the example's toy model: one weight, JSON checkpoints
RUN = "ppo-7b-0412"  # the README's run id


def readme_loop(run_id: str = RUN) -> str:
    text = README.read_text()
    section = text[text.index("## Hook a real training loop"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert code.count(f'"{RUN}"') == 2, "the README's loop names its run id twice"
    return code.replace(f'"{RUN}"', json.dumps(run_id))


def test_the_example_program_holds_the_readme_loop_as_written():
    text = EXAMPLE.read_text()
    inside = text[text.index("# ---- the README's loop, as written there ----\n"):text.index("    # ---- end of")]
    block = textwrap.dedent(inside.split("\n", 1)[1]).strip("\n")
    assert block == readme_loop().strip("\n"), "examples/readme_loop.py no longer holds the README's loop"


def test_the_example_program_runs_the_loop_to_its_end(kafka, tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "25", "--checkpoints", str(tmp_path / "ckpt")],
                          cwd=tmp_path, env=_env(kafka), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ended at step 25 of 25, finished; rolled back to: none" in proc.stdout, proc.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["global_step_10.json", "global_step_20.json"]
    events = TopicReader(kafka, kafka.topics.events)
    ends = _lifecycles(events, RUN)
    assert ends and ends[-1] == "finished", ends
    events.close()


def run_readme_loop(namespace: dict, run_id: str = RUN) -> dict:
    exec(compile(readme_loop(run_id), str(README), "exec"), namespace)
    return namespace


def _env(kafka, monkeypatch=None) -> dict:
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {"TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
           "TRAINGUARD_PARTITIONS": str(kafka.partitions)}
    if monkeypatch is not None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    return {**os.environ, **env}


def _lifecycles(events: TopicReader, run_id: str) -> list[str]:
    return [e["event"] for e in events.drain(1.0) if e["schema"] == ev.LIFECYCLE and e["run_id"] == run_id]


def test_the_readme_loop_rolls_back_skips_the_bad_data_and_stops(kafka, tmp_path, monkeypatch):
    _env(kafka, monkeypatch)
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        toy = ToyTrainer(poisoned=set(range(30, 400)), ckpt_dir=tmp_path / "ckpt")  # a shard bad for good
        namespace = run_readme_loop(toy.namespace(total_steps=400))

        step, skipped = namespace["step"], namespace["skipped"]
        # Batch 30 turned step 31 NaN: rolled back at once to the checkpoint of step 30, skipping it.
        assert toy.loaded and toy.loaded[0].endswith("global_step_30.json"), toy.loaded
        # Batch 31 is the same incident back on the first step after it: a wider rewind to step 20,
        # skipping twice the 11 batches from there to the failure (22); batch 43 is bad too, so the
        # last rung's rollback (twice the last skip and the one batch back to the failure: 45), with
        # no adjust: the loop's started event said it applies none.
        assert [Path(p).stem for p in toy.loaded] == ["global_step_30", "global_step_20", "global_step_20"]
        assert skipped == 1 + 22 + 45, skipped
        commands = TopicReader(kafka, kafka.topics.control)
        sent = [c["action"] for c in commands.drain(2.0) if c["run_id"] == RUN]
        assert "adjust" not in sent and sent[-1] == "stop", sent
        commands.close()
        rewound = [i for i in range(1, len(toy.batches)) if toy.batches[i] <= toy.batches[i - 1]]
        assert len(rewound) >= 1, "the data rewound with the step (the restore undid those batches)"
        assert namespace["stop"] is True and step < 100, "the stop left the training loop long before 400 steps"
        assert namespace["logger"]._closed
        events = TopicReader(kafka, kafka.topics.events)
        ends = _lifecycles(events, RUN)
        assert "rolled_back" in ends and ends[-1] == "stopped" and "finished" not in ends, ends
        events.close()
    finally:
        worker.kill()


def test_bad_data_over_consecutive_batches_is_passed_and_the_newest_healthy_checkpoint_is_finite(kafka, tmp_path):
    """The example program, bad data on batches 30, 31 and 32 (the common case): the NaN right after
    the first rollback is the incident coming back, the wider rewind skips past the bad batches, and
    the run trains to its end on finite weights; what `trainguard status` calls the newest healthy
    checkpoint holds a finite weight."""
    env = _env(kafka)
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        ckpt = tmp_path / "ckpt"
        proc = subprocess.run([sys.executable, str(EXAMPLE), "--poison", "30", "--poison", "31", "--poison", "32",
                               "--checkpoints", str(ckpt)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        said = re.search(r"ended at step (\d+) of 200, (\w+); rolled back to: ([\w, ]+); (\d+) batch\(es\) skipped; "
                         r"weight (\S+);", proc.stdout)
        assert said, proc.stdout
        assert said.group(1, 2, 3) == ("200", "finished", "global_step_30, global_step_20"), proc.stdout
        assert float(said.group(5)) == pytest.approx(0.999 ** 200, rel=0.2), "the loop's weight ends finite"

        def newest_healthy():
            status = read_statuses(kafka, timeout_s=5).get(RUN) or {}
            return status if status.get("finished") and status.get("last_step") == 200 else None

        wait_until(newest_healthy, timeout=60, what="the finished run's status")
        shown = subprocess.run([sys.executable, "-m", "trainguard.cli", "status", RUN], capture_output=True,
                               text=True, env=env, cwd=tmp_path, timeout=120)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        named = re.search(r"newest healthy checkpoint: step (\d+) \((.+?)\)", shown.stdout)
        assert named, shown.stdout
        weight = json.loads(Path(named.group(2)).read_text())["weight"]
        assert weight == weight and abs(weight) < 2, (named.group(0), weight)
        assert int(named.group(1)) == 200, shown.stdout
    finally:
        worker.kill()


def test_a_trainer_started_without_its_key_is_paged_unauthenticated_and_never_called_stopped(kafka, tmp_path,
                                                                                          monkeypatch):
    """The README loop started without the key (no TRAINGUARD_COMMAND_KEY_FILE exported) beside a
    worker that has one: its checkpoints are refused as unsigned and its metrics carry no MAC, so its
    NaN pages, marked unauthenticated, and steers nothing (anyone could have written it). No command
    is sent, the loop trains on, and `trainguard status` never claims the run stopped; it names the
    checkpoints refused as unsigned. (A trainer that refuses a command it was sent: the engine's
    tests in tests/test_authority.py and the `trainer_refuses` recovery scenario.)"""
    from trainguard.schemas.signing import new_key_line

    env = _env(kafka, monkeypatch)
    for name in ("TRAINGUARD_COMMAND_KEY", "TRAINGUARD_COMMAND_KEY_FILE", "TRAINGUARD_TRAINER_KEY"):
        monkeypatch.delenv(name, raising=False)
        env.pop(name, None)
    worker = WorkerProcess(kafka, tmp_path, extra_env={"TRAINGUARD_COMMAND_KEY": new_key_line("worker")}).start()
    run_id = f"keyless-{int(time.time() * 1000)}"
    try:
        worker.wait_ready()
        alerts = TopicReader(kafka, kafka.topics.alerts)
        toy = ToyTrainer(poisoned={30}, ckpt_dir=tmp_path / "ckpt")
        namespace = run_readme_loop(toy.namespace(total_steps=120), run_id=run_id)
        assert namespace["step"] == 120 and not namespace["stop"], "nothing steered the loop"
        paged = alerts.wait_for(lambda a: a["run_id"] == run_id and a.get("severity") == "P0", timeout=30,
                                what="the keyless NaN paged", worker=worker)
        assert paged["authority"] == "unauthenticated" and paged["summary"].startswith("Unauthenticated metrics"), \
            paged
        alerts.close()
        commands = TopicReader(kafka, kafka.topics.control)
        assert [c for c in commands.drain(2.0) if c["run_id"] == run_id] == [], "no command on unsigned metrics"
        commands.close()

        def seen():
            status = read_statuses(kafka, timeout_s=5).get(run_id) or {}
            return status if status.get("last_step") == 120 else None

        wait_until(seen, timeout=60, what="the run's last step in its status")
        shown = subprocess.run([sys.executable, "-m", "trainguard.cli", "status", run_id], capture_output=True,
                               text=True, env=env, cwd=tmp_path, timeout=120)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "stopped" not in shown.stdout.splitlines()[0], shown.stdout
        # the newest ten of the twelve it saved, and why
        assert ("refused as unsigned (never a rollback target): checkpoint(s) at step(s) 30, 40, 50, 60, 70, 80, 90, "
                "100, 110, 120: refused checkpoint/1: not signed by the run's trainer's key") in shown.stdout, \
            shown.stdout
    finally:
        worker.kill()


def test_the_readme_loop_run_again_under_its_fixed_run_id_is_rolled_back_again(kafka, tmp_path, monkeypatch):
    """The README's run id is fixed: a second run of the loop under it, NaN at the same step, gets
    its own rollback (the first run's was acked; a copy of it would be dropped by the new
    listener as already applied, and the second run would train on NaN weights)."""
    _env(kafka, monkeypatch)
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        loaded = []
        for attempt in ("first", "second"):
            toy = ToyTrainer(poisoned={30}, ckpt_dir=tmp_path / attempt)
            namespace = run_readme_loop(toy.namespace(total_steps=60))
            assert namespace["step"] == 60 and not namespace["stop"], attempt
            loaded.append([Path(p).relative_to(tmp_path).as_posix() for p in toy.loaded])
        assert loaded == [["first/global_step_30.json"], ["second/global_step_30.json"]], loaded
    finally:
        worker.kill()


STALE_S = 4
HUNG_RULES = f"""
version: 1
rules:
  - name: trainer_hung
    metric: "*"
    detector: {{kind: stale, timeout_s: {STALE_S}}}
    sources: [trainer]
    severity: P1
    summary: Trainer hung
"""

# The README loop in a process of its own, training until it is killed.
CHILD = """
import sys
from tests.test_readme_loop import ToyTrainer, run_readme_loop
run_readme_loop(ToyTrainer(set(), sys.argv[2]).namespace(total_steps=10**6), run_id=sys.argv[1])
"""


def test_a_finished_run_is_never_paged_as_hung_and_a_killed_one_once(kafka, tmp_path, monkeypatch):
    env = _env(kafka, monkeypatch)
    rules = tmp_path / "hung.yaml"
    rules.write_text(HUNG_RULES)
    worker = WorkerProcess(kafka, tmp_path, rules_path=rules).start()
    killed = None
    try:
        worker.wait_ready()
        events = TopicReader(kafka, kafka.topics.events)
        killed = subprocess.Popen([sys.executable, "-c", CHILD, "killed-1", str(tmp_path / "killed")], cwd=ROOT,
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        toy = ToyTrainer(set(), tmp_path / "ckpt")
        namespace = run_readme_loop(toy.namespace(total_steps=30))
        assert namespace["step"] == 30 and namespace["stop"] is False
        events.wait_for(lambda e: e["run_id"] == "killed-1" and e["schema"] == ev.METRICS and e["step"] >= 20,
                        timeout=60, what="the other trainer's 20th step", worker=worker)
        os.killpg(killed.pid, signal.SIGKILL)  # a crash: nothing more, not even a word
        killed.wait(10)
        ended_at = time.monotonic()

        alerts = TopicReader(kafka, kafka.topics.alerts)
        alerts.wait_for(lambda a: a["rule"] == "trainer_hung" and a["run_id"] == "killed-1", timeout=30,
                        what="the killed trainer's hung alert", worker=worker)
        paged_at = time.monotonic()

        def hung_in_status():
            status = read_statuses(kafka, timeout_s=5).get("killed-1") or {}
            return [(x["rule"], x["severity"]) for x in status.get("open_alerts", [])] == [("trainer_hung", "P1")]

        wait_until(hung_in_status, timeout=10, what="the open page in the killed run's status")
        assert time.monotonic() - paged_at <= 10
        time.sleep(max(0.0, 3 * STALE_S + 5 - (time.monotonic() - ended_at)))  # 3x the timeout, and a tick
        hung = [a for a in alerts.drain(2.0) if a["rule"] == "trainer_hung"]
        assert {a["run_id"] for a in hung} == {"killed-1"}, "the finished run was paged as hung"
        assert len({a["id"] for a in hung if a["status"] == "firing"}) == 1, hung
        assert _lifecycles(events, RUN)[-1] == "finished"
        assert "finished" not in _lifecycles(events, "killed-1")
        events.close()
        alerts.close()
    finally:
        if killed is not None and killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
        worker.kill()


def _command(env: dict, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "command", RUN, *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def test_commands_by_hand_roll_back_to_a_reported_checkpoint_fail_loudly_and_refuse_pause(kafka, tmp_path,
                                                                                          monkeypatch):
    env = _env(kafka, monkeypatch)
    worker = WorkerProcess(kafka, tmp_path).start()
    elsewhere = tmp_path / "elsewhere"  # the operator's shell is not in the trainer's directory
    elsewhere.mkdir()
    outcome: dict = {}
    toy = ToyTrainer(set(), tmp_path / "ckpt", step_s=0.1)

    def train():
        try:
            outcome["namespace"] = run_readme_loop(toy.namespace(total_steps=100_000))
        except BaseException as exc:  # the test fails on it below
            outcome["error"] = exc

    loop = threading.Thread(target=train, daemon=True)
    try:
        worker.wait_ready()
        loop.start()

        def known_steps():
            status = read_statuses(kafka, timeout_s=5).get(RUN) or {}
            steps = [c["step"] for c in status.get("saved_checkpoints", [])]
            return steps if {10, 20} <= set(steps) else None

        wait_until(known_steps, timeout=60, what="checkpoints 10 and 20 in the run's status")

        unknown = _command(env, "rollback", "--to", "15", "--reason", "no such checkpoint", cwd=elsewhere)
        assert unknown.returncode == 2, unknown.stdout + unknown.stderr
        assert "no checkpoint at step 15" in unknown.stderr and "10, 20" in unknown.stderr, unknown.stderr

        rollback = _command(env, "rollback", "--to", "20", "--reason", "bad shard after 20", cwd=elsewhere)
        assert rollback.returncode == 0, rollback.stdout + rollback.stderr
        assert "applied at step" in rollback.stdout and "restored step 20" in rollback.stdout, rollback.stdout
        assert toy.loaded == [str(toy.ckpt_dir / "global_step_20.json")]

        (toy.ckpt_dir / "global_step_10.json").unlink()  # reported, then lost (a cleaned disk)
        gone = _command(env, "rollback", "--to", "10", "--reason", "further back", cwd=elsewhere)
        assert gone.returncode == 1, gone.stdout + gone.stderr
        assert "failed at step" in gone.stdout and "FileNotFoundError" in gone.stdout, gone.stdout
        batches = len(toy.batches)
        wait_until(lambda: len(toy.batches) > batches + 5, timeout=30, what="training going on after the failure")

        pause = _command(env, "pause", "--reason", "read the samples", cwd=elsewhere)
        assert pause.returncode == 1, pause.stdout + pause.stderr
        assert "rejected" in pause.stdout and "does not handle pause" in pause.stdout, pause.stdout

        stop = _command(env, "stop", "--reason", "enough", cwd=elsewhere)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        loop.join(30)
        assert not loop.is_alive() and "error" not in outcome, outcome
        assert outcome["namespace"]["stop"] is True
        events = TopicReader(kafka, kafka.topics.events)
        ends = _lifecycles(events, RUN)
        assert ends.count("rolled_back") == 1 and ends[-1] == "stopped" and "finished" not in ends, ends
        events.close()
    finally:
        if loop.is_alive():
            _command(env, "stop", "--reason", "test over", "--wait", "0", cwd=elsewhere)
            loop.join(10)
        worker.kill()
