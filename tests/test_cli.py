"""The commands people type: the embedded broker and the demo, end to end (integration)."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import orjson
import psutil
import pytest

from trainguard.broker import free_port

pytestmark = pytest.mark.integration


def _ctrl_c_as_in_a_terminal() -> None:
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored, and
    # so would the CLI it starts: a terminal's Ctrl-C is what these tests send.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _trainguard(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "trainguard.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_ctrl_c_as_in_a_terminal, **kw)


def test_broker_prints_its_address_creates_topics_and_stops_on_ctrl_c():
    from confluent_kafka.admin import AdminClient

    port = free_port()
    home = tempfile.mkdtemp()
    proc = _trainguard("broker", "--port", str(port), "--partitions", "2",
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_COMMAND_KEY")},
                            "XDG_CONFIG_HOME": home})
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert f"127.0.0.1:{port}" in lines[0], lines
        assert lines[1].strip() == f"export TRAINGUARD_BOOTSTRAP=127.0.0.1:{port}", lines
        key_file = os.path.join(home, "trainguard", "command.key")
        assert lines[2].startswith(f"export TRAINGUARD_COMMAND_KEY_FILE={key_file}"), lines
        assert os.stat(key_file).st_mode & 0o777 == 0o600
        topics = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=10).topics
        assert len(topics["trainguard.events"].partitions) == 2
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0 and "stopped" in out
        with socket.socket() as s:  # nothing left listening
            assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_taken_port_gives_the_cause_and_the_way_out():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _trainguard("broker", "--port", str(port))
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert f"port {port}" in out and "already in use" in out and "--port" in out


def test_the_demo_runs_end_to_end_and_ends_with_its_summary(tmp_path):
    started = time.monotonic()
    proc = _trainguard("demo", "--jsonl", str(tmp_path / "alerts.jsonl"), cwd=tmp_path)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    summary = orjson.loads(out.strip().splitlines()[-1])
    assert summary["alerts"] >= 1 and summary["commands"] == ["rollback"]
    assert summary["acks"].get("applied") == 1 and summary["steps_after_rollback"] > 20
    assert "COMMAND ROLLBACK" in out and "ACK applied" in out and "rolled back to step" in out
    lines = out.splitlines()

    def first(text):
        return next(i for i, line in enumerate(lines) if text in line)

    # In the order things happened, across three topics and the trainer's thread.
    assert first(" FIRING ") < first("COMMAND ROLLBACK") < first("trainer: rolled back") < first("ACK applied")
    assert first(" REPORT ") < first("ACK applied")
    assert sum(" FIRING " in line for line in lines) == summary["alerts"]
    reports = list((tmp_path / "reports").rglob("*.txt"))
    assert reports and "decision: ROLLBACK" in reports[0].read_text()
    assert time.monotonic() - started < 180


def test_ctrl_c_during_the_demo_leaves_no_process_behind(tmp_path):
    proc = _trainguard("demo", "--jsonl", str(tmp_path / "alerts.jsonl"), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while "step   20" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2, "the demo's broker and worker are running"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        proc.communicate(timeout=30)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"left behind: {alive}"
        assert proc.returncode == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_replay_on_a_trainer_side_install_names_the_extra_to_install(tmp_path):
    """The trainer side installs confluent-kafka and orjson only; replay needs the engine."""
    run = tmp_path / "run.jsonl"
    run.write_text('{"step": 1, "loss": 0.1}\n')
    code = ("import sys\n"
            "for m in ('numpy', 'scipy', 'yaml', 'sortedcontainers'): sys.modules[m] = None\n"
            "from trainguard.cli import main\n"
            f"sys.exit(main(['replay', {str(run)!r}]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert "trainguard replay: needs the" in result.stderr
    assert "pip install 'trainguard[replay]'" in result.stderr and "Traceback" not in result.stderr


def test_an_embedded_broker_dies_with_the_process_that_started_it():
    """A parent killed with -9 (a test run's timeout, a demo) leaves no broker serving on."""
    code = ("from trainguard.broker import EmbeddedBroker\n"
            "import time\n"
            "b = EmbeddedBroker(port=0, topics=False).start()\n"
            "print(b.proc.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    broker_pid = int(parent.stdout.readline())
    assert psutil.pid_exists(broker_pid)
    parent.kill()
    parent.wait(5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and psutil.pid_exists(broker_pid) and \
            psutil.Process(broker_pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not psutil.pid_exists(broker_pid) or psutil.Process(broker_pid).status() == psutil.STATUS_ZOMBIE


def test_the_worker_writes_nothing_in_its_working_directory(kafka, tmp_path):
    """A container runs the worker as an unprivileged user in a root-owned /app: Faust's data
    folder goes under TRAINGUARD_DATA_DIR (default: the temp folder), never the working directory.
    (Tests run as root here, where a read-only mode does not stop writes: emptiness is the check.)"""
    from tests.integration import WorkerProcess

    workdir = tmp_path / "app"
    workdir.mkdir()
    workdir.chmod(0o555)
    data = tmp_path / "state"
    worker = WorkerProcess(kafka, tmp_path, cwd=workdir, extra_env={"TRAINGUARD_DATA_DIR": str(data)}).start()
    try:
        worker.wait_ready()
        environment = _environment(worker.proc.pid)
    finally:
        worker.kill()
    assert list(workdir.iterdir()) == []
    assert (data / f"{worker.app_id}-data").is_dir()
    assert "PYTHONMALLOC=malloc" in environment, "the worker runs on glibc's malloc, which gives memory back"


def test_a_worker_started_with_pythonmalloc_set_keeps_that_allocator(kafka, tmp_path):
    from tests.integration import WorkerProcess

    worker = WorkerProcess(kafka, tmp_path, extra_env={"PYTHONMALLOC": "pymalloc"}).start()
    try:
        worker.wait_ready()
        environment = _environment(worker.proc.pid)
    finally:
        worker.kill()
    assert "PYTHONMALLOC=pymalloc" in environment and "PYTHONMALLOC=malloc" not in environment


def _environment(pid: int) -> list[str]:
    """The environment a process runs with now (after any exec of its own)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().decode(errors="replace").split("\0")


def test_a_worker_writing_to_a_log_file_writes_no_terminal_codes(kafka, tmp_path):
    """``trainguard worker > log 2>&1`` at its default log level: Faust's spinner wrote cursor codes
    (ESC [?25l, backspaces) into the file; with no terminal there is no spinner."""
    from tests.integration import CliProcess, TopicReader, produce
    from trainguard.schemas import events as ev

    worker = CliProcess(kafka, tmp_path / "worker.log", extra_env={"TERM": "xterm-256color"})
    worker._spawn("worker", "--app-id", f"tg-{uuid.uuid4().hex[:8]}")
    try:
        run_id = f"log-{uuid.uuid4().hex[:6]}"
        nan = ev.metrics_event(run_id, 1, {"actor/kl_loss": float("nan")}, src=ev.source("trainer", "h", 0))
        produce(kafka, kafka.topics.events, run_id, [ev.encode(nan)])
        alerts = TopicReader(kafka, kafka.topics.alerts)
        alerts.wait_for(lambda a: a.get("run_id") == run_id, timeout=90, what="the worker's alert")
        alerts.close()
    finally:
        worker.kill(signal.SIGINT)
    log = worker.log_path.read_bytes()
    assert b"trainguard worker: consuming" in log
    assert b"\x1b" not in log and b"\x08" not in log, log[:2000]


# Every command that talks to Kafka, with the arguments it needs.
KAFKA_COMMANDS = [("worker",), ("demo", "--bootstrap", "BOOTSTRAP"), ("tail",), ("runs",), ("status", "r1"),
                  ("ui", "--port", "0"), ("command", "r1", "pause", "--reason", "x"),
                  ("silence", "r1", "--for", "1h", "--reason", "x"), ("ack", "abcd", "--reason", "x"),
                  ("resolve", "abcd", "--reason", "x"), ("sinks",), ("dlq",)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args", KAFKA_COMMANDS, ids=lambda a: a[0])
def test_a_broker_out_of_reach_is_one_line_within_seconds(args):
    bootstrap = f"127.0.0.1:{_closed_port()}"
    argv = [bootstrap if a == "BOOTSTRAP" else a for a in args]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", *argv], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "TRAINGUARD_BOOTSTRAP": bootstrap})
    took = time.monotonic() - started
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"trainguard {args[0]}: cannot reach the Kafka broker at {bootstrap} (connection refused on port "
        f"{bootstrap.rpartition(':')[2]}); start one with `trainguard broker` or set TRAINGUARD_BOOTSTRAP "
        f"(or --bootstrap)"], done.stderr
    assert took < 5, f"{took:.1f} s"


def test_a_wrong_host_and_a_port_that_is_not_kafka_say_which():
    unknown = subprocess.run([sys.executable, "-m", "trainguard.cli", "runs", "--bootstrap",
                              "no-such-host.invalid:9092"], capture_output=True, text=True, timeout=30)
    assert unknown.returncode == 2 and "(no host named no-such-host.invalid)" in unknown.stderr, unknown.stderr
    with socket.socket() as mute:  # accepts connections (the backlog) and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "trainguard.cli", "tail", "--bootstrap",
                               f"127.0.0.1:{mute.getsockname()[1]}"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "accepts connections but does not answer as Kafka" in done.stderr
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("args", [("runs",), ("runs", "--json"), ("status", "pipe-1"), ("dlq",),
                                  ("tail", "--from", "beginning")], ids=" ".join)
def test_a_reader_that_goes_away_ends_the_command_quietly(kafka, args):
    """`trainguard runs | head -0`: the pipe is closed before the command writes a line."""
    from streams.engine import Engine
    from tests.integration import produce
    from trainguard.schemas import events as ev

    status = {"schema": "status/1", "run_id": "pipe-1", "ts": 1.7e9, "last_step": 7, "last_event_ts": 1.7e9,
              "breaker": {"status": "closed", "rollbacks": 0}, "open_alerts": []}
    produce(kafka, kafka.topics.status, "pipe-1", [orjson.dumps(status)])
    produce(kafka, kafka.topics.dlq, "", [orjson.dumps(Engine.dead_letter(b"x", "not valid JSON").value)])
    produce(kafka, kafka.topics.acks, "pipe-1", [ev.encode(ev.ack_event("c1", "pipe-1", "applied"))])
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", *args], stdout=write, stderr=subprocess.PIPE,
                            env={**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap,
                                 "TRAINGUARD_TOPIC_PREFIX": prefix})
    os.close(write)
    os.close(read)  # gone before the first line
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err and b"Exception ignored" not in err, err.decode()
