"""Regenerate the sample recordings in this folder: ``python tests/data/make_samples.py``.

Deterministic (fixed seed, standard library only). The scenario and its ground truth are in
README.md beside this file.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 300
KL_ONSET = 150        # KL to the reference starts to blow up here
REWARD_ONSET = 180    # reward collapses from here on
NAN_GRAD_STEPS = (198, 205)
PREFIX = "\x1b[36m(TaskRunner pid=2871)\x1b[0m "


def sig(x: float, digits: int = 5) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def run_metrics(rng: random.Random) -> list[tuple[int, dict[str, float]]]:
    """A GRPO run (7B policy, GSM8K-like reward in [0, 1]) whose KL blows up at step 150."""
    out = []
    for step in range(1, STEPS + 1):
        healthy_score = 0.32 + 0.45 / (1 + math.exp(-(step - 70) / 25))
        kl = 0.0004 + 0.000025 * step
        entropy = 0.58 - 0.0006 * step
        grad = 0.28 + rng.gauss(0, 0.04)
        clip = 0.003 + rng.uniform(0, 0.002)
        ppo_kl = 0.0001 * rng.uniform(0.5, 1.5)
        length = 245 - 0.25 * step
        if step >= KL_ONSET:
            t = step - KL_ONSET
            kl = kl * math.exp(min(t, 60) / 9.0)        # ~0.0058 at 150 -> ~4 by 210, then flat-ish
            ppo_kl = ppo_kl * (1 + t * 2.5)
            clip = min(0.45, clip + 0.004 * t)
            grad = grad * (1 + 0.35 * t) * rng.uniform(0.6, 1.6)
            entropy = entropy + min(2.2, 0.03 * t ** 1.3)
            length = min(1024, length + 0.05 * t ** 2.2)
        score = healthy_score
        if step >= REWARD_ONSET:
            score = 0.04 + (healthy_score - 0.04) * math.exp(-(step - REWARD_ONSET) / 10)
        score = min(1.0, max(0.0, score + rng.gauss(0, 0.025)))
        clip_ratio = max(0.0, min(1.0, (length - 700) / 400)) if length > 700 else rng.uniform(0, 0.01)
        gen = 28 + length * 0.012 + rng.gauss(0, 1.2)
        update = 21 + rng.gauss(0, 0.8)
        step_time = gen + update + 9.5 + rng.gauss(0, 0.5)
        tokens = 512 * (length + 180)
        m = {
            "actor/entropy": entropy + rng.gauss(0, 0.01),
            "actor/kl_loss": kl * rng.uniform(0.9, 1.1),
            "actor/pg_loss": rng.gauss(0, 0.012) * (1 + (step >= KL_ONSET) * 4),
            "actor/pg_clipfrac": clip,
            "actor/ppo_kl": ppo_kl,
            "actor/grad_norm": math.nan if step in NAN_GRAD_STEPS else grad,
            "actor/lr": 1e-6,
            "critic/score/mean": score,
            "critic/rewards/mean": score,
            "critic/advantages/max": 1.79 + rng.gauss(0, 0.05),
            "response_length/mean": min(1024.0, length + rng.gauss(0, 6)),
            "response_length/clip_ratio": clip_ratio,
            "timing_s/gen": gen,
            "timing_s/update_actor": update,
            "timing_s/step": step_time,
            "perf/throughput": tokens / step_time / 8,
            "perf/max_memory_allocated_gb": 47.8 + rng.gauss(0, 0.3),
        }
        out.append((step, {k: sig(v) for k, v in m.items()}))
    return out


NP_WRAPPED = ("critic/", "response_length/")  # numpy means: pprint shows np.float64(...) on numpy 2


def verl_value(key: str, v: float) -> str:
    text = "nan" if v != v else repr(v)
    if key.startswith(NP_WRAPPED):
        return f"np.float64({text})"
    return text


def write_verl_log(rows, path: str) -> None:
    lines = [
        "2025-05-14 09:12:03,118\tINFO worker.py:1832 -- Started a local Ray instance.",
        f"{PREFIX}Using dataset class: RLHFDataset",
        f"{PREFIX}Size of train dataloader: 7473, Size of val dataloader: 1319",
        f"{PREFIX}Total training steps: {STEPS}",
        f"{PREFIX}Initial validation metrics: {{'val-core/openai/gsm8k/reward/mean@1': 0.3116}}",
        f"{PREFIX}step:0 - val-core/openai/gsm8k/reward/mean@1:np.float64(0.3116)",
    ]
    for step, m in rows:
        items = [f"step:{step}"] + [f"{k}:{verl_value(k, v)}" for k, v in m.items()]
        items += [f"training/global_step:{step}", "training/epoch:0"]
        line = PREFIX + " - ".join(items)
        if step == 77:  # a line cut off mid-write (process killed, disk full ...)
            line = line[: len(line) // 2]
        if step == 120:
            lines.append(f"{PREFIX}step:120 - ??? garbled output")
        if step % 50 == 0:
            lines.append(f"{PREFIX}local_global_step_folder: checkpoints/gsm8k_grpo/qwen2_7b/global_step_{step}")
        if step % 97 == 0:
            lines.append(line + " [repeated 2x across cluster]")
        else:
            lines.append(line)
        if step % 25 == 0:
            lines.append(f"Training Progress:  {100 * step // STEPS}%|###    | {step}/{STEPS} [{step}:00<?, 58.1s/it]")
        if step == 160:
            lines.append(f"{PREFIX}WARNING: response length exceeded max_response_length for 12% of samples")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_small(rows) -> None:
    few = rows[145:160]  # around the KL onset, 15 steps
    keys = ["actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"]
    with open(os.path.join(HERE, "sample.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["step", *keys, "note"])
        for step, m in few:
            w.writerow([step, *[m[k] for k in keys], "ok"])
        w.writerow([161, "nan", "inf", "", 0.5, "manual"])
        w.writerow([162, 1, 2, 3, 4, 5, 6])  # one cell too many: skipped
    with open(os.path.join(HERE, "sample.jsonl"), "w", encoding="utf-8") as f:
        for step, m in few:
            f.write(json.dumps({"step": step, **{k: m[k] for k in keys}}) + "\n")  # bare NaN tokens
        f.write('{"step": 161, "actor/kl_loss": NaN, "actor/grad_norm": Infinity, "actor/entropy": -Infinity}\n')
        f.write('{"step": 162, "actor/kl_loss": 0.1,\n')  # a cut line: skipped
    state = {"best_metric": None, "epoch": 0.37, "global_step": 30, "log_history": []}
    for i in range(1, 31):
        entry = {"epoch": round(i / 80, 4), "grad_norm": 0.3 + 0.01 * i, "learning_rate": 1e-6,
                 "loss": 0.02 - 0.0003 * i, "reward": 0.3 + 0.01 * i, "kl": 0.0004 * i, "step": i}
        if i == 17:
            entry["grad_norm"] = math.nan
        state["log_history"].append(entry)
        if i % 10 == 0:
            state["log_history"].append({"epoch": round(i / 80, 4), "eval_reward": 0.28 + 0.01 * i,
                                         "eval_runtime": 41.2, "step": i})
    state["log_history"].append({"epoch": 0.375, "step": 30, "total_flos": 0.0, "train_loss": 0.012,
                                 "train_runtime": 1810.4})
    with open(os.path.join(HERE, "trainer_state.json"), "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2)


def main() -> None:
    rows = run_metrics(random.Random(7))
    write_verl_log(rows, os.path.join(HERE, "verl_kl_blowup.log"))
    write_small(rows)


if __name__ == "__main__":
    main()
