"""SIGKILL a prepare step at random moments: the model is always the before or the after state.

Each trial copies the tiny synthetic checkpoint, starts a real prepare/quant_*.py subprocess, kills
it with SIGKILL at a moment spread over its phases (anchored on its progress lines), checks that the
directory (every file, byte for byte) equals the untouched checkpoint or the finished step, that it
loads, and that re-running the step (itself killed once in every other trial) finishes the job.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from qwen_serving.checkpoint import transaction
from tests.helpers.tiny_checkpoint import EPOCH, REPO, STEPS, load_check, make_tiny, run, tree_state

TRIALS = 24


def _start(step: str, model: Path) -> subprocess.Popen:
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(REPO / "prepare" / f"{step}.py"), str(model)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    )


def _kill_after(proc: subprocess.Popen, delay: float) -> None:
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def _lines_with_times(proc: subprocess.Popen) -> list[float]:
    """Read the step's progress lines; the time each arrived, relative to the first."""
    times, first = [], None
    for _line in proc.stdout:
        now = time.monotonic()
        first = now if first is None else first
        times.append(now - first)
    return times


def test_sigkill_leaves_the_before_or_the_after_state(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    source = make_tiny(tmp_path_factory)
    before = tree_state(source)
    after, marks = {}, {}
    for step in STEPS:  # reference run: the after state and when each progress line appears
        model = tmp_path / "ref" / step / "tiny"
        shutil.copytree(source, model)
        proc = _start(step, model)
        marks[step] = _lines_with_times(proc)
        proc.wait()
        proc.stdout.close()
        assert proc.returncode == 0 and len(marks[step]) >= 5
        after[step] = tree_state(model)
        assert after[step] != before

    rng = random.Random(20261129)
    outcomes: Counter[str] = Counter()
    for trial in range(TRIALS):
        step = STEPS[trial % len(STEPS)]
        times = marks[step]
        model = tmp_path / f"trial{trial}" / "tiny"
        shutil.copytree(source, model)
        proc = _start(step, model)
        # anchor on progress line k, spread from the first line to the last ("done", after the commit) over
        # the trials, then kill a random moment before the next line would come, so kills land in every phase
        # whatever the machine's load, the first anchors before anything is written and the last after the swap
        group, groups = trial // len(STEPS), TRIALS // len(STEPS)
        anchor = round(group * (len(times) - 1) / (groups - 1))
        for _ in range(anchor + 1):
            proc.stdout.readline()
        gap = times[anchor + 1] - times[anchor] if anchor + 1 < len(times) else 0.01
        _kill_after(proc, gap * rng.random())
        state = tree_state(model)
        assert state in (before, after[step]), f"trial {trial}: {step} killed into a third state"
        outcomes["before" if state == before else "after"] += 1
        outcomes["mid-work"] += bool(transaction.leftovers(model))
        load_check(model)
        if trial % 2:
            # a re-run killed early (start-up, lock, clean-up of the first run) is just as harmless
            _kill_after(_start(step, model), 0.3 * rng.random())
            assert tree_state(model) in (before, after[step])
            load_check(model)
        assert run(model, step) == 0
        assert tree_state(model) == after[step], f"trial {trial}: re-run did not reach the after state"
        assert not transaction.leftovers(model)
    assert outcomes["before"] >= 3 and outcomes["after"] >= 3 and outcomes["mid-work"] >= 3, outcomes
