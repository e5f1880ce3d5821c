"""bench/host_profile.py: the engine core found under a server's process tree, py-spy's speedscope profile
summarized by function, and a recording driven while work runs (a stand-in py-spy here)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from bench import host_profile as hp


def _proc(tmp_path: Path, tree: dict[int, list[int]], cmdlines: dict[int, str]) -> Path:
    proc = tmp_path / "proc"
    for pid in set(tree) | set(cmdlines):
        task = proc / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, tree.get(pid, []))) + " ")
        (proc / str(pid) / "cmdline").write_bytes(cmdlines.get(pid, "python3").replace(" ", "\0").encode())
    return proc


def test_engine_core_is_the_descendant_that_names_itself(tmp_path):
    proc = _proc(tmp_path, {10: [11, 12], 12: [13]}, {10: "python3 -m vllm serve /m", 11: "resource_tracker",
                                                       12: "python3 -c spawn_main", 13: "VLLM::EngineCore_DP0"})
    assert hp.children(10, proc) == [11, 12]
    assert hp.engine_core_pid(10, proc) == 13
    assert hp.engine_core_pid(11, proc) is None


DOC = {"shared": {"frames": [{"name": "run_busy_loop", "file": "/v/core.py", "line": 10},
                             {"name": "step", "file": "/v/core.py", "line": 20},
                             {"name": "prepare_inputs", "file": "/v/runner.py", "line": 30},
                             {"name": "sample_draft", "file": "/q/mtp.py", "line": 40}]},
       "profiles": [{"name": "MainThread", "samples": [[0, 1, 2], [0, 1, 2], [0, 1, 3], [0]], "weights": [1, 1, 1, 1]},
                    {"name": "other", "samples": [[0, 1]]}]}


def test_summary_shares_by_function():
    summary = hp.summarize(DOC, top=3)
    assert summary["samples"] == 5 and [t["samples"] for t in summary["threads"]] == [4, 1]
    assert summary["self"][0] == {"function": "prepare_inputs (runner.py:30)", "share": 0.4}
    assert {"function": "run_busy_loop (core.py:10)", "share": 1.0} in summary["inclusive"]
    assert len(summary["self"]) == 3


def test_recording_drives_the_work_until_pyspy_is_done(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "py-spy"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys, time\nargs = sys.argv\ntime.sleep(0.3)\n"
                    f"json.dump({DOC!r}, open(args[args.index('--output') + 1], 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert hp.pyspy_binary([str(tmp_path / "x"), str(tmp_path)]) == str(fake)  # pip --target's bin/ beside a path
    assert hp.pyspy_binary([str(tmp_path / "x")]) is None
    calls = []
    result = hp.record_while(str(fake), os.getpid(), 1, tmp_path / "p.json", lambda: calls.append(1))
    assert result["profile"] == "p.json" and result["self"][0]["share"] == 0.4 and result["rounds"] == len(calls) > 0
    fake.write_text("#!/bin/sh\necho 'Permission denied (os error 13)'\nexit 1\n")
    failed = hp.record_while(str(fake), os.getpid(), 1, tmp_path / "q.json", lambda: None)
    assert "Permission denied" in failed["error"]


@pytest.mark.parametrize("seconds", [0.2, 9.6])
def test_record_command(seconds):
    cmd = hp.record_command("py-spy", 42, seconds, Path("/o/x.json"))
    assert cmd[:4] == ["py-spy", "record", "--pid", "42"] and cmd[cmd.index("--duration") + 1] == str(max(1, round(seconds)))
    assert "--nonblocking" in cmd and cmd[cmd.index("--format") + 1] == "speedscope"
