"""The trainer-side guards on real parts: real threads that hang, real text, real files."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.guards_text import edit, jaccard, prompts
from trainguard.producers.guards import (
    BreakerOpen,
    CheckpointError,
    CircuitBreaker,
    PromptDeduplicator,
    RewardGate,
    RolloutValidator,
    ScoreCache,
    check_checkpoint,
    newest_verified,
    verl_compute_score,
    write_manifest,
)
from trainguard.producers.guards.checkpoint import MANIFEST, _checksum

# ------------------------------------------------------------------------------ breaker


class Flaky:
    """A component that hangs (until released) while ``hang`` is set, and counts its calls."""

    def __init__(self):
        self.hang = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        if self.hang.is_set():
            self.release.wait(60)
        return x * 2


@pytest.fixture
def flaky():
    f = Flaky()
    yield f
    f.release.set()  # let the abandoned threads finish


def test_breaker_opens_after_the_threshold_of_timeouts_and_answers_at_once_while_open(flaky):
    breaker = CircuitBreaker(flaky, name="rm", timeout_s=0.2, failure_threshold=3, fallback=-1.0, reset_after_s=60)
    assert breaker(2) == 4 and breaker.state == "closed"
    flaky.hang.set()
    for i in range(3):
        t0 = time.monotonic()
        assert breaker(1) == -1.0
        assert 0.15 < time.monotonic() - t0 < 1.0      # abandoned at the timeout, never waited on
        assert breaker.state == ("open" if i == 2 else "closed")
    calls = flaky.calls
    t0 = time.monotonic()
    assert [breaker(1) for _ in range(100)] == [-1.0] * 100
    assert time.monotonic() - t0 < 0.1 and flaky.calls == calls   # open: not called at all
    m = breaker.metrics()
    assert m["guard/breaker/rm/timeouts"] == 3 and m["guard/breaker/rm/short_circuited"] == 100
    assert m["guard/breaker/rm/state"] == 1.0 and m["guard/breaker/rm/opened"] == 1


def test_breaker_half_opens_after_reset_and_a_success_closes_it(flaky):
    breaker = CircuitBreaker(flaky, timeout_s=0.2, failure_threshold=2, fallback=lambda x: -x, reset_after_s=0.5)
    flaky.hang.set()
    assert breaker(3) == -3 and breaker(3) == -3 and breaker.state == "open"
    assert breaker(3) == -3                     # before reset_after_s: the fallback, no call
    time.sleep(0.6)
    assert breaker(3) == -3 and breaker.state == "open"   # the trial call hung: open again
    flaky.hang.clear()
    time.sleep(0.6)
    assert breaker(3) == 6 and breaker.state == "closed"  # the trial succeeded
    assert breaker.metrics()["guard/breaker/Flaky/closed"] == 1


def test_a_health_probe_in_the_background_lets_the_breaker_close(flaky):
    healthy = threading.Event()
    breaker = CircuitBreaker(flaky, timeout_s=0.2, failure_threshold=1, fallback=0, probe=healthy.is_set,
                             probe_interval_s=0.1, reset_after_s=0.0)
    flaky.hang.set()
    assert breaker(1) == 0 and breaker.state == "open"
    time.sleep(0.4)
    assert breaker(1) == 0 and breaker.state == "open"    # the probe says unhealthy: no trial call
    flaky.hang.clear()
    healthy.set()
    deadline = time.monotonic() + 3
    while breaker.state != "half_open" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert breaker.state == "half_open"
    assert breaker(5) == 10 and breaker.state == "closed"


def test_errors_count_as_failures_and_without_a_fallback_the_caller_is_told():
    def broken(x):
        raise ConnectionError("reward server refused the connection")

    breaker = CircuitBreaker(broken, failure_threshold=2, timeout_s=1)
    with pytest.raises(BreakerOpen, match="ConnectionError: reward server refused"):
        breaker(1)
    with pytest.raises(BreakerOpen):
        breaker(1)
    assert breaker.state == "open"
    # a caller's bug is not an outage: it propagates and counts nothing
    typed = CircuitBreaker(lambda x: x + 1, fallback=0, failure_types=(ConnectionError,))
    with pytest.raises(TypeError):
        typed("a")
    assert typed.consecutive_failures == 0


def test_abandoned_calls_are_bounded(flaky):
    breaker = CircuitBreaker(flaky, timeout_s=0.1, failure_threshold=100, fallback=None, max_abandoned=2)
    flaky.hang.set()
    for _ in range(2):
        with pytest.raises(BreakerOpen, match="timeout"):
            breaker(1)
    calls = flaky.calls
    with pytest.raises(BreakerOpen):
        breaker(1)
    assert flaky.calls == calls            # two hung threads already: not called again
    flaky.release.set()
    time.sleep(0.2)
    flaky.hang.clear()
    assert breaker(1) == 2                 # they returned: the component is called again


def test_a_hung_call_does_not_keep_the_training_process_alive(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import threading\n"
        "from trainguard.producers.guards import CircuitBreaker\n"
        "b = CircuitBreaker(lambda: threading.Event().wait(), timeout_s=0.2, fallback='fallback')\n"
        "print(b())\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "fallback", out.stderr
    assert time.monotonic() - t0 < 30


def test_score_cache_answers_with_scores_of_similar_prompts():
    cache = ScoreCache(size=1000)
    rng = random.Random(3)
    texts = prompts()[:300]
    for i, t in enumerate(texts):
        cache.add(t, float(i % 7))
    cache.add("a prompt whose scorer returned NaN", float("nan"))   # never answers for anyone
    hits = [cache.lookup(edit(t, rng)) == float(i % 7) for i, t in enumerate(texts[:100])]
    assert sum(hits) >= 95
    unseen = "Write a haiku about the migration of arctic terns over the Atlantic."
    assert cache.lookup(unseen) == pytest.approx(np.mean([i % 7 for i in range(300)]))
    assert ScoreCache(default=0.25).lookup(unseen) == 0.25


def test_verl_compute_score_falls_back_per_sample_and_keeps_verl_dict_scores():
    hang = threading.Event()
    release = threading.Event()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if hang.is_set():
            release.wait(30)
        return {"score": float(solution_str.strip() == ground_truth), "acc": True}

    guarded = verl_compute_score(compute_score, timeout_s=0.2, failure_threshold=2, reset_after_s=60)
    try:
        assert guarded("gsm8k", "42", "42", extra_info={}) == {"score": 1.0, "acc": True}
        assert guarded(data_source="gsm8k", solution_str="41", ground_truth="7") == {"score": 0.0, "acc": True}
        hang.set()
        assert guarded("gsm8k", "40", "42") == 1.0      # the problem scored 1.0 recently
        assert guarded("gsm8k", "x", "7") == 0.0
        assert guarded.breaker.state == "open"
        assert guarded.__name__ == "compute_score"
    finally:
        release.set()


# ------------------------------------------------------------------------------ rollouts


SCHEMA = {"type": "object", "required": ["answer", "reasoning"],
          "properties": {"answer": {"type": "number"}, "reasoning": {"type": "string", "minLength": 1}},
          "additionalProperties": False}


def test_rollout_gate_drops_bad_results_by_reason_on_real_text():
    texts = list(prompts()[:200])
    bad = {
        3: "",                                                       # an empty response
        7: "   \n",
        11: texts[11] + "\x00",                                      # NUL from a broken detokenizer
        19: b"caf\xe9 au lait".decode("utf-8", "surrogateescape"),   # half a character: a lone surrogate
        23: texts[23] + "\x1b[31m",                                  # terminal escapes
        31: " ".join([texts[31]] * 40),                              # far over the token limit
    }
    for i, t in bad.items():
        texts[i] = t
    gate = RolloutValidator(max_tokens=512, count_tokens=lambda t: len(t.split()))
    out = gate.filter(texts, step=4)
    assert {d.index: d.reason for d in out.dropped} == {3: "empty", 7: "empty", 11: "illegal_char",
                                                        19: "illegal_char", 23: "illegal_char", 31: "too_long"}
    assert out.kept == [t for i, t in enumerate(texts) if i not in bad]
    assert out.kept_indices == [i for i in range(200) if i not in bad]
    c = gate.counts
    assert (c["guard/rollout/checked"], c["guard/rollout/kept"], c["guard/rollout/dropped"]) == (200, 194, 6)
    assert c["guard/rollout/dropped/illegal_char"] == 3 and c["guard/rollout/dropped/empty"] == 2
    # token counts the trainer already has take precedence over counting again
    out = gate.filter(["short", "also short"], token_counts=[10, 600])
    assert [(d.index, d.reason, d.detail) for d in out.dropped] == [(1, "too_long", "600 tokens > 512")]
    with pytest.raises(ValueError, match="max_tokens needs token counts"):
        RolloutValidator().filter(["x"])


def test_structured_output_must_match_the_json_schema():
    gate = RolloutValidator(max_tokens=None, schema=SCHEMA)
    results = [
        json.dumps({"answer": 12, "reasoning": "3 boxes of 4 apples"}),
        '{"answer": 12, "reasoning": "3 boxes of 4',                  # cut at the length limit
        json.dumps({"answer": "twelve", "reasoning": "3 x 4"}),
        json.dumps({"reasoning": "no answer given"}),
        json.dumps({"answer": 1, "reasoning": "x", "confidence": 0.9}),
    ]
    out = gate.filter(results)
    assert [d.reason for d in out.dropped] == ["not_json", "schema", "schema", "schema"]
    assert out.dropped[1].detail.startswith("answer: 'twelve' is not of type 'number'")
    assert "'answer' is a required property" in out.dropped[2].detail
    import jsonschema

    with pytest.raises(jsonschema.SchemaError):
        RolloutValidator(schema={"type": "no-such-type"})


# ------------------------------------------------------------------------------ rewards


def batches(rng: np.random.Generator, n: int, size: int = 64):
    """Rewards as a verifier plus a format bonus gives them: 0/1 correctness, +0.1 or -0.1."""
    for _ in range(n):
        yield rng.binomial(1, 0.4, size) + rng.choice([0.1, -0.1], size)


def test_reward_gate_holds_a_batch_whose_variance_tripled_or_that_has_many_extremes():
    rng = np.random.default_rng(0)
    gate = RewardGate(history=20)
    normal = [gate.check(b, step=i) for i, b in enumerate(batches(rng, 30))]
    assert not any(v.held for v in normal)
    assert max(v.variance_ratio for v in normal) < 3.0

    scaled = next(batches(rng, 1)) * 3.0                # a reward model rescaled: variance x9
    v = gate.check(scaled, step=30)
    assert v.held and "variance" in v.reasons and v.variance_ratio > 6

    hacked = next(batches(rng, 1))
    hacked[:5] = 10.0                                    # 5 of 64 (7.8%): a reward hack's payoff
    v = gate.check(hacked, step=31)
    assert v.held and "extremes" in v.reasons and v.extreme_fraction == pytest.approx(5 / 64)
    few = next(batches(rng, 1))
    few[:2] = 1.4                                        # 3% past the tails: within what the gate lets pass
    v = gate.check(few, step=32)
    assert v.ok and v.extreme_fraction == pytest.approx(2 / 64)

    v = gate.check([0.5] * 63 + [float("nan")], step=33)
    assert v.held and "non_finite" in v.reasons
    c = gate.counts
    assert c["guard/reward_gate/held_batches"] == 3 and c["guard/reward_gate/held/variance"] >= 1
    assert gate.check(next(batches(rng, 1)), step=34).ok   # held batches did not become the baseline


def test_reward_gate_does_not_hold_the_first_successes_of_a_run_that_scored_nothing():
    gate = RewardGate()
    for i in range(10):
        assert gate.check(np.zeros(64), step=i).ok
    first = np.zeros(64)
    first[:2] = 1.0
    assert gate.check(first, step=10).ok       # no spread before: nothing to compare against


# ------------------------------------------------------------------------------ de-duplication


def test_near_duplicates_wait_the_minimum_interval_and_distinct_prompts_pass():
    distinct = prompts()              # no two of them closer than 0.5 (exact Jaccard)
    assert len(distinct) >= 300
    rng = random.Random(1)
    edited = [edit(p, rng) for p in distinct]
    close = [i for i, (a, b) in enumerate(zip(distinct, edited, strict=True)) if jaccard(a, b) >= 0.8]
    assert len(close) >= 0.9 * len(distinct)
    dedup = PromptDeduplicator(min_interval=10 * len(distinct))
    first = dedup.filter(distinct)
    assert len(first) >= 0.98 * len(distinct)                      # MinHash errs on very few
    again = set(dedup.filter(edited))
    assert not again & set(close) & set(first)                     # every close edit of an admitted one waits
    assert len(again) <= 0.03 * len(distinct)
    c = dedup.counts
    assert c["guard/dedup/seen"] == 2 * len(distinct) and c["guard/dedup/rejected"] >= 0.95 * len(distinct)


def test_a_near_duplicate_is_admitted_again_after_the_interval():
    distinct, rng = prompts(), random.Random(2)
    dedup = PromptDeduplicator(min_interval=100)
    assert dedup.filter(distinct[:50]) == list(range(50))
    early = [edit(p, rng) for p in distinct[:50]]
    assert dedup.filter(early) == []                    # 50..99 prompts later: too soon
    assert len(dedup.filter(distinct[100:150])) >= 49
    late = [edit(p, rng) for p in distinct[:50]]
    assert len(dedup.filter(late)) >= 49                # 150+ prompts later: admitted again
    assert len(dedup.index) <= 150                      # only the last interval's admissions are held


def test_interval_in_steps():
    text = prompts()[0]
    dedup = PromptDeduplicator(min_interval=30, unit="steps")
    assert dedup.admit(text, step=100)
    assert not dedup.admit(text.upper(), step=129)
    assert dedup.admit(text.upper(), step=130)
    with pytest.raises(ValueError, match="needs the step"):
        dedup.admit(text)


# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(d, *, cache_version="v2.1"):
    d.mkdir()
    (d / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(200_000))
    (d / "optimizer.pt").write_bytes(np.random.default_rng(1).bytes(400_000))
    (d / "rollout").mkdir()
    for shard in range(3):
        (d / "rollout" / f"part-{shard}.arrow").write_bytes(bytes([shard]) * 50_000)
    return write_manifest(d, parts={"parameters": "model.safetensors", "optimizer": "optimizer.pt",
                                    "rollout_cache": "rollout"},
                          versions={"rollout_cache": cache_version},
                          meta={"step": 500, "scheduler_step": 500, "rng_seeds": {"torch": 7, "numpy": 7},
                                "dataset_offset": 32000})


def test_a_whole_checkpoint_passes_and_its_meta_state_comes_back(tmp_path):
    save_checkpoint(tmp_path / "step_500")
    m = check_checkpoint(tmp_path / "step_500", expect_versions={"rollout_cache": "v2.1"},
                         require=("parameters", "optimizer", "rollout_cache"))
    assert m.step == 500 and m.meta["dataset_offset"] == 32000
    assert sorted(m.data["parts"]["rollout_cache"]["files"]) == [f"rollout/part-{i}.arrow" for i in range(3)]


def test_each_fault_is_refused_with_its_own_explicit_error(tmp_path):
    def fresh(name, **kw):
        d = tmp_path / name
        save_checkpoint(d, **kw)
        return d

    with pytest.raises(CheckpointError, match=r"^rollout cache version mismatch: expected v2.1, got v2.0$"):
        check_checkpoint(fresh("old_cache", cache_version="v2.0"), expect_versions={"rollout_cache": "v2.1"})
    d = fresh("no_optimizer")
    (d / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"^optimizer state missing: optimizer.pt is not in "):
        check_checkpoint(d)
    d = fresh("truncated")
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointError, match="parameters corrupted: model.safetensors has 1000 bytes"):
        check_checkpoint(d)
    d = fresh("bitflip")
    raw = bytearray((d / "rollout" / "part-1.arrow").read_bytes())
    raw[100] ^= 1
    (d / "rollout" / "part-1.arrow").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="rollout cache corrupted: rollout/part-1.arrow does not match"):
        check_checkpoint(d)
    check_checkpoint(d, hashes=False)      # sizes only: a bit flip is not seen, as documented


def test_a_corrupted_or_edited_manifest_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    path = save_checkpoint(d)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])                       # torn write
    with pytest.raises(CheckpointError, match="checkpoint manifest corrupted: .* is not JSON"):
        check_checkpoint(d)
    data = json.loads(text)
    data["meta"]["step"] = 900                                     # hand-edited to resume elsewhere
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        check_checkpoint(d)
    data = json.loads(text)
    data["format"] = "trainguard-checkpoint/0"
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="format mismatch: expected trainguard-checkpoint/1, got "
                                              "trainguard-checkpoint/0"):
        check_checkpoint(d)
    path.unlink()
    with pytest.raises(CheckpointError, match="checkpoint manifest missing"):
        check_checkpoint(d)
    assert not (d / (MANIFEST + ".tmp")).exists()


def test_a_manifest_is_not_written_for_an_incomplete_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="optimizer state missing"):
        write_manifest(d, parts={"parameters": "model.safetensors"},
                       meta={"step": 1, "scheduler_step": 1, "rng_seeds": {}, "dataset_offset": 0})
    with pytest.raises(CheckpointError, match="meta-state incomplete: dataset_offset missing"):
        write_manifest(d, parts={"parameters": "model.safetensors", "optimizer": "model.safetensors"},
                       meta={"step": 1, "scheduler_step": 1, "rng_seeds": {}})
    assert not (d / MANIFEST).exists()


def test_importing_the_guards_imports_no_framework():
    code = ("import sys, trainguard.producers.guards\n"
            "print(sorted(m for m in ('torch', 'trl', 'transformers', 'verl', 'jsonschema') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def _forge(d, edit):
    """Edit the manifest and write it back with a checksum that matches: the checksum proves a
    manifest whole, not honest, so the check must survive any content behind a valid one."""

    path = d / MANIFEST
    data = json.loads(path.read_text())
    edit(data)
    data["checksum"] = _checksum(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("edit", [
    lambda m: m["parts"].__setitem__("parameters", "model.safetensors"),
    lambda m: m["parts"]["parameters"].__setitem__("files", ["model.safetensors"]),
    lambda m: m["parts"]["parameters"].pop("files"),
    lambda m: m["parts"]["parameters"].__setitem__("files", {}),
    lambda m: m["parts"]["parameters"]["files"].__setitem__("model.safetensors", "200000"),
    lambda m: m["parts"]["parameters"]["files"]["model.safetensors"].__setitem__("bytes", "200000"),
    lambda m: m["parts"]["parameters"]["files"]["model.safetensors"].__setitem__("sha256", None),
    lambda m: m["parts"]["parameters"].__setitem__("path", {"a": 1}),
    lambda m: m["parts"]["parameters"].__setitem__("version", ["v1"]),
    lambda m: m["meta"].__setitem__("step", "500"),
    lambda m: m["meta"].__setitem__("step", None),
    lambda m: m["meta"].__setitem__("step", True),
    lambda m: m["meta"].__setitem__("step", -1),
], ids=["part-str", "files-list", "no-files", "files-empty", "info-str", "bytes-str", "sha-none", "path-dict",
        "version-list", "step-str", "step-none", "step-bool", "step-negative"])
def test_a_manifest_of_the_wrong_shape_is_refused_with_what_is_wrong(tmp_path, edit):
    d = tmp_path / "ckpt"
    save_checkpoint(d)
    _forge(d, edit)
    with pytest.raises(CheckpointError, match="checkpoint manifest corrupted: .*"):
        check_checkpoint(d)


def test_a_deeply_nested_or_huge_manifest_is_refused_and_an_older_checkpoint_chosen(tmp_path, monkeypatch):
    from trainguard.producers.guards import checkpoint as ck

    save_checkpoint(tmp_path / "old")
    save_checkpoint(tmp_path / "nested")
    (tmp_path / "nested" / MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    save_checkpoint(tmp_path / "huge")
    with pytest.raises(CheckpointError, match="checkpoint manifest corrupted: .* nested too deeply"):
        check_checkpoint(tmp_path / "nested")
    path, _ = newest_verified([tmp_path / "nested", tmp_path / "old"])
    assert path == tmp_path / "old"
    monkeypatch.setattr(ck, "MAX_MANIFEST_BYTES", 1000)  # the real bound is tens of MB: not written here
    with pytest.raises(CheckpointError, match=r"checkpoint manifest corrupted: .* is \d+ bytes, more than 1000"):
        check_checkpoint(tmp_path / "huge")


def test_a_manifest_naming_files_outside_its_folder_is_refused(tmp_path):
    import hashlib
    import os

    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not this checkpoint's")
    listed = {"bytes": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
    for name, rel in [("dotdot", "../outside.bin"), ("absolute", str(outside))]:
        d = tmp_path / name
        save_checkpoint(d)
        _forge(d, lambda m, rel=rel: m["parts"]["parameters"].update(path=rel, files={rel: listed}))
        with pytest.raises(CheckpointError, match=f"checkpoint manifest corrupted: .*{rel}.* outside"):
            check_checkpoint(d)
    d = tmp_path / "symlink"
    save_checkpoint(d)
    (d / "model.safetensors").unlink()
    os.symlink(outside, d / "model.safetensors")  # the loader would read the file it points to
    _forge(d, lambda m: m["parts"]["parameters"]["files"].update({"model.safetensors": listed}))
    with pytest.raises(CheckpointError, match="model.safetensors.* outside"):
        check_checkpoint(d)
    with pytest.raises(CheckpointError, match="model.safetensors.* outside"):
        write_manifest(d, parts={"parameters": "model.safetensors", "optimizer": "optimizer.pt"},
                       meta={"step": 1, "scheduler_step": 1, "rng_seeds": {}, "dataset_offset": 0})


# -- manifests cover what is loaded ------------------------------------------------------------

def test_a_file_added_to_a_folder_part_after_the_manifest_is_refused(tmp_path):
    save_checkpoint(tmp_path / "step_500")
    _forge(tmp_path / "step_500", lambda data: data.update(whole_folder=False))  # files beside the parts allowed
    (tmp_path / "step_500" / "notes.txt").write_text("beside the parts: not loaded, allowed")
    check_checkpoint(tmp_path / "step_500")
    (tmp_path / "step_500" / "rollout" / "part-9.arrow").write_bytes(b"planted")
    with pytest.raises(CheckpointError, match="does not list: rollout/part-9.arrow in a folder part"):
        check_checkpoint(tmp_path / "step_500")


def test_a_manifest_that_listed_the_whole_folder_refuses_any_file_added_to_it(tmp_path):
    d = tmp_path / "checkpoint-7"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w" * 64)
    write_manifest(d, parts={"parameters": "model.safetensors"}, require=("parameters",),
                   meta={"step": 7, "scheduler_step": 7, "rng_seeds": {}, "dataset_offset": 0})
    assert check_checkpoint(d, require=("parameters",)).data["whole_folder"] is True
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')  # would be loaded before the file
    with pytest.raises(CheckpointError, match="does not list: model.safetensors.index.json in .*checkpoint-7"):
        check_checkpoint(d, require=("parameters",))


def test_a_manifest_that_did_not_list_the_whole_folder_tolerates_files_beside_its_parts(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w" * 64)
    (d / "notes.txt").write_text("the user's own")
    write_manifest(d, parts={"parameters": "model.safetensors"}, require=("parameters",),
                   meta={"step": 7, "scheduler_step": 7, "rng_seeds": {}, "dataset_offset": 0})
    (d / "later.txt").write_text("also the user's")
    assert check_checkpoint(d, require=("parameters",)).data["whole_folder"] is False


def test_what_is_loaded_is_the_bytes_that_were_verified(tmp_path):
    """load_verified reads each file once and hands its loader the bytes it checked: a file swapped
    on disk after the manifest check of the others (between two loads) is refused, never loaded,
    and a refused checkpoint returns nothing at all."""
    from trainguard.producers.guards.checkpoint import load_verified

    save_checkpoint(tmp_path / "step_500")
    d = tmp_path / "step_500"
    original = (d / "optimizer.pt").read_bytes()
    got = {}

    def swap_the_optimizer_then_keep(data):
        (d / "optimizer.pt").write_bytes(b"x" * len(original))  # same size: only the bytes tell
        got["parameters"] = data
        return len(data)

    def loaders(manifest):
        return {"model.safetensors": swap_the_optimizer_then_keep, "optimizer.pt": lambda data: data}

    with pytest.raises(CheckpointError, match="optimizer state corrupted: optimizer.pt does not match its SHA-256"):
        load_verified(d, loaders, require=("parameters", "optimizer"))
    assert got["parameters"] == (d / "model.safetensors").read_bytes()

    (d / "optimizer.pt").write_bytes(original)
    manifest, loaded = load_verified(d, lambda m: {"optimizer.pt": lambda data: data})
    assert loaded == {"optimizer.pt": original} and manifest.step == 500
    with pytest.raises(CheckpointError, match="rollout/extra.bin is not listed in the manifest"):
        load_verified(d, lambda m: {"rollout/extra.bin": bytes})


def test_the_trainers_verdict_travels_in_the_manifest_and_is_checked(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w" * 64)
    write_manifest(d, parts={"parameters": "model.safetensors"}, require=("parameters",),
                   meta={"step": 7, "scheduler_step": 7, "rng_seeds": {}, "dataset_offset": 0},
                   health={"healthy": False, "why": "parameter w holds NaN/Inf at step 7"})
    assert check_checkpoint(d, require=("parameters",)).health == {"healthy": False,
                                                                     "why": "parameter w holds NaN/Inf at step 7"}
    manifest = d / MANIFEST
    data = json.loads(manifest.read_text())
    data["health"] = {"healthy": "yes"}
    data["checksum"] = _checksum(data)
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="its health is not"):
        check_checkpoint(d, require=("parameters",))


def test_every_ranks_rng_state_is_listed_in_a_trainer_checkpoint(tmp_path):
    from trainguard.producers.integrations.hf import checkpoint_parts

    d = tmp_path / "checkpoint-4"
    d.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"):
        (d / name).write_bytes(b"x")
    assert checkpoint_parts(str(d))["rng"] == ["rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"]
