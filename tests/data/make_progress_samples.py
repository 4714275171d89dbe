"""Regenerate the progress-display samples: ``python tests/data/make_progress_samples.py``.

Both are written by the code that writes them in a real run, not imitated:

- ``hf_notebook_table.txt``: transformers' ``NotebookTrainingTracker`` (the table under the
  progress bar of ``NotebookProgressCallback``) fed a run's logs, its HTML table copied as text
  the way a browser copies a table (cells joined by tabs), under the bar's label. The loss turns
  NaN at step 40 (logging_steps 5, no evaluation).
- ``openrlhf_tqdm.log``: tqdm 4.x bars written to a file as OpenRLHF's actor (``ray/ppo_actor.py``:
  ``pbar.set_postfix(short_status)`` once per micro-step, Ray's prefix on each line) and older
  ``Episode`` bars draw them; ``act_loss`` and ``grad_norm`` turn NaN at the 7th global step.
"""

from __future__ import annotations

import html
import io
import math
import os
import re
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def notebook_table() -> str:
    display = types.ModuleType("IPython.display")  # the tracker draws HTML through IPython; capture it instead
    shown: list[str] = []
    display.HTML = lambda code: code
    display.display = lambda code, display_id=True: types.SimpleNamespace(update=shown.append)
    sys.modules.setdefault("IPython", types.ModuleType("IPython"))
    sys.modules["IPython.display"] = display
    from transformers.utils.notebook import NotebookTrainingTracker

    # on_train_begin's columns without evaluation; on_log writes {"Training Loss", "Step"} each logging step
    tracker = NotebookTrainingTracker(60, ["Step", "Training Loss"])
    tracker.update(1)
    for step in range(1, 61):
        if step % 5 == 0:
            loss = math.nan if step >= 40 else 0.69 - 0.004 * step + 0.003 * math.sin(step)
            tracker.write_line({"Training Loss": loss, "Step": step})
        tracker.update(step + 1 if step < 60 else 60, force_update=True, comment=f"Epoch {step // 20}/3")
    page = shown[-1]
    label = html.unescape(re.search(r"</progress>\s*(.*?)\s*</div>", page, re.S).group(1))
    rows = re.findall(r"<tr.*?>(.*?)</tr>", page, re.S)
    lines = [" " + label]
    for row in rows:
        lines.append("\t".join(html.unescape(c) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)))
    return "\n".join(lines) + "\n"


def openrlhf_log() -> str:
    from tqdm import tqdm

    out = io.StringIO()
    for global_step in range(1, 11):
        out.write(f"(PolicyModelActor pid=812) step {global_step}: actor update\n")
        pbar = tqdm(range(4), desc="Train epoch [1/1]", file=out, mininterval=0, ascii=False, ncols=None)
        for micro in pbar:
            broken = global_step >= 7
            status = {"act_loss": math.nan if broken else 0.012 - 0.0004 * global_step + 0.0001 * micro,
                      "reward": 0.31 + 0.02 * global_step, "return": 0.29 + 0.02 * global_step,
                      "gen_len": 310.0 + global_step, "tot_len": 512.0 + global_step,
                      "kl": 0.0001 * global_step, "act_lr": 5e-7,
                      "grad_norm": math.nan if broken else 0.3 + 0.01 * micro}
            pbar.set_postfix(status)
        pbar.close()
    # tqdm writes to a file as to a terminal, "\r" before each refresh and "\n" at close, so a bar's
    # refreshes share one line; Ray prefixes each line it forwards from the actor
    return "".join(f"(PolicyModelActor pid=812) {line}\n" if "Train epoch" in line else line + "\n"
                   for line in out.getvalue().split("\n") if line)


def main() -> None:
    with open(os.path.join(HERE, "hf_notebook_table.txt"), "w", encoding="utf-8") as f:
        f.write(notebook_table())
    with open(os.path.join(HERE, "openrlhf_tqdm.log"), "w", encoding="utf-8") as f:
        f.write(openrlhf_log())


if __name__ == "__main__":
    main()
