"""A real PyTorch run that diverges, and trainguard bringing it back.

A small MLP (8 -> 32 -> 32 -> 1, ReLU, SGD with momentum) learns a smooth regression
target on the CPU. From batch ``fault_at`` on, a run of ``fault_len`` poisoned batches
arrives (targets scaled by 1000, the kind of thing a broken shard does): the loss jumps
to ~1e6, the weights blow up, the loss goes to 1e36, then Inf, then NaN, and without help
the run never comes back.

With trainguard: the stream worker sees the loss spike (rule ``loss_spike`` in
``torch_divergence.rules.yaml``) and the NaN/Inf that follow, its circuit breaker trips
after 3 critical steps and sends a rollback to the newest checkpoint saved before the
onset; :class:`~trainguard.producers.integrations.torch_loop.Guard` restores the model
and the optimizer (momentum buffers included) from that file, the loop skips the rest
of the poisoned batches, reports ``rolled_back``, and training recovers.

Run it on its own (starts an embedded broker and a worker)::

    python examples/torch_divergence.py            # or --bootstrap HOST:PORT

The test ``tests/test_integrations_torch_example.py`` runs :func:`train` against a real
broker and a real worker process.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE / "torch_divergence.rules.yaml"
DIM, HIDDEN, BATCH = 8, 32, 128


class Problem:
    """The regression task: y = tanh(x A) b, batches drawn deterministically by index."""

    def __init__(self, seed: int = 1234, poison_scale: float = 1e3):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.A = torch.randn(DIM, 16, generator=g)
        self.b = torch.randn(16, 1, generator=g) / 4
        self.poison_scale = poison_scale
        self.seed = seed

    def batch(self, index: int, poisoned: bool = False):
        import torch

        g = torch.Generator().manual_seed(self.seed * 7 + index)
        x = torch.randn(BATCH, DIM, generator=g)
        y = torch.tanh(x @ self.A) @ self.b
        return x, (y * self.poison_scale if poisoned else y)


def make_model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer


def same_as_checkpoint(model, optimizer, path: str) -> bool:
    """Whether the model's and the optimizer's state equal the checkpoint folder's, exactly."""
    import torch

    saved = {part: torch.load(os.path.join(path, f"{part}.pt"), map_location="cpu", weights_only=True)
             for part in ("model", "optimizer")}
    model_ok = all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    opt_now, opt_saved = optimizer.state_dict()["state"], saved["optimizer"]["state"]
    opt_ok = opt_now.keys() == opt_saved.keys() and all(
        torch.equal(opt_now[i]["momentum_buffer"], opt_saved[i]["momentum_buffer"]) for i in opt_now)
    return model_ok and opt_ok


def train(settings, run_id: str, checkpoint_dir: str | os.PathLike, *, steps: int = 150, fault_at: int = 85,
          fault_len: int = 12, checkpoint_every: int = 10, step_seconds: float = 0.05, deadline_s: float = 120.0,
          say=print, guard=None) -> dict:
    """Train to ``steps`` optimizer steps with a poisoned run of batches; obey trainguard.

    Batches are drawn from a stream that only moves forward (a rollback restores the
    weights, not the data position), so the loop never sees a batch twice; the worker's
    ``skip_batches`` drops the rest of the poisoned run. Returns what happened.
    """
    import torch
    from torch.nn.functional import mse_loss

    from trainguard.producers.integrations.torch_loop import Guard

    problem = Problem()
    model, optimizer = make_model()
    guard = guard or Guard(run_id, model, optimizer, checkpoint_dir, settings, checkpoint_every=checkpoint_every,
                           ready_timeout_s=10)
    poisoned = range(fault_at, fault_at + fault_len)
    result = {"losses": [], "rollbacks": [], "poisoned_batches_trained": 0, "skipped": [], "stopped": False,
              "finished": False, "fault_at": fault_at, "fault_len": fault_len}
    step, data_index, started = 0, 0, time.monotonic()
    decision = None
    try:
        while step < steps:
            if time.monotonic() - started > deadline_s:
                say(f"example: deadline of {deadline_s}s reached at step {step}")
                break
            step += 1
            data_index += 1
            x, y = problem.batch(data_index, poisoned=data_index in poisoned)
            result["poisoned_batches_trained"] += data_index in poisoned
            loss = mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            optimizer.step()
            value = loss.item()
            result["losses"].append((step, data_index, value))
            guard.log({"train/loss": value, "train/grad_norm": grad_norm, "train/lr": optimizer.param_groups[0]["lr"]},
                      step)
            guard.maybe_checkpoint(step)
            if step % 10 == 0 or data_index in poisoned or not math.isfinite(value):
                say(f"step {step:4d}  batch {data_index:4d}  loss {value:.4g}"
                    + ("  (poisoned batch)" if data_index in poisoned else ""))
            decision = guard.step_boundary(step)
            if decision.stop:
                result["stopped"] = True
                say(f"example: stopped by trainguard at step {step}")
                break
            if decision.rolled_back:
                ok = same_as_checkpoint(model, optimizer, decision.checkpoint_path)
                result["rollbacks"].append({"at_step": step, "at_batch": data_index,
                                            "resume_step": decision.resume_step,
                                            "path": decision.checkpoint_path, "weights_match": ok,
                                            "skip_batches": decision.skip_batches})
                say(f"example: rolled back at step {step} to {decision.checkpoint_path} "
                    f"(step {decision.resume_step}; weights equal the checkpoint: {ok}); "
                    f"skipping {decision.skip_batches} batches")
                step = decision.resume_step
            if decision.skip_batches:
                result["skipped"].append((data_index + 1, data_index + decision.skip_batches))
                data_index += decision.skip_batches  # the stream moves on past them
            time.sleep(step_seconds)
        else:
            result["finished"] = True
    finally:
        guard.close("stopped" if result["stopped"] else "finished", step=step)
    result["steps"] = step
    result["checkpoints"] = [p for _, p in guard.saved]
    result["commands"] = guard.history
    return result


def summarize(result: dict) -> dict:
    """Pre-fault loss level, loss after recovery, and when the rollback came."""
    fault_at = result["fault_at"]
    before = [v for s, d, v in result["losses"] if fault_at - 10 <= d < fault_at]
    last = [v for s, d, v in result["losses"][-10:]]
    return {"pre_fault_loss": sum(before) / max(1, len(before)),
            "final_loss": sum(last) / max(1, len(last)) if last else math.nan,
            "peak_loss": max((v for _, _, v in result["losses"] if math.isfinite(v)), default=math.nan),
            "non_finite_steps": sum(1 for _, _, v in result["losses"] if not math.isfinite(v)),
            "rollbacks": len(result["rollbacks"]), "finished": result["finished"]}


def _wait_ready(log_path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "Ready" in log_path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise SystemExit(f"the worker exited with {proc.returncode}; see {log_path}")
        time.sleep(0.2)
    raise SystemExit(f"the worker was not ready within {timeout}s; see {log_path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="a running Kafka (default: start the embedded broker)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--fault-at", type=int, default=85)
    p.add_argument("--out", default="out/torch_divergence")
    args = p.parse_args(argv)

    from trainguard.broker import kafka_or_embedded, stop_process
    from trainguard.schemas.signing import ensure_key

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    broker = worker = None
    try:
        settings, broker = kafka_or_embedded(args.bootstrap, out / "broker.log")
        log_path = out / "worker.log"
        ensure_key("example")  # the worker signs, the guard's listener verifies
        env = {**os.environ, "TRAINGUARD_BOOTSTRAP": settings.bootstrap}
        worker = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "worker", "--rules", str(RULES),
                                   "--app-id", f"tg-example-{uuid.uuid4().hex[:6]}", "--loglevel", "info"],
                                  stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        print(f"example: broker {settings.bootstrap}; waiting for the worker ({log_path})", flush=True)
        _wait_ready(log_path, worker)
        run_id = f"torch-divergence-{uuid.uuid4().hex[:6]}"
        result = train(settings, run_id, out / "checkpoints", steps=args.steps, fault_at=args.fault_at,
                       say=lambda s: print(s, flush=True))
        summary = summarize(result)
        print(f"example: {summary}", flush=True)
        return 0 if summary["rollbacks"] and summary["finished"] and summary["final_loss"] < summary["pre_fault_loss"] \
            else 1
    finally:
        stop_process(worker)
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    sys.exit(main())
