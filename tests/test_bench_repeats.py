"""bench/repeats.py (behind bench/real_rep.sh and bench/prefill_ab.sh): spread, the reproduce-within-tolerance
rule, the interleaved A/B schedule, and both commands end to end with the harness's measurement replaced (the
harness itself is tested in test_bench_harness.py), including arms whose servers the command starts and stops."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness, repeats, serving

REPO = Path(__file__).resolve().parents[1]


def test_spread_and_reproduction_rule():
    s = repeats.spread([100.0, 104.0, 102.0])
    assert s["mean"] == pytest.approx(102.0) and s["stdev"] == pytest.approx(2.0)
    assert s["relative_spread"] == pytest.approx(4 / 102) and (s["min"], s["max"], s["n"]) == (100.0, 104.0, 3)
    assert repeats.spread([5.0])["stdev"] == 0.0
    with pytest.raises(ValueError):
        repeats.spread([])
    assert not repeats.reproduces([100.0], 0.01)
    assert repeats.reproduces([90.0, 100.0, 100.9], 0.01)  # only the last two count
    assert not repeats.reproduces([100.0, 100.9, 90.0], 0.01)
    assert repeats.reproduces([1000.0, 1004.9], 0.005) and not repeats.reproduces([1000.0, 1005.1], 0.005)
    assert repeats.arm_order(0) == ["A", "B"] and repeats.arm_order(1) == ["B", "A"] and repeats.arm_order(2) == ["A", "B"]


class Script:
    """measure() answers from per-(arm, condition) value lists and logs the order; session() logs starts."""

    def __init__(self, values: dict[tuple[str, str], list[float]]):
        self.values = {k: list(v) for k, v in values.items()}
        self.log: list[tuple[str, str]] = []
        self.sessions: list[str] = []

    def measure(self, arm: str, condition: str) -> float:
        self.log.append((arm, condition))
        return self.values[(arm, condition)].pop(0)

    @contextlib.contextmanager
    def session(self, arm: str):
        self.sessions.append(arm)
        yield


def test_interleaved_rounds_alternate_and_stop_when_both_arms_reproduce():
    script = Script({
        ("A", "1k"): [100.0, 100.2], ("B", "1k"): [110.0, 110.1],  # both reproduce in round 2
        ("A", "4k"): [90.0, 95.0, 95.1, 95.0], ("B", "4k"): [99.0, 99.05, 99.0, 99.1],  # A settles in round 3
    })
    state = repeats.Interleaved(["1k", "4k"], tolerance=0.005)
    assert state.run(script.measure, script.session, max_rounds=6)
    assert state.rounds == 3 and script.sessions == ["A", "B", "B", "A", "A"]
    assert script.log == [("A", "1k"), ("A", "4k"), ("B", "1k"), ("B", "4k"),
                          ("B", "1k"), ("B", "4k"), ("A", "1k"), ("A", "4k"),
                          ("A", "4k")]  # 1k done after round 2, 4k once A reproduced: nothing more is measured
    summary = state.summary()
    assert summary["1k"]["A"]["value"] == pytest.approx(100.1) and summary["1k"]["b_vs_a"] == pytest.approx(110.05 / 100.1 - 1)
    assert summary["4k"]["A"]["values"] == [90.0, 95.0, 95.1] and summary["4k"]["reproduced"]


def test_interleaved_gives_up_after_max_rounds():
    script = Script({("A", "c"): [100.0, 110.0, 100.0], ("B", "c"): [100.0, 100.1, 100.0]})
    state = repeats.Interleaved(["c"], tolerance=0.01)
    assert not state.run(script.measure, script.session, max_rounds=3)
    assert state.rounds == 3 and not state.summary()["c"]["reproduced"]
    assert not state.summary()["c"]["A"]["reproduced"] and state.summary()["c"]["B"]["reproduced"]


def _fake_harness(monkeypatch, figure):
    calls = []

    def run_one(run, args, base, key, seed, workdir):
        calls.append({"run": run, "url": base, "seed": seed, "temperature": args.temperature, "warmup": args.warmup})
        return figure(run, base, len(calls))

    monkeypatch.setattr(harness, "run_one", run_one)
    monkeypatch.setattr(harness, "server_facts", lambda base, key: {"url": base, "vllm_version": "0.28.0"})
    monkeypatch.setattr(harness, "machine_facts", lambda: {"hostname": "test"})
    return calls


def test_real_rep_repeats_the_c1_row_and_writes_mean_and_spread(monkeypatch, tmp_path, capsys):
    rates = [110.0, 112.0, 114.0]
    calls = _fake_harness(monkeypatch, lambda run, base, i: {
        "decode_tok_s": rates[i - 1], "tokens_per_step": 2.8, "ms_per_step": 25.0, "e2e_output_tok_s": 100.0})
    assert repeats.main(["real-rep", "box", "3", "0", "--url", "http://h:1", "--out", str(tmp_path)]) == 0
    run = calls[0]["run"]
    assert (run.name, run.concurrency, run.dataset, run.output_len, run.num_prompts) == ("C1", 1, "custom", 1024, 8)
    assert [c["seed"] - calls[0]["seed"] for c in calls] == [0, 1, 2]  # a fresh seed (and cache salt) per run
    assert all(c["temperature"] == 0.0 and c["warmup"] for c in calls)
    data = json.loads((tmp_path / "box-real-rep.json").read_text())
    assert data["summary"]["decode_tok_s"]["mean"] == pytest.approx(112.0)
    assert data["summary"]["decode_tok_s"]["relative_spread"] == pytest.approx(4 / 112)
    assert data["summary"]["tokens_per_step"]["stdev"] == 0.0 and len(data["repeats"]) == 3
    assert "| decode_tok_s | 112.00 | 2.00 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        repeats.main(["real-rep", "box", "1"])


def test_prefill_ab_between_two_running_servers(monkeypatch, tmp_path, capsys):
    rates = {"http://a:1": iter([1000.0, 1001.0]), "http://b:1": iter([1100.0, 1100.5])}
    calls = _fake_harness(monkeypatch, lambda run, base, i: {"prefill_tok_s": next(rates[base])})
    argv = ["prefill-ab", "ab", "--a-url", "http://a:1", "--b-url", "http://b:1", "--lens", "4096",
            "--out", str(tmp_path)]
    assert repeats.main(argv) == 0
    assert [(c["url"], c["run"].input_len, c["run"].output_len, c["run"].section) for c in calls] == [
        ("http://a:1", 4096, 1, "prefill"), ("http://b:1", 4096, 1, "prefill"),
        ("http://b:1", 4096, 1, "prefill"), ("http://a:1", 4096, 1, "prefill")]
    assert len({c["seed"] for c in calls}) == 4  # fresh random prompts every time: no prefix-cache replay
    data = json.loads((tmp_path / "ab-prefill-ab.json").read_text())
    row = data["conditions"]["prefill-4096"]
    assert row["reproduced"] and row["b_vs_a"] == pytest.approx(1100.25 / 1000.5 - 1)
    assert "| prefill-4096 | 1000.5 | 1100.2 | +10.0% | yes |" in capsys.readouterr().out


def test_prefill_ab_starts_and_stops_each_arms_server_per_round(monkeypatch, tmp_path):
    ports = {"A": serving.free_port(), "B": serving.free_port()}
    health = (f"{sys.executable} -c \"import http.server as h, sys\n"
              "class H(h.BaseHTTPRequestHandler):\n"
              "    def do_GET(self): self.send_response(200); self.end_headers()\n"
              "h.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\" ")
    seen = []

    def figure(run, base, i):
        port = int(base.rsplit(":", 1)[1])
        # the arm's server is up while it is measured, and the other arm's is not
        other = ports["B"] if port == ports["A"] else ports["A"]
        seen.append((serving.probe(f"{base}/health")[0], serving.probe(f"http://127.0.0.1:{other}/health")[0]))
        return {"prefill_tok_s": 500.0 + (port == ports["B"])}

    _fake_harness(monkeypatch, figure)
    argv = ["prefill-ab", "cmds", "--lens", "1024", "--out", str(tmp_path), "--boot-timeout", "30"]
    for arm in ("a", "b"):
        port = ports[arm.upper()]
        argv += [f"--{arm}-url", f"http://127.0.0.1:{port}", f"--{arm}-cmd", f"exec {health}{port}"]
    assert repeats.main(argv) == 0
    assert seen == [(200, 0)] * 4
    assert len(list(tmp_path.glob("arm-*.log"))) >= 2


def test_prefill_ab_arm_that_never_boots_is_reported(monkeypatch, tmp_path, capsys):
    _fake_harness(monkeypatch, lambda run, base, i: {"prefill_tok_s": 1.0})
    argv = ["prefill-ab", "dead", "--a-url", "http://127.0.0.1:9", "--a-cmd", "exit 7", "--b-url", "http://b:1",
            "--out", str(tmp_path)]
    assert repeats.main(argv) == 3
    assert "exited with code 7" in capsys.readouterr().err
    assert json.loads((tmp_path / "dead-prefill-ab.json").read_text())["rounds"] == 0
    with pytest.raises(SystemExit):  # a command's server must say where it listens
        repeats.main(["prefill-ab", "x", "--a-url", "http://127.0.0.1", "--a-cmd", "true", "--b-url", "http://b:1"])


def test_shell_wrappers_reach_the_python(tmp_path):
    for script, words in (("real_rep.sh", "N repeats"), ("prefill_ab.sh", "Prefill A/B")):
        res = subprocess.run(["bash", str(REPO / "bench" / script), "--help"], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, cwd=tmp_path)
        assert res.returncode == 0 and words in res.stdout, res.stderr
