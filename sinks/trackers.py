"""Alerts and commands where the run is watched: its TensorBoard, W&B and SwanLab.

Each writer is an optional sink (``build_sinks`` adds the ones the environment names) that puts
every firing and resolved alert, and every command, beside the run's own curves:

- TensorBoard (``TRAINGUARD_TENSORBOARD_DIR``): in the run's log folder, one more event file
  that TensorBoard shows with the trainer's: a text entry (``trainguard/alerts``,
  ``trainguard/commands``) and a scalar marker (``trainguard/alert/<rule>``: the severity's
  weight while firing, 0 when resolved; ``trainguard/command/<action>``: 1) at the alert's step.
- W&B (``TRAINGUARD_WANDB_PROJECT``): a companion run in the run's group (W&B takes one writer per
  run), ``wandb.alert`` for each firing alert (W&B's own e-mail / Slack notification) and a table,
  ``trainguard/events``, of its latest events; its charts' step axis is ``trainguard/step``,
  the training step.
- SwanLab (``TRAINGUARD_SWANLAB_PROJECT``): an experiment named after the run, text entries and
  the same scalar markers with ``trainguard/step``. SwanLab keeps one experiment open per
  process: an alert of another run finishes the open one.

The libraries are imported only when their sink is configured. Each event is written once (by
id and status), so a redelivered batch changes nothing. Anyone who can write to the alerts topic
chooses run ids: each becomes one safe path segment (``safe_segment``), and only the runs with
the latest alerts keep a writer open (TensorBoard, W&B); a later alert of another reopens one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

from trainguard.core.settings import value
from trainguard.schemas import events as ev
from trainguard.sinks.base import Sink, safe_segment
from trainguard.sinks.webhooks.messages import title_of

log = logging.getLogger("trainguard.sinks")

MAX_IDS = 50_000
MAX_ROWS = 1_000  # W&B's table of a run keeps its latest events (each log uploads the table whole)
MAX_RUNS = 10_000  # runs whose latest step is kept (a command's step)
MAX_WRITERS = 16  # TensorBoard writers open at once (each holds a thread and a file)
MAX_WANDB_RUNS = 8  # W&B companion runs open at once
WEIGHT = {"P0": 4.0, "P1": 3.0, "P2": 2.0, "P3": 1.0}  # the marker's height: worse is higher


def _step(v) -> int | None:
    """``v`` as a step a chart can place (an integer, or a float that is one), else None."""
    if type(v) is int:
        return v
    return int(v) if type(v) is float and v.is_integer() else None  # NaN and infinities are no integer


def _line(event: dict, step: int | None) -> str:
    """One line for a person: what happened, at which step."""
    at = f" at step {step}" if step is not None else ""
    if event.get("schema") == ev.COMMAND:
        target = event.get("target") or {}
        to = f" to step {target['step']}" if target.get("step") is not None else ""
        return f"command {event['action']}{to}{at}: {event.get('detail') or ''}".rstrip(": ")
    state = "resolved" if event.get("status") == "resolved" else event.get("severity", "")
    text = f"{state} {title_of(event)}{at}"
    for part in (event.get("diagnosis"), event.get("suggestion")):
        if part:
            text += f" — {part}"
    return text


class TrackerSink(Sink):
    """What the three writers share: alerts and commands only, each once, per run."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: OrderedDict[str, None] = OrderedDict()  # bounded: a sinks process runs for months
        self._last_step: OrderedDict[str, int] = OrderedDict()  # a command's step: the run's latest alert's

    def _order(self, batch: list[dict]) -> list[dict]:
        """The order events are written in (the batch's, unless a writer is cheaper another way)."""
        return batch

    def write(self, batch: list[dict]) -> None:
        for event in self._order(batch):
            kind = event.get("schema")
            if kind not in (ev.ALERT, ev.COMMAND) or not event.get("run_id"):
                continue
            key = f"{event.get('id')}:{event.get('status', '')}"
            if key in self._seen:
                continue
            try:
                self._write_one(kind, str(event["run_id"]), event)
            except Exception as exc:  # one event a writer cannot take never costs the rest of the batch
                self.failed += 1
                log.error("trainguard: %s could not write %s %s: %s: %s", self.name, kind,
                          str(event.get("id"))[:80], type(exc).__name__, exc)
            self._seen[key] = None
            if len(self._seen) > MAX_IDS:
                self._seen.popitem(last=False)

    def _write_one(self, kind: str, run: str, event: dict) -> None:
        if kind == ev.ALERT:
            step = _step(event.get("step"))
            if step is None:
                step = _step((event.get("onset") or {}).get("step"))
            if step is not None:
                self._last_step[run] = step
                self._last_step.move_to_end(run)
                if len(self._last_step) > MAX_RUNS:
                    self._last_step.popitem(last=False)
            self._alert(run, event, step)
        else:
            self._command(run, event, self._last_step.get(run, _step((event.get("target") or {}).get("step"))))

    def _alert(self, run: str, alert: dict, step: int | None) -> None:
        raise NotImplementedError

    def _command(self, run: str, command: dict, step: int | None) -> None:
        raise NotImplementedError


class TensorBoardSink(TrackerSink):
    name = "tensorboard"
    settings = ("TRAINGUARD_TENSORBOARD_DIR",)

    @classmethod
    def from_env(cls, env) -> "TensorBoardSink | None":
        folder = value("TRAINGUARD_TENSORBOARD_DIR", env)
        return cls(folder) if folder else None

    def __init__(self, folder: str):
        """``folder``: the run's log folder, ``{run_id}`` standing for the run (else ``folder/<run_id>``)."""
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise RuntimeError("TRAINGUARD_TENSORBOARD_DIR needs torch and tensorboard, or tensorboardX: "
                                   "pip install tensorboard") from None
        self._writer_cls = SummaryWriter
        self.folder = folder
        self._writers: OrderedDict = OrderedDict()  # the runs of the latest alerts; at most MAX_WRITERS

    def log_dir(self, run: str) -> str:
        """The run's folder: its id one safe segment in ``folder`` (never a path of its own)."""
        name = safe_segment(run)
        return self.folder.replace("{run_id}", name) if "{run_id}" in self.folder else str(Path(self.folder) / name)

    def _writer(self, run: str):
        if run in self._writers:
            self._writers.move_to_end(run)
        else:
            while len(self._writers) >= MAX_WRITERS:  # the least recent one's file is complete: closed
                self._writers.popitem(last=False)[1].close()
            self._writers[run] = self._writer_cls(log_dir=self.log_dir(run), filename_suffix=".trainguard")
        return self._writers[run]

    def _alert(self, run, alert, step):
        w = self._writer(run)
        firing = alert.get("status") != "resolved"
        w.add_scalar(f"trainguard/alert/{alert['rule']}", WEIGHT.get(alert.get("severity"), 1.0) if firing else 0.0,
                     global_step=step)
        w.add_text("trainguard/alerts", _line(alert, step), global_step=step)
        w.flush()

    def _command(self, run, command, step):
        w = self._writer(run)
        w.add_scalar(f"trainguard/command/{command['action']}", 1.0, global_step=step)
        w.add_text("trainguard/commands", _line(command, step), global_step=step)
        w.flush()

    def close(self, timeout: float = 5.0) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()


COLUMNS = ["step", "kind", "name", "severity", "status", "text"]


class WandbSink(TrackerSink):
    name = "wandb"
    settings = ("TRAINGUARD_WANDB_PROJECT", "TRAINGUARD_WANDB_ENTITY", "TRAINGUARD_WANDB_DIR")

    @classmethod
    def from_env(cls, env) -> "WandbSink | None":
        project, entity = value("TRAINGUARD_WANDB_PROJECT", env), value("TRAINGUARD_WANDB_ENTITY", env)
        folder = value("TRAINGUARD_WANDB_DIR", env)
        return cls(project, entity=entity, folder=folder) if project else None

    def __init__(self, project: str, entity: str | None = None, folder: str | None = None):
        super().__init__()
        import wandb

        self._wandb = wandb
        self.project, self.entity, self.folder = project, entity, folder
        self._runs: OrderedDict = OrderedDict()  # the runs of the latest alerts; at most MAX_WANDB_RUNS
        self._rows: dict[str, list[list]] = {}

    def _run(self, run: str):
        if run in self._runs:
            self._runs.move_to_end(run)
        else:
            while len(self._runs) >= MAX_WANDB_RUNS:  # finished; a later alert of it opens another
                old, r = self._runs.popitem(last=False)
                self._rows.pop(old, None)
                r.finish()
            r = self._wandb.init(project=self.project, entity=self.entity, dir=self.folder, group=run,
                                 name=f"{run} trainguard", job_type="trainguard", reinit="create_new",
                                 config={"trainguard_run_id": run})
            r.define_metric("trainguard/step")
            r.define_metric("trainguard/*", step_metric="trainguard/step")
            self._runs[run] = r
            self._rows[run] = []
        return self._runs[run]

    def _log(self, run, row, markers, step):
        r = self._run(run)
        self._rows[run].append(row)
        del self._rows[run][:-MAX_ROWS]
        r.log({"trainguard/events": self._wandb.Table(columns=COLUMNS, data=list(self._rows[run])),
               "trainguard/step": -1 if step is None else step, **markers})

    def _alert(self, run, alert, step):
        firing = alert.get("status") != "resolved"
        text = _line(alert, step)
        if firing:
            level = self._wandb.AlertLevel.ERROR if alert.get("severity") in ("P0", "P1") \
                else self._wandb.AlertLevel.WARN
            self._run(run).alert(title=f"{run}: {title_of(alert)}", text=text, level=level, wait_duration=0)
        self._log(run, [step, "alert", alert["rule"], alert.get("severity", ""), alert.get("status", ""), text],
                  {f"trainguard/alert/{alert['rule']}": WEIGHT.get(alert.get("severity"), 1.0) if firing else 0.0},
                  step)

    def _command(self, run, command, step):
        self._log(run, [step, "command", command["action"], "", "", _line(command, step)],
                  {f"trainguard/command/{command['action']}": 1.0}, step)

    def close(self, timeout: float = 5.0) -> None:
        for r in self._runs.values():
            r.finish()
        self._runs.clear()
        self._rows.clear()


class SwanLabSink(TrackerSink):
    name = "swanlab"
    settings = ("TRAINGUARD_SWANLAB_PROJECT", "TRAINGUARD_SWANLAB_DIR")

    @classmethod
    def from_env(cls, env) -> "SwanLabSink | None":
        project, folder = value("TRAINGUARD_SWANLAB_PROJECT", env), value("TRAINGUARD_SWANLAB_DIR", env)
        return cls(project, folder=folder) if project else None

    def __init__(self, project: str, folder: str | None = None):
        super().__init__()
        import swanlab

        self._swanlab = swanlab
        self.project, self.folder = project, folder
        self._open: str | None = None

    def _order(self, batch: list[dict]) -> list[dict]:
        """Each run's events together, the open experiment's first: a batch that alternates
        between runs finishes and opens each experiment once, not at every alternation."""
        runs: dict[str, list[dict]] = {"" if self._open is None else self._open: []}
        for event in batch:
            runs.setdefault(str(event.get("run_id") or ""), []).append(event)
        return [event for events in runs.values() for event in events]

    def _experiment(self, run: str):
        if self._open != run:
            if self._open is not None:
                self._swanlab.finish()
            self._swanlab.init(project=self.project, experiment_name=f"{run} trainguard", logdir=self.folder,
                               config={"trainguard_run_id": run})
            self._open = run
        return self._swanlab

    def _alert(self, run, alert, step):
        firing = alert.get("status") != "resolved"
        self._experiment(run).log({
            "trainguard/step": -1 if step is None else step,
            f"trainguard/alert/{alert['rule']}": WEIGHT.get(alert.get("severity"), 1.0) if firing else 0.0,
            "trainguard/alerts": self._swanlab.Text(_line(alert, step))})

    def _command(self, run, command, step):
        self._experiment(run).log({
            "trainguard/step": -1 if step is None else step, f"trainguard/command/{command['action']}": 1.0,
            "trainguard/commands": self._swanlab.Text(_line(command, step))})

    def close(self, timeout: float = 5.0) -> None:
        if self._open is not None:
            self._swanlab.finish()
            self._open = None
