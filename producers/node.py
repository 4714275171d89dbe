"""The node agent: one daemon per machine publishing the resource layer of a run.

Every ``interval_s`` it samples the host (psutil) and every GPU (NVML through ``pynvml``,
from the ``nvidia-ml-py`` package) and publishes **one** ``metrics/1`` event per host
(source kind ``node``, layer ``resource``) carrying all GPUs, metric names suffixed with
the device index::

    gpu/utilization_pct[0]  gpu/memory_used_gb[0]  gpu/temperature_c[0]  gpu/power_w[0] ...
    system/cpu_pct  system/cpu_load_avg  system/memory_used_pct  system/disk_io_wait_ms ...

The event's step is a counter of samples (0, 1, 2 ...), not a training step.

Robustness, because a monitoring daemon must outlive what it monitors:

- no NVML (no driver, no GPU, library missing): one clear log line, then host metrics only;
- a counter a GPU does not offer (ECC on consumer cards, NVLink on PCIe boards ...) is
  simply absent; the agent stops asking for it after the first NotSupported answer;
- any other per-GPU read error leaves that value out of this sample and the loop goes on;
  ``gpu/responding[i]`` turns 0 when even the basic memory query fails (a GPU that fell
  off the bus is itself the signal);
- publishing never blocks or raises (see :class:`~trainguard.core.publisher.Publisher`).

Units: memory in GiB (2**30 bytes, as verl's ``perf/max_memory_allocated_gb``), power in W,
temperature in °C, ECC counts are NVML's *volatile* counters (since the last driver
load, so a rise is news), XID counts are critical XID events seen since the agent started.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import socket
import sys
import threading
import time
from typing import Any, Callable

from trainguard.core import settings as settings_mod
from trainguard.core.kafka import KafkaSettings
from trainguard.producers.never_raise import never_raises
from trainguard.schemas import events as ev
from trainguard.schemas.signing import Keyring, TrainerKey, signed_bytes, unsigned_allowed

log = logging.getLogger("trainguard.node")

GIB = float(1 << 30)


def _psutil():
    try:
        import psutil

        return psutil
    except ImportError:
        return None


class _Unsupported(Exception):
    """A counter this GPU does not offer."""


def _node_key(run_id: str) -> TrainerKey | None:
    """The node agent's key for ``run_id`` (``TRAINGUARD_NODE_KEY``, or derived locally); a bad or
    missing one is said once and the samples go unsigned: a worker with keys still alerts on them."""
    try:
        key = Keyring.from_env().node_key_for(run_id)
    except ValueError as exc:
        log.warning("trainguard: %s; node samples of run %s go unsigned", exc, run_id)
        return None
    if key is None and not unsigned_allowed():
        log.warning("trainguard: no node key for run %s (TRAINGUARD_NODE_KEY, or TRAINGUARD_COMMAND_KEY locally): "
                    "its samples go unsigned, and a worker with keys marks their alerts unauthenticated and keeps "
                    "them out of every incident that steers", run_id)
    return key


class NodeAgent:
    """Sample this machine's GPUs and host, publish one resource-layer event per interval.

    ``collect()`` returns one sample as ``{metric: float}``; ``run(stop)`` publishes one
    sample every ``interval_s`` until ``stop`` is set. ``nvml`` replaces the ``pynvml``
    module (tests, or a wrapper); by default it is imported on first use.
    """

    def __init__(self, settings: KafkaSettings | None = None, run_id: str = "", interval_s: float = 5.0,
                 host: str | None = None, publisher=None, *, nvml: Any = None):
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.settings = settings or KafkaSettings.from_env()
        self.run_id = run_id
        self.interval_s = float(interval_s)
        self.host = host or socket.gethostname()
        self._publisher = publisher
        self.source = ev.source("node", self.host)
        self.key = _node_key(run_id)
        self.step = 0               # samples published (or attempted) so far = next event's step
        self.nvml_error: str | None = None
        self.gpu_count = 0
        self.read_errors = 0        # per-value read failures other than "not supported"
        self._nvml = nvml
        self._nvml_started = False
        self._handles: list[Any] = []
        self._unsupported: set[tuple[int, str]] = set()
        self._nvlinks: dict[int, list[int]] = {}
        self._xid_set = None
        self._xid_count: dict[int, int] = {}
        self._last_xid: dict[int, int] = {}
        self._errors_said: set[tuple[int, str, str]] = set()
        self._psutil = _psutil()
        self._host_said = False
        self._prev_cpu: tuple[float, Any] | None = None   # (monotonic time, cpu_times) for iowait deltas
        self._prev_disk: tuple[float, Any] | None = None  # (monotonic time, disk_io_counters)
        if self._psutil is not None:
            with contextlib.suppress(Exception):
                self._psutil.cpu_percent(interval=None)  # prime: the next call measures since now

    # ------------------------------------------------------------------ publishing

    @property
    def publisher(self):
        if self._publisher is None:
            from trainguard.core.publisher import Publisher

            self._publisher = Publisher(self.settings)
        return self._publisher

    def publish_once(self) -> dict[str, float]:
        """Collect one sample and publish it as one event; return the sample."""
        metrics = self.collect()
        event = ev.metrics_event(self.run_id, self.step, metrics, src=self.source, layer="resource")
        self.step += 1
        with never_raises(f"node agent: could not publish sample {event['step']}"):  # a broken encoder, say
            self.publisher.publish(self.settings.topics.events, self.run_id, signed_bytes(event, self.key))
        return metrics

    def run(self, stop: threading.Event, on_sample: Callable[["NodeAgent", dict], None] | None = None) -> None:
        """Publish one sample per interval (the first at once) until ``stop`` is set, then flush."""
        next_at = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    metrics = self.publish_once()
                    if on_sample is not None:
                        on_sample(self, metrics)
                except Exception as exc:  # one bad sample never ends the daemon
                    log.exception("node agent: sample failed: %s", exc)
                next_at += self.interval_s
                now = time.monotonic()
                if next_at < now:  # fell behind (suspended, very slow NVML): do not burst to catch up
                    next_at = now + self.interval_s
                stop.wait(next_at - now)
        finally:
            if self._publisher is not None:
                self._publisher.flush(5.0)

    def stats(self) -> dict:
        if self._publisher is not None:
            # the broker's acknowledgements of the last samples, served now: the publisher serves
            # them every 16th event, which for a node agent is every minute or so
            self._publisher.flush(0.0)
        pub = self._publisher.stats() if self._publisher is not None else {"sent": 0, "dropped": 0,
                                                                            "delivery_failed": 0, "pending": 0}
        return {"host": self.host, "gpus": self.gpu_count, "samples": self.step, "nvml_error": self.nvml_error,
                "read_errors": self.read_errors, **pub}

    def close(self) -> None:
        if self._xid_set is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlEventSetFree(self._xid_set)
            self._xid_set = None
        if self._nvml_started:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml_started = False
        if self._publisher is not None:
            self._publisher.flush(5.0)

    # ------------------------------------------------------------------ sampling

    def collect(self) -> dict[str, float]:
        """One sample of host and GPU metrics. Never raises."""
        metrics: dict[str, float] = {}
        try:
            self._collect_host(metrics)
        except Exception as exc:
            self._say_once(-1, "host", exc)
        if self._start_nvml():
            self._drain_xid_events()
            for i, handle in enumerate(self._handles):
                try:
                    self._collect_gpu(i, handle, metrics)
                except Exception as exc:  # belt and braces: every read below is guarded already
                    self._say_once(i, "gpu", exc)
        return metrics

    # -- host ------------------------------------------------------------------------

    def _collect_host(self, m: dict[str, float]) -> None:
        ps = self._psutil
        if ps is None:
            if not self._host_said:
                self._host_said = True
                log.warning("psutil is not installed (pip install 'trainguard[node]'): no host metrics")
            return
        m["system/cpu_pct"] = float(ps.cpu_percent(interval=None))
        try:
            m["system/cpu_load_avg"] = float(ps.getloadavg()[1])  # the 5-minute load average
        except (AttributeError, OSError):
            pass
        vm = ps.virtual_memory()
        m["system/memory_used_pct"] = float(vm.percent)
        # total - available: memory the system cannot hand out (psutil's "used" omits some kinds)
        m["system/memory_used_gb"] = (vm.total - vm.available) / GIB
        m["system/memory_total_gb"] = vm.total / GIB
        now = time.monotonic()
        # system/disk_io_wait_ms comes from the CPU's iowait time (psutil.cpu_times().iowait,
        # Linux): milliseconds of CPU time spent waiting on I/O per second of wall time, summed
        # over all CPUs (1000 = one CPU waiting all the time). It is what a starving data
        # loader looks like from the host. Absent on the first sample (no delta yet) and on
        # systems without an iowait counter.
        cpu = ps.cpu_times()
        if self._prev_cpu is not None and hasattr(cpu, "iowait"):
            t0, prev = self._prev_cpu
            elapsed = now - t0
            if elapsed > 0:
                waited = max(0.0, cpu.iowait - prev.iowait)
                m["system/disk_io_wait_ms"] = waited * 1000.0 / elapsed
                busy_total = sum(cpu) - sum(prev)
                if busy_total > 0:
                    m["system/cpu_iowait_pct"] = 100.0 * waited / busy_total
        self._prev_cpu = (now, cpu)
        try:
            disk = ps.disk_io_counters()
        except Exception:
            disk = None
        if disk is not None:
            if self._prev_disk is not None:
                t0, prev = self._prev_disk
                elapsed = now - t0
                if elapsed > 0:
                    m["system/disk_read_mb_s"] = max(0, disk.read_bytes - prev.read_bytes) / 1e6 / elapsed
                    m["system/disk_write_mb_s"] = max(0, disk.write_bytes - prev.write_bytes) / 1e6 / elapsed
            self._prev_disk = (now, disk)

    # -- NVML ------------------------------------------------------------------------

    def _start_nvml(self) -> bool:
        if self._nvml_started:
            return True
        if self.nvml_error is not None:
            return False  # said once; NVML does not come back without a restart of the agent
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nv = self._nvml
            nv.nvmlInit()
            count = int(nv.nvmlDeviceGetCount())
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            if isinstance(exc, ImportError):
                reason = "pynvml is not installed (pip install 'trainguard[node]')"
            self.nvml_error = reason
            self._handles = []
            log.warning("NVML unavailable (%s): publishing host metrics only", reason)
            return False
        self._nvml_started = True
        self.gpu_count = len(self._handles)
        log.info("NVML: %d GPU(s) on %s", self.gpu_count, self.host)
        self._setup_xid_events()
        for i, handle in enumerate(self._handles):
            self._nvlinks[i] = self._active_nvlinks(handle)
        return True

    def _is_not_supported(self, exc: Exception) -> bool:
        nv = self._nvml
        cls = getattr(nv, "NVMLError_NotSupported", None)
        if cls is not None and isinstance(exc, cls):
            return True
        return getattr(exc, "value", None) == getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3)

    def _say_once(self, gpu: int, what: str, exc: Exception) -> None:
        key = (gpu, what, type(exc).__name__)
        if key not in self._errors_said:
            self._errors_said.add(key)
            where = "host" if gpu < 0 else f"GPU {gpu}"
            log.warning("node agent: reading %s on %s failed (%s); going on without it", what, where, exc)

    def _read(self, i: int, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` or None: remembers counters the GPU does not offer, counts other failures."""
        if (i, name) in self._unsupported:
            return None
        try:
            return fn()
        except Exception as exc:
            if self._is_not_supported(exc):
                self._unsupported.add((i, name))
                log.debug("GPU %d does not offer %s", i, name)
            else:
                self.read_errors += 1
                self._say_once(i, name, exc)
            return None

    def _collect_gpu(self, i: int, h: Any, m: dict[str, float]) -> None:
        nv = self._nvml
        sfx = f"[{i}]"
        mem = self._read(i, "memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        m["gpu/responding" + sfx] = 0.0 if mem is None and (i, "memory") not in self._unsupported else 1.0
        if mem is not None:
            m["gpu/memory_used_gb" + sfx] = mem.used / GIB
            m["gpu/memory_total_gb" + sfx] = mem.total / GIB
            if mem.total:
                m["gpu/memory_used_pct" + sfx] = 100.0 * mem.used / mem.total
        util = self._read(i, "utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            m["gpu/utilization_pct" + sfx] = float(util.gpu)
            m["gpu/memory_util_pct" + sfx] = float(util.memory)  # memory bandwidth busy, not capacity
        temp = self._read(i, "temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        if temp is not None:
            m["gpu/temperature_c" + sfx] = float(temp)
        power = self._read(i, "power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            m["gpu/power_w" + sfx] = power / 1000.0  # NVML reports milliwatts
        clock = self._read(i, "sm_clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        if clock is not None:
            m["gpu/sm_clock_mhz" + sfx] = float(clock)
        reasons = self._read(i, "throttle", lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        if reasons is not None:
            thermal = (getattr(nv, "nvmlClocksThrottleReasonHwSlowdown", 0x8)
                       | getattr(nv, "nvmlClocksThrottleReasonSwThermalSlowdown", 0x20)
                       | getattr(nv, "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40)
                       | getattr(nv, "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0x80))
            m["gpu/hw_slowdown" + sfx] = 1.0 if int(reasons) & thermal else 0.0
        for name, kind in (("ecc_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
                           ("ecc_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED")):
            v = self._read(i, name, functools.partial(nv.nvmlDeviceGetTotalEccErrors, h, getattr(nv, kind),
                                                      nv.NVML_VOLATILE_ECC))
            if v is not None:
                m[f"gpu/{name}{sfx}"] = float(v)
        for name, cause in (("retired_pages_sbe", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
                            ("retired_pages_dbe", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")):
            pages = self._read(i, name, functools.partial(nv.nvmlDeviceGetRetiredPages, h, getattr(nv, cause)))
            if pages is not None:
                m[f"gpu/{name}{sfx}"] = float(len(pages))
        pending = self._read(i, "retired_pages_pending", lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
        if pending is not None:
            m["gpu/retired_pages_pending" + sfx] = float(bool(pending))
        rows = self._read(i, "remapped_rows", lambda: nv.nvmlDeviceGetRemappedRows(h))  # Ampere and later
        if rows is not None:
            corrected, uncorrected, is_pending, failed = rows
            m["gpu/remapped_rows_corrected" + sfx] = float(corrected)
            m["gpu/remapped_rows_uncorrected" + sfx] = float(uncorrected)
            m["gpu/remapped_rows_pending" + sfx] = float(bool(is_pending))
            m["gpu/remapped_rows_failure" + sfx] = float(bool(failed))
        replay = self._read(i, "pcie_replay", lambda: nv.nvmlDeviceGetPcieReplayCounter(h))
        if replay is not None:
            m["gpu/pcie_replay_count" + sfx] = float(replay)
        self._collect_nvlink(i, h, m)
        if self._xid_set is not None:
            m["gpu/xid_errors" + sfx] = float(self._xid_count.get(i, 0))
            if i in self._last_xid:
                m["gpu/last_xid" + sfx] = float(self._last_xid[i])

    def _active_nvlinks(self, h: Any) -> list[int]:
        nv = self._nvml
        links = []
        enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) == enabled:
                    links.append(link)
            except Exception:
                continue  # no such link / no NVLink on this board
        return links

    def _collect_nvlink(self, i: int, h: Any, m: dict[str, float]) -> None:
        links = self._nvlinks.get(i)
        if not links:
            return
        nv = self._nvml
        counters = {"nvlink_crc_errors": ("NVML_NVLINK_ERROR_DL_CRC_FLIT", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
                    "nvlink_replay_errors": ("NVML_NVLINK_ERROR_DL_REPLAY",),
                    "nvlink_recovery_errors": ("NVML_NVLINK_ERROR_DL_RECOVERY",)}
        for name, kinds in counters.items():
            total, seen = 0, False
            for link in links:
                for kind in kinds:
                    v = self._read(i, f"{name}:{link}:{kind}",
                                   functools.partial(nv.nvmlDeviceGetNvLinkErrorCounter, h, link, getattr(nv, kind)))
                    if v is not None:
                        total += int(v)
                        seen = True
            if seen:
                m[f"gpu/{name}[{i}]"] = float(total)

    def _setup_xid_events(self) -> None:
        """Register for critical XID events (GPU faults NVML reports as events, not counters)."""
        nv = self._nvml
        try:
            event_set = nv.nvmlEventSetCreate()
        except Exception as exc:
            log.debug("NVML event sets unavailable, no XID counts: %s", exc)
            return
        registered = 0
        for i, h in enumerate(self._handles):
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except Exception as exc:
                log.debug("GPU %d: XID events unavailable: %s", i, exc)
        if registered:
            self._xid_set = event_set
        else:
            with contextlib.suppress(Exception):
                nv.nvmlEventSetFree(event_set)

    def _drain_xid_events(self, limit: int = 1000) -> None:
        if self._xid_set is None:
            return
        nv = self._nvml
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        for _ in range(limit):
            try:
                data = wait(self._xid_set, 0)
            except Exception:
                return  # NVML_ERROR_TIMEOUT: nothing pending (or the set broke: try again next sample)
            i = self._index_of(data.device)
            if i is None:
                continue
            self._xid_count[i] = self._xid_count.get(i, 0) + 1
            self._last_xid[i] = int(data.eventData)
            log.warning("GPU %d: XID %d", i, int(data.eventData))

    def _index_of(self, device: Any) -> int | None:
        for i, h in enumerate(self._handles):
            if h is device or h == device:
                return i
        try:
            return int(self._nvml.nvmlDeviceGetIndex(device))
        except Exception:
            return None


# ---------------------------------------------------------------------- command line


def _status_line(agent: NodeAgent, metrics: dict, first: bool = True) -> str:
    """One sample's line. ``sent`` counts every event handed to Kafka since the start; the ones the
    broker has not acknowledged yet are a part of it, not a backlog. No NVML is said on the first line."""
    s = agent.stats()
    if agent.nvml_error is None:
        gpus = f"{s['gpus']} GPU(s), "
    else:
        gpus = "no GPUs (NVML unavailable), host metrics only, " if first else ""
    lost = s["dropped"] + s["delivery_failed"]
    # librdkafka's queue length counts its own requests too: never more than the events in flight
    unacked = min(s["pending"], max(0, s["sent"] - lost))
    return (f"trainguard node {s['host']}: {gpus}sample {s['samples']} ({len(metrics)} metrics), "
            f"events sent {s['sent']} ({unacked} not yet acknowledged), lost {lost}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard node",
                                     description="Publish this machine's GPU and host metrics for a run.")
    parser.add_argument("--run-id", default=settings_mod.value("TRAINGUARD_RUN_ID"),
                        help="the run these resources serve (default: $TRAINGUARD_RUN_ID)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--once", action="store_true", help="take and publish one sample, print it, exit")
    parser.add_argument("--host", help="host name to report (default: this machine's)")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $TRAINGUARD_BOOTSTRAP or "
                                            f"{settings_mod.default('TRAINGUARD_BOOTSTRAP')})")
    parser.add_argument("--fold-ranks", action="store_true",
                        help="fold the steps this machine's RankLoggers (of this user) send to the rank socket "
                             "($TRAINGUARD_RANK_SOCKET, by default $XDG_RUNTIME_DIR/trainguard-ranks.sock or "
                             "/tmp/trainguard-ranks-<uid>.sock) into one event per run and step (producers/ranks.py)")
    parser.add_argument("--fold-wait", type=float, default=0.5,
                        help="seconds a step waits for its late ranks before it goes without them (default 0.5)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks to wait for at a run's first step (default: those that report within "
                             "--fold-wait; later steps wait for every rank seen)")
    return parser


def _start_folder(args, agent: NodeAgent):
    """The rank folder, sharing the agent's producer; None (said once) when it cannot bind."""
    from trainguard.producers.ranks import RankFolder

    try:
        folder = RankFolder(agent.settings, publisher=agent.publisher, max_wait_s=args.fold_wait,
                            ranks_per_node=args.ranks_per_node).start()
    except OSError as exc:
        log.error("node agent: no rank folding (ranks publish directly): cannot listen on the rank socket: %s", exc)
        return None
    log.info("node agent: folding the ranks' steps sent to %s", folder.path)
    return folder


def main(argv: list[str] | None = None) -> int:
    """``trainguard node [--run-id ID] [--interval S] [--once]``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.run_id:
        parser.error("give --run-id or set TRAINGUARD_RUN_ID")
    if args.interval <= 0:
        parser.error("--interval must be positive")
    if args.fold_wait <= 0 or (args.ranks_per_node is not None and args.ranks_per_node < 1):
        parser.error("--fold-wait and --ranks-per-node must be positive")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    agent = NodeAgent(settings, args.run_id, args.interval, host=args.host)

    if args.once:
        metrics = agent.publish_once()
        for name in sorted(metrics):
            print(f"{name:40s} {metrics[name]:.6g}")
        left = agent.publisher.flush(10.0)
        print(_status_line(agent, metrics))
        agent.close()
        if left or agent.publisher.delivery_failed or agent.publisher.dropped:
            print(f"trainguard node: the sample was not delivered to {settings.bootstrap}", file=sys.stderr)
            return 1
        return 0

    stop = threading.Event()
    tty = sys.stdout.isatty()

    shown = [False]

    def show(a: NodeAgent, metrics: dict) -> None:
        line = _status_line(a, metrics, first=not shown[0])
        if not shown[0] and a.nvml_error is not None and tty:
            line += "\n"  # said once, kept above the line that is rewritten in place
        shown[0] = True
        if tty:
            sys.stdout.write("\r\x1b[K" + line)
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()

    try:
        import signal

        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a daemon is stopped with SIGTERM
    except ValueError:
        pass  # not the main thread
    folder = _start_folder(args, agent) if args.fold_ranks else None
    try:
        agent.run(stop, on_sample=show)
    except KeyboardInterrupt:
        stop.set()
    finally:
        if tty:
            sys.stdout.write("\n")
        if folder is not None:
            folder.close()
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
