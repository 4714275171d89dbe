"""The plain-PyTorch Guard's command protocol without a broker: a scripted listener feeds
commands, a recording logger keeps what would be published. Covers rollback of real
model+optimizer state, failed and rejected commands, pause until resume or expiry,
checkpoint_now, stop, and that trainguard failures never raise into the loop."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from trainguard.producers.integrations.torch_loop import Guard


class ScriptedListener:
    def __init__(self):
        self.queue: list[list[dict]] = []   # one list per poll_all() call
        self.acks: list[tuple[str, str, str]] = []
        self.results: list = []

    def poll_all(self):
        return self.queue.pop(0) if self.queue else []

    def ack(self, command, status, detail="", step=None, result=None):
        self.acks.append((command["id"], status, detail))
        self.results.append(result)

    def time_left(self, command):
        return command["expires"] - time.time()

    def wait_ready(self, timeout=0):
        return True

    def close(self, timeout=0):
        pass


class RecordingLogger:
    def __init__(self):
        self.events: list[tuple] = []
        self.health: dict[int, tuple] = {}   # step -> (healthy, why) of each checkpoint reported with a verdict
        self.ended = None

    def log(self, metrics, step, tags=None):
        self.events.append(("metrics", step, dict(metrics)))
        return True

    def checkpoint_saved(self, step, path, healthy=None, why=None):
        self.events.append(("checkpoint", step, path))
        if healthy is not None:
            self.health[step] = (healthy, why)
        return True

    def lifecycle(self, what, step=None, detail=None):
        self.events.append(("lifecycle", what, step))
        if what in ("finished", "stopped"):
            self.ended = what
        return True

    def close(self, timeout=0, end=None):
        return {}


def cmd(action, id=None, target=None, expires_in=60.0, **extra):
    now = time.time()
    return {"id": id or action, "run_id": "r", "action": action, "target": target, "reason": [],
            "issued": now, "expires": now + expires_in, **extra}


@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    listener, logger = ScriptedListener(), RecordingLogger()
    guard = Guard("r", model, opt, tmp_path, checkpoint_every=5, logger=logger, listener=listener,
                  poll_interval_s=0.01)
    return guard, model, opt, listener, logger


def train_step(model, opt):
    loss = model(torch.ones(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_rollback_restores_model_and_optimizer_and_reports(setup, tmp_path):
    guard, model, opt, listener, logger = setup
    for step in range(1, 6):
        guard.log({"train/loss": train_step(model, opt)}, step)
        guard.maybe_checkpoint(step)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    for _ in range(3):
        train_step(model, opt)
    assert not torch.equal(model.weight, saved["weight"])
    listener.queue = [[cmd("rollback", target={"step": 5, "path": str(tmp_path / "checkpoint-5")},
                           skip_batches=4)]]
    d = guard.step_boundary(8)
    assert d.rolled_back and d.resume_step == 5 and d.skip_batches == 4 and not d.stop
    assert torch.equal(model.weight, saved["weight"]) and torch.equal(model.bias, saved["bias"])
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert listener.acks[0][1] == "applied" and "skipping 4 batches" in listener.acks[0][2]
    assert ("lifecycle", "rolled_back", 5) in logger.events
    assert ("checkpoint", 5, str(tmp_path / "checkpoint-5")) in logger.events


def test_failures_are_acked_never_raised(setup, tmp_path):
    guard, model, opt, listener, logger = setup
    listener.queue = [[cmd("rollback", id="a", target={"step": 3, "path": str(tmp_path / "missing.pt")}),
                       cmd("rollback", id="b", target=None), cmd("resume", id="c")]]
    d = guard.step_boundary(4)
    assert not d.rolled_back and d.errors
    assert [(i, s) for i, s, _ in listener.acks] == [("a", "failed"), ("b", "rejected"), ("c", "applied")]
    assert f"no checkpoint at {tmp_path / 'missing.pt'}" in listener.acks[0][2]
    assert not any(e[:2] == ("lifecycle", "rolled_back") for e in logger.events)
    # A broken listener or publisher does not stop the loop either.
    listener.poll_all = lambda: 1 / 0
    assert not guard.step_boundary(5).acted and guard.failures == 1
    guard.checkpoint_dir = tmp_path / "file-not-dir.pt"
    (tmp_path / "file-not-dir.pt").write_text("x")
    assert guard.save_checkpoint(10) is None and guard.failures == 2


def test_adjust_scales_the_learning_rate_and_refuses_what_it_cannot_apply(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
    listener = ScriptedListener()
    guard = Guard("r", model, opt, tmp_path, scheduler=scheduler, logger=RecordingLogger(), listener=listener)
    assert guard.can() == ["adjust"], "no rerun unless asked for"
    listener.queue = [[cmd("adjust", id="a", params={"lr_scale": 0.5}),
                       cmd("adjust", id="b", params={"lr_scale": 0.5, "kl_coef_scale": 2.0})]]
    d = guard.step_boundary(3)
    assert [(i, s) for i, s, _ in listener.acks] == [("a", "applied"), ("b", "rejected")]
    assert "kl_coef_scale" in listener.acks[1][2] and "nothing was changed" in listener.acks[1][2]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05), "applied once: the refused one changed nothing"
    scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05), "the schedule goes on from the scaled rate"
    assert d.extra["adjusted"] == {"lr_scale": 0.5}


def _rerun_guard(tmp_path, flaky_at=None, poison_at=None, returns=lambda loss: loss):
    """A real model trained through run_step; ``flaky_at``: that step's first run turns NaN (a
    transient fault); ``poison_at``: that step's batch always does (numeric); ``returns``: what
    the train step returns, made of its loss."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    listener = ScriptedListener()
    guard = Guard("r", model, opt, tmp_path, logger=RecordingLogger(), listener=listener, rerun=True)
    runs = {}

    def step_fn(batch):
        step, x = batch
        runs[step] = runs.get(step, 0) + 1
        x = x * torch.randn(1).abs()  # the RNG matters: a rerun must draw the same
        if step == poison_at or (step == flaky_at and runs[step] == 1):
            x = x * float("inf")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
        return returns(loss)

    losses = {}
    for step in range(1, 8):
        guard.run_step(step, (step, torch.ones(8, 4)), step_fn)
        guard.log({"train/loss": losses[step]}, step)
    return guard, model, opt, listener


@pytest.mark.parametrize("fault, reproduced", [("flaky_at", False), ("poison_at", True), (None, True)])
def test_a_rerun_repeats_the_kept_step_and_puts_the_run_back(tmp_path, fault, reproduced):
    guard, model, opt, listener = _rerun_guard(tmp_path, **({fault: 5} if fault else {}))
    assert guard.can() == ["adjust", "rerun_step"]
    weights = model.weight.detach().clone()
    rng = torch.get_rng_state()
    want = 5 if fault else 7  # the first of the non-finite steps, else the last step
    listener.queue = [[cmd("rerun_step", params={"step": want})]]
    guard.step_boundary(7)
    assert listener.acks[0][1] == "applied", listener.acks
    result = listener.results[0]
    assert result["reproduced"] is reproduced and result["step"] == want
    assert ("not reproduced (transient: hardware)" if not reproduced else "reproduced (numeric)") in listener.acks[0][2]
    assert torch.equal(model.weight, weights) or not torch.isfinite(weights).all(), "the run is where it was"
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("returns", [lambda loss: None, lambda loss: {"loss": loss}, lambda loss: "done",
                                     lambda loss: loss.expand(3)], ids=["none", "dict", "str", "tensor-of-3"])
@pytest.mark.parametrize("fault, reproduced", [("flaky_at", False), (None, True)])
def test_a_train_step_that_returns_no_loss_is_rerun_on_its_gradients_and_weights(tmp_path, returns, fault,
                                                                                  reproduced):
    # No loss to compare is not a NaN loss: the kept step is the faulty one (5), else the last.
    guard, model, opt, listener = _rerun_guard(tmp_path, **({fault: 5} if fault else {}), returns=returns)
    want = 5 if fault else 7
    listener.queue = [[cmd("rerun_step", params={"step": want})]]
    guard.step_boundary(7)
    assert listener.acks[0][1] == "applied", listener.acks
    result = listener.results[0]
    assert result["reproduced"] is reproduced and result["step"] == want, result
    assert "loss" not in result["first"] and "grad norm" in result["first"], result


def test_a_rerun_of_a_step_that_is_not_kept_is_refused(setup, tmp_path):
    guard, model, opt, listener, logger = setup
    listener.queue = [[cmd("rerun_step", id="a", params={"step": 3})]]
    guard.step_boundary(3)
    assert listener.acks[0][1] == "rejected" and "no step kept for a rerun" in listener.acks[0][2]
    guard, model, opt, listener = _rerun_guard(tmp_path)
    listener.queue = [[cmd("rerun_step", id="b", params={"step": 2})]]
    guard.step_boundary(7)
    assert listener.acks[0][1] == "rejected" and "the kept step is 7" in listener.acks[0][2]


def test_no_checkpoint_after_a_non_finite_step(setup, tmp_path):
    guard, model, opt, listener, logger = setup
    guard.log({"train/loss": float("nan")}, 5)
    assert guard.maybe_checkpoint(5) is None
    guard.log({"train/loss": torch.tensor(0.3)}, 10)
    assert guard.maybe_checkpoint(10) == str(tmp_path / "checkpoint-10")


def test_pause_waits_for_resume_and_applies_commands_meanwhile(setup):
    guard, model, opt, listener, logger = setup
    listener.queue = [[cmd("pause", id="p")], [], [cmd("checkpoint_now", id="k")], [], [cmd("resume", id="r")]]
    d = guard.step_boundary(7)
    assert [(i, s) for i, s, _ in listener.acks] == [("p", "applied"), ("k", "applied"), ("r", "applied")]
    assert d.checkpoint_now and d.extra["saved"].endswith("checkpoint-7") and not d.stop
    whats = [e[1] for e in logger.events if e[0] == "lifecycle"]
    assert whats[-2:] == ["paused", "resumed"]


def test_pause_ends_at_expiry_and_stop_ends_a_pause(setup):
    guard, model, opt, listener, logger = setup
    listener.queue = [[cmd("pause", id="p", expires_in=0.3)]]
    started = time.monotonic()
    d = guard.step_boundary(3)
    assert 0.25 < time.monotonic() - started < 3 and not d.stop
    guard.max_pause_s = 0.2  # and never longer than max_pause_s, whatever the command says
    listener.queue = [[cmd("pause", id="p2", expires_in=3600)]]
    started = time.monotonic()
    guard.step_boundary(4)
    assert time.monotonic() - started < 2
    listener.queue = [[cmd("pause", id="p3")], [cmd("stop", id="s"), cmd("resume", id="r")]]
    d = guard.step_boundary(5)
    assert d.stop and listener.acks[-2:][0][:2] == ("s", "applied") and listener.acks[-1][:2] == ("r", "rejected")
    assert ("lifecycle", "stopped", 5) in logger.events


def test_importing_the_integrations_package_does_not_import_torch():
    code = ("import sys, trainguard.producers, trainguard.producers.integrations as m; "
            "from trainguard.producers.integrations import Decision, GuardBase; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("beta", [0.04, None])
def test_the_hf_callback_adjusts_the_lr_and_trls_beta_where_there_is_one(beta):
    from types import SimpleNamespace

    from trainguard.producers.integrations.hf import TrainguardCallback

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    listener = ScriptedListener()
    trainer = SimpleNamespace(beta=beta) if beta is not None else SimpleNamespace()
    cb = TrainguardCallback("r", rl=True, trainer=trainer, logger=RecordingLogger(), listener=listener)
    state, control = SimpleNamespace(is_world_process_zero=True, global_step=7), SimpleNamespace()
    cb.on_train_begin(None, state, control)
    assert cb.guard.can() == (["adjust"])
    listener.queue = [[cmd("adjust", id="a", params={"lr_scale": 0.5, "kl_coef_scale": 2.0})]]
    cb.on_step_end(None, state, control, model=model, optimizer=opt, lr_scheduler=scheduler)
    if beta is None:
        assert listener.acks[0][1] == "rejected" and "cannot apply kl_coef_scale" in listener.acks[0][2]
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-4), "all or nothing"
    else:
        assert listener.acks[0][1] == "applied", listener.acks
        assert trainer.beta == pytest.approx(0.08) and opt.param_groups[0]["lr"] == pytest.approx(5e-5)
        scheduler.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(5e-5), "the schedule keeps the scaled rate"


def test_the_verl_backend_scales_the_in_reward_kl_coefficient_and_refuses_the_lr():
    from types import SimpleNamespace

    from verl.trainer.ppo.core_algos import AdaptiveKLController

    from trainguard.producers.integrations.verl import VerlBackend

    ctrl = AdaptiveKLController(init_kl_coef=0.02, target_kl=0.1, horizon=10000)
    listener = ScriptedListener()
    backend = VerlBackend("r", trainer=SimpleNamespace(kl_ctrl_in_reward=ctrl, total_training_steps=100),
                          logger=RecordingLogger(), listener=listener)
    assert backend.can() == ["adjust"]
    listener.queue = [[cmd("adjust", id="a", params={"kl_coef_scale": 2.0}),
                       cmd("adjust", id="b", params={"lr_scale": 0.5}), cmd("rerun_step", id="c")]]
    backend.log({"actor/pg_loss": 0.1}, 5)
    assert [(i, s) for i, s, _ in listener.acks] == [("a", "applied"), ("b", "rejected"), ("c", "rejected")]
    assert ctrl.value == pytest.approx(0.04) and "cannot apply lr_scale" in listener.acks[1][2]
    assert VerlBackend("r2", trainer=SimpleNamespace(), logger=RecordingLogger(), listener=listener).can() == []


# ------------------------------------------------------------------ checkpoints and their manifest


def _saved_guard(tmp_path, **kw):
    """A real model and optimizer (momentum) with a scheduler and a data position, checkpointed at
    steps 5 and 10 through the Guard's loop."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    listener, logger = ScriptedListener(), RecordingLogger()
    data = {"position": 0}
    guard = Guard("r", model, opt, tmp_path / "ckpt", checkpoint_every=5, scheduler=sched, logger=logger,
                  listener=listener, state_fn=lambda: {"position": data["position"]},
                  load_state_fn=lambda extra: data.update(extra), **kw)
    for step in range(1, 11):
        data["position"] += 1
        guard.log({"train/loss": train_step(model, opt)}, step)
        sched.step()
        guard.maybe_checkpoint(step)
        guard.step_boundary(step)
    return guard, model, opt, sched, listener, data


def test_a_checkpoint_is_a_folder_whose_manifest_checks_out(tmp_path):
    from trainguard.producers.guards.checkpoint import MANIFEST, check_checkpoint

    guard, model, opt, sched, listener, data = _saved_guard(tmp_path)
    folder = tmp_path / "ckpt" / "checkpoint-10"
    assert guard.saved[-1] == (10, str(folder))
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["model.pt", "optimizer.pt", "scheduler.pt", "rng.pt", "extra.pt", MANIFEST])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint-10", "checkpoint-5"], \
        "no temporary folder is left behind"
    m = check_checkpoint(folder)
    assert m.meta["step"] == 10 and m.meta["scheduler_step"] == 10 == sched.last_epoch
    assert m.meta["rng_seeds"]["torch"] == torch.initial_seed()
    assert m.meta["dataset_offset"] == 10 and m.meta["dataset_offset_from"] == "guard"
    assert set(m.data["parts"]) == {"parameters", "optimizer", "scheduler", "rng", "extra"}
    saved = torch.load(folder / "model.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_keep_prunes_whole_checkpoint_folders(tmp_path):
    guard, *_ = _saved_guard(tmp_path, keep=1)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["checkpoint-10"]
    assert [s for s, _ in guard.saved] == [10]


def _truncate(folder):
    path = folder / "model.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "parameters corrupted: model.pt has"


def _edit(folder):
    path = folder / "optimizer.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte changed
    path.write_bytes(bytes(raw))
    return "optimizer state corrupted: optimizer.pt does not match its SHA-256 in the manifest"


def _remove(folder):
    (folder / "rng.pt").unlink()
    return "RNG state missing: rng.pt is not in"


def _edit_manifest(folder):
    import json

    from trainguard.producers.guards.checkpoint import MANIFEST

    data = json.loads((folder / MANIFEST).read_text())
    data["meta"]["step"] = 7
    (folder / MANIFEST).write_text(json.dumps(data))
    return "checkpoint manifest corrupted"


@pytest.mark.parametrize("damage", [_truncate, _edit, _remove, _edit_manifest])
def test_a_damaged_checkpoint_is_refused_before_loading_and_the_previous_one_loads(tmp_path, damage):
    guard, model, opt, sched, listener, data = _saved_guard(tmp_path)
    five, ten = tmp_path / "ckpt" / "checkpoint-5", tmp_path / "ckpt" / "checkpoint-10"
    want = damage(ten)
    before = model.weight.detach().clone()
    listener.queue = [[cmd("rollback", id="a", target={"step": 10, "path": str(ten)})],
                      [cmd("rollback", id="b", target={"step": 5, "path": str(five)})]]
    d = guard.step_boundary(11)
    assert listener.acks[0][1] == "failed" and want in listener.acks[0][2], listener.acks
    assert str(ten) in listener.acks[0][2] and not d.rolled_back
    assert torch.equal(model.weight, before), "nothing of the refused checkpoint was loaded"
    d = guard.step_boundary(12)
    assert listener.acks[1][1] == "applied" and d.rolled_back and d.resume_step == 5
    saved = torch.load(five / "model.pt", weights_only=True)
    assert torch.equal(model.weight, saved["weight"]) and sched.last_epoch == 5 and data["position"] == 5


def test_a_save_that_fails_midway_leaves_no_checkpoint_that_looks_whole(tmp_path):
    guard, model, opt, sched, listener, data = _saved_guard(tmp_path)
    good = (tmp_path / "ckpt" / "checkpoint-10" / "model.pt").read_bytes()
    guard.state_fn = lambda: {"position": lambda: 0}  # cannot be saved: fails after model and optimizer
    assert guard.save_checkpoint(15) is None and guard.save_checkpoint(10) is None and guard.failures == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint-10", "checkpoint-5"]
    assert (tmp_path / "ckpt" / "checkpoint-10" / "model.pt").read_bytes() == good, "the earlier save stays"
    assert [s for s, _ in guard.saved] == [5, 10]


def test_resume_passes_over_what_only_looks_like_a_checkpoint_folder(tmp_path, caplog):
    guard, model, opt, sched, listener, data = _saved_guard(tmp_path)
    ckpt = tmp_path / "ckpt"
    (ckpt / "checkpoint-\u00b2").mkdir()                    # a digit to str.isdigit, not to int()
    (ckpt / "checkpoint-99999999999999999999").mkdir()   # newer than any, and empty
    (ckpt / "checkpoint-12").write_text("a file where a folder is expected")
    with caplog.at_level("WARNING"):
        state = guard.resume()
    assert state["step"] == 10
    assert "checkpoint-99999999999999999999 refused: checkpoint manifest missing" in caplog.text


def test_a_single_file_checkpoint_of_an_earlier_release_loads_unverified_with_a_warning(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt)
    (tmp_path / "ckpt").mkdir()
    old = tmp_path / "ckpt" / "checkpoint-3.pt"  # as the earlier release wrote it
    torch.save({"step": 3, "model": model.state_dict(), "optimizer": opt.state_dict(), "saved_at": 0.0}, old)
    saved = model.weight.detach().clone()
    train_step(model, opt)
    listener = ScriptedListener()
    guard = Guard("r", model, opt, tmp_path / "ckpt", logger=RecordingLogger(), listener=listener)
    listener.queue = [[cmd("rollback", target={"step": 3, "path": str(old)})]]
    with caplog.at_level("WARNING", logger="trainguard.integrations"):
        d = guard.step_boundary(4)
    assert listener.acks[0][1] == "applied" and d.resume_step == 3 and torch.equal(model.weight, saved)
    assert "single-file checkpoint with no manifest" in caplog.text and "loaded unverified" in caplog.text
    train_step(model, opt)
    assert guard.resume()["step"] == 3 and torch.equal(model.weight, saved), "resumed from it: no folder passes"


def test_resume_loads_the_newest_checkpoint_that_checks_out(tmp_path, caplog):
    from trainguard.producers.guards.checkpoint import CheckpointError

    guard, model, opt, sched, listener, data = _saved_guard(tmp_path)
    _truncate(tmp_path / "ckpt" / "checkpoint-10")
    torch.manual_seed(0)
    model2 = torch.nn.Linear(4, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    logger = RecordingLogger()
    fresh = Guard("r", model2, opt2, tmp_path / "ckpt", logger=logger, listener=ScriptedListener())
    with caplog.at_level("WARNING"):
        state = fresh.resume()
    assert state["step"] == 5 and state["meta"]["dataset_offset"] == 5
    assert "checkpoint-10 refused: parameters corrupted" in caplog.text
    saved = torch.load(tmp_path / "ckpt" / "checkpoint-5" / "model.pt", weights_only=True)
    assert torch.equal(model2.weight, saved["weight"])
    assert ("checkpoint", 5, str(tmp_path / "ckpt" / "checkpoint-5")) in logger.events, "a rollback may go there"
    with pytest.raises(CheckpointError, match="parameters corrupted: model.pt has"):
        fresh.resume(tmp_path / "ckpt" / "checkpoint-10")
    _remove(tmp_path / "ckpt" / "checkpoint-5")
    with pytest.raises(CheckpointError, match="no checkpoint passes its manifest check: .*checkpoint-10: .*"
                                              "checkpoint-5: RNG state missing"):
        fresh.resume()
    assert Guard("r", model2, opt2, tmp_path / "empty", logger=RecordingLogger(),
                 listener=ScriptedListener()).resume() is None


def test_a_nan_only_in_the_gradients_that_a_rerun_does_not_repeat_is_hardware(tmp_path):
    """The first run of step 5 has its backward poisoned once (a hook turns one gradient NaN): its
    loss is finite, its weights after the update are not. The rerun's backward is clean: not the
    same step, whatever the loss says."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    listener = ScriptedListener()
    guard = Guard("r", model, opt, tmp_path, logger=RecordingLogger(), listener=listener, rerun=True)
    poison = {"left": 0}

    def hook(grad):
        if poison["left"]:
            poison["left"] -= 1
            return grad * float("nan")
        return grad

    model[0].weight.register_hook(hook)

    def step_fn(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    losses = []
    for step in range(1, 8):
        poison["left"] = 1 if step == 5 else 0
        losses.append(guard.run_step(step, torch.ones(8, 4) * step / 7, step_fn).item())
    assert torch.isfinite(torch.tensor(losses[4])) and not torch.isfinite(torch.tensor(losses[5])), losses
    listener.queue = [[cmd("rerun_step", params={"step": 5})]]
    guard.step_boundary(7)
    status, detail = listener.acks[0][1:]
    result = listener.results[0]
    assert status == "applied" and result["reproduced"] is False and result["step"] == 5, (detail, result)
    assert "not reproduced (transient: hardware)" in detail and "grad norm nan then" in detail, detail
    assert result["first"].startswith(f"loss {losses[4]:.6g}") and "grad norm nan" in result["first"]
    assert "nan" not in result["again"], result


def test_the_guards_rotation_keeps_the_newest_healthy_checkpoint_until_a_newer_healthy_one(setup, tmp_path, caplog):
    """keep=1: checkpoints saved on NaN weights are called suspect (in the manifest and the event),
    and the rotation keeps checkpoint-10, the last healthy one, which a rollback then restores; the
    first healthy checkpoint after it releases it."""
    import logging

    from trainguard.producers.guards.checkpoint import check_checkpoint

    guard, model, opt, listener, logger = setup
    guard.keep = 1
    caplog.set_level(logging.INFO, logger="trainguard.integrations")
    good = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (5, 10):
        guard.log({"loss": 0.5}, step)
        guard.save_checkpoint(step)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    for step in (15, 20):
        guard.save_checkpoint(step)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == \
        ["checkpoint-10", "checkpoint-20"]
    assert logger.health[10] == (True, "finite parameters and finite metrics since the checkpoint before")
    assert logger.health[20] == (False, "parameter weight holds NaN/Inf at step 20"), logger.health
    assert check_checkpoint(tmp_path / "checkpoint-20").health["healthy"] is False
    assert "checkpoint-10 kept out of the rotation (keep=1)" in caplog.text
    assert "checkpoint-10, the newest certified-healthy checkpoint, is kept out of the rotation" in caplog.text

    listener.queue = [[cmd("rollback", target={"step": 10, "path": str(tmp_path / "checkpoint-10")})]]
    assert guard.step_boundary(21).rolled_back
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.items())
    guard.log({"loss": float("nan")}, 22)  # a NaN logged since: the next checkpoint is suspect
    guard.save_checkpoint(25)
    assert logger.health[25] == (False, "step 22 logged a non-finite loss since the checkpoint before")
    guard.log({"loss": 0.4}, 29)
    guard.save_checkpoint(30)
    assert logger.health[30][0] is True
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-30"]
