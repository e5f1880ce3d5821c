"""bench/run_benchmarks.sh without a GPU: the prompts file, the run plan, the `vllm bench serve`
arguments (parsed by vLLM 0.28.0's own parser), argument errors, and what it reads from a server."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench import report as br
from bench import serving

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "run_benchmarks.sh"
PROMPTS = REPO / "bench" / "prompts_real.jsonl"


def test_prompts_file_fits_vllm_custom_dataset():
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 8
    # CustomDataset (vllm/benchmarks/datasets/datasets.py) needs `prompt`; `output_tokens` is its per-row length
    assert all(isinstance(r["prompt"], str) and len(r["prompt"].split()) >= 30 for r in rows)
    assert all(r["output_tokens"] == 1024 for r in rows)
    assert len({r["prompt"] for r in rows}) == 8
    assert {r["lang"] for r in rows} == {"en", "da", "code"}
    danish = [r["prompt"] for r in rows if r["lang"] == "da"]
    assert danish and all(any(ch in p for ch in "æøå") for p in danish)


def test_plan_single_and_batch():
    single = br.plan_runs("single")
    assert [(r.name, r.concurrency, r.dataset, r.num_prompts, r.output_len) for r in single] == [
        ("C1", 1, "custom", 8, 1024), ("C2", 2, "custom", 8, 1024), ("C4", 4, "custom", 8, 1024),
        ("C8", 8, "custom", 8, 1024)]
    (batch,) = br.plan_runs("batch")
    assert (batch.name, batch.concurrency, batch.dataset, batch.input_len, batch.output_len) == ("C64", 64, "random",
                                                                                                 128, 512)
    assert batch.num_prompts == 256
    full = br.plan_runs("single", prefill=True, long=True)
    assert [r.name for r in full][4:] == ["prefill-1024", "prefill-4096", "prefill-16384",
                                          "long-8192", "long-16384", "long-32768"]
    assert all(r.output_len == 1 and r.concurrency == 1 for r in full if r.section == "prefill")
    assert len({r.name for r in full}) == len(full)  # names key the report and the per-call cache salt
    with pytest.raises(ValueError, match="replay"):
        br.plan_runs("single", num_prompts=9)
    with pytest.raises(ValueError, match="single or batch"):
        br.plan_runs("both")


def test_bench_serve_args_parse_in_vllm(vllm_cli, tmp_path):
    c4 = br.plan_runs("single", cohorts=(4,))[0]
    args = br.bench_serve_args(c4, base_url="http://h:1", seed=11, cache_salt="tag-11-C4", result_dir=str(tmp_path),
                               prompts_file=str(PROMPTS), tokenizer="/models/x", ignore_eos=True, temperature=0.0)
    ns = vllm_cli.bench_serve(args)
    assert (ns.dataset_name, ns.dataset_path, ns.custom_output_len) == ("custom", str(PROMPTS), 1024)
    assert (ns.max_concurrency, ns.num_prompts, ns.seed, ns.request_rate) == (4, 8, 11, float("inf"))
    assert ns.extra_body == {"cache_salt": "tag-11-C4"}
    assert ns.chat_template_kwargs == {"enable_thinking": False}
    assert (ns.ignore_eos, ns.temperature, ns.tokenizer) == (True, 0.0, "/models/x")
    assert (ns.save_result, ns.result_dir, ns.result_filename) == (True, str(tmp_path), "C4.json")
    assert ns.base_url == "http://h:1" and ns.endpoint == "/v1/completions"
    assert ns.ready_check_timeout_sec == 0  # no request outside the /metrics window
    assert set(ns.percentile_metrics.split(",")) == {"ttft", "tpot", "itl", "e2el"}

    prefill = br.plan_runs("batch", prefill=True)[1]
    ns = vllm_cli.bench_serve(br.bench_serve_args(
        prefill, base_url="http://h:1", seed=12, cache_salt="s", result_dir=str(tmp_path), prompts_file=str(PROMPTS)))
    assert (ns.dataset_name, ns.random_input_len, ns.random_output_len, ns.max_concurrency) == ("random", 1024, 1, 1)
    assert ns.temperature is None and not ns.ignore_eos  # random datasets turn ignore_eos on inside vllm bench serve


def run_script(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **(env_extra or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_script_help_and_bad_arguments(tmp_path):
    help_ = run_script("--help")
    assert help_.returncode == 0
    assert "{single,batch}" in help_.stdout and "--prefill" in help_.stdout and "C x 1000 / mean TPOT" in help_.stdout
    bad = run_script("fast")
    assert bad.returncode == 2 and "invalid choice: 'fast'" in bad.stderr
    assert run_script().returncode == 2
    bad_tag = run_script("single", "--tag", "../x")
    assert bad_tag.returncode == 2 and "plain file name" in bad_tag.stderr
    bad_cohorts = run_script("batch", "--cohorts", "1,x")
    assert bad_cohorts.returncode == 2 and "comma-separated" in bad_cohorts.stderr
    too_many = run_script("single", "--num-prompts", "20", "--out", str(tmp_path))
    assert too_many.returncode == 2 and "replay" in too_many.stderr


def test_script_without_server_writes_nothing(tmp_path):
    res = run_script("single", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), "--tag", "t")
    assert res.returncode == 3
    assert "no usable vLLM server at http://127.0.0.1:9" in res.stderr
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "t.json").write_text("{}")
    again = run_script("single", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), "--tag", "t")
    assert again.returncode == 2 and "exists" in again.stderr
    assert (tmp_path / "t.json").read_text() == "{}"


class _FakeVllm(http.server.ThreadingHTTPServer):
    """Answers the read-only routes the harness asks a vLLM 0.28.0 server for (no /server_info: dev mode off)."""

    def __init__(self, metrics_text: str, api_key: str, on_completion=None):
        self.barrier: threading.Barrier | None = None
        fake = self
        routes = {
            "/version": json.dumps({"version": "0.28.0"}),
            "/v1/models": json.dumps({"object": "list", "data": [
                {"id": "qwen3.8-27b", "object": "model", "root": "/models/q", "max_model_len": 65536}]}),
            "/metrics": metrics_text,
        }

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = routes.get(self.path)
                authorized = self.path == "/metrics" or self.headers.get("Authorization") == f"Bearer {api_key}"
                code = 401 if not authorized else 200 if body is not None else 404
                data = (body if code == 200 else '{"detail":"Not Found"}').encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Authorization") != f"Bearer {api_key}":
                    code, data = 401, b'{"detail":"Unauthorized"}'
                elif self.path == "/v1/completions" and on_completion:
                    on_completion(body)
                    if fake.barrier:
                        fake.barrier.wait()  # raises BrokenBarrierError (no answer) unless the cohort came at once
                    code, data = 200, json.dumps({"choices": [{"text": " x"}]}).encode()
                else:
                    code, data = 404, b'{"detail":"Not Found"}'
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_server_facts_from_a_vllm_like_server():
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    server = _FakeVllm((REPO / "bench" / "fixtures" / "metrics_before.txt").read_text(), "k")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        facts = harness.server_facts(base, "k")
        with pytest.raises(serving.HttpError, match="HTTP 401"):
            harness.server_facts(base, "wrong")
    finally:
        server.shutdown()
        server.server_close()
    assert facts["vllm_version"] == "0.28.0"
    assert facts["model"] == {"id": "qwen3.8-27b", "root": "/models/q", "max_model_len": 65536}
    assert facts["cache_config"]["enable_prefix_caching"] == "True"
    assert facts["vllm_config"] is None and "VLLM_SERVER_DEV_MODE=1" in facts["vllm_config_note"]


def test_bench_serve_on_a_keyed_server_gets_the_model_from_us(monkeypatch, tmp_path, vllm_cli):
    """vllm bench serve looks the model up without the key (visit 16: real_rep and prefill_ab died on a 401), so the
    harness looks it up with the key and hands vllm bench serve the id and root."""
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    server = _FakeVllm("", "k")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["argv"], seen["key"] = cmd[cmd.index("serve") + 1:], kwargs["env"].get("OPENAI_API_KEY")
        (tmp_path / "C1.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        args = harness.parse_args(["single", "--tag", "t", "--out", str(tmp_path)])
        (c1,) = br.plan_runs("single", cohorts=(1,))
        assert harness.bench_serve(c1, args, base, "k", 7, "s", str(tmp_path)) == {}
        with pytest.raises(serving.HttpError, match="HTTP 401"):
            harness.bench_serve(c1, args, base, None, 7, "s", str(tmp_path))
    finally:
        server.shutdown()
        server.server_close()
    ns = vllm_cli.bench_serve(seen["argv"])
    assert (ns.model, ns.served_model_name, seen["key"]) == ("/models/q", "qwen3.8-27b", "k")


def test_warmup_call_precedes_each_run_outside_its_metrics_window(monkeypatch, tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    fixtures = REPO / "bench" / "fixtures"
    pages = iter([(fixtures / "metrics_before.txt").read_text(), (fixtures / "metrics_after.txt").read_text()])
    raw = json.loads((fixtures / "vllm_bench_serve_C1.json").read_text())
    events: list[tuple] = []

    def fake_bench_serve(run, args, base, key, seed, salt, workdir):
        events.append(("bench", run, seed, salt))
        return raw

    def fake_metrics(base, key):
        events.append(("metrics",))
        return br.snapshot(next(pages))

    monkeypatch.setattr(harness, "bench_serve", fake_bench_serve)
    monkeypatch.setattr(harness, "metrics", fake_metrics)
    monkeypatch.setattr(harness, "warm_up", lambda spec, args, base, key, seed, salt: events.append(
        ("warm", spec, seed, salt)))
    args = harness.parse_args(["batch", "--tag", "t", "--out", str(tmp_path)])
    (c64,) = br.plan_runs("batch")
    fig = harness.run_one(c64, args, "http://h:1", None, 7, str(tmp_path))
    assert [e[0] for e in events] == ["warm", "metrics", "bench", "metrics"]  # warm-up, then the measured window
    _, warm, warm_seed, warm_salt = events[0]
    _, measured, seed, salt = events[2]
    assert measured == c64 and seed == 7 and salt == "t-7-C64" == fig["cache_salt"]
    # the same shapes (64 at a time, 128-token prompts), short answers, its own seed and salt
    assert (warm.concurrency, warm.num_prompts, warm.input_len, warm.dataset) == (64, 64, 128, "random")
    assert warm.output_len == br.WARMUP_OUTPUT_LEN and warm_seed != seed and warm_salt != salt
    assert {k: fig["warmup"][k] for k in ("num_prompts", "output_len", "seed")} == {
        "num_prompts": 64, "output_len": br.WARMUP_OUTPUT_LEN, "seed": warm_seed}

    prefill = br.warmup_run(br.plan_runs("single", prefill=True)[4])
    assert (prefill.num_prompts, prefill.output_len, prefill.input_len) == (1, 1, 1024)

    events.clear()
    pages = iter([(fixtures / "metrics_before.txt").read_text(), (fixtures / "metrics_after.txt").read_text()])
    no_warm = harness.parse_args(["batch", "--no-warmup", "--tag", "t", "--out", str(tmp_path)])
    fig = harness.run_one(c64, no_warm, "http://h:1", None, 7, str(tmp_path))
    assert [e[0] for e in events] == ["metrics", "bench", "metrics"] and fig["warmup"] is None


def test_warmup_sends_the_runs_shapes_at_once_over_http(tmp_path):
    """The warm-up's requests reach the server together (a barrier the size of the cohort lets none of them
    answer before all have arrived), with the run's prompt length, short answers and the warm-up's own salt."""
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    bodies: list[dict] = []
    server = _FakeVllm((REPO / "bench" / "fixtures" / "metrics_before.txt").read_text(), "k", bodies.append)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        args = harness.parse_args(["batch", "--tag", "t", "--out", str(tmp_path), "--ignore-eos"])
        server.barrier = threading.Barrier(8, timeout=20)
        spec = br.warmup_run(br.plan_runs("batch", cohorts=(8,))[0])
        harness.warm_up(spec, args, base, "k", 11, "salt-w")
        random_bodies = list(bodies)
        bodies.clear()
        server.barrier = threading.Barrier(2, timeout=20)
        single = harness.parse_args(["single", "--tag", "t", "--out", str(tmp_path), "--temperature", "0"])
        harness.warm_up(br.warmup_run(br.plan_runs("single", cohorts=(2,))[0]), single, base, "k", 11, "s2")
        with pytest.raises(serving.HttpError, match="HTTP 401"):
            harness.warm_up(spec, args, base, "wrong", 11, "salt-w")
    finally:
        server.shutdown()
        server.server_close()
    assert len(random_bodies) == 8 and len({json.dumps(b["prompt"]) for b in random_bodies}) == 8
    assert all(len(b["prompt"]) == 128 and all(t in harness.WARMUP_TOKEN_IDS for t in b["prompt"])
               for b in random_bodies)
    assert {(b["model"], b["max_tokens"], b["cache_salt"], b["ignore_eos"]) for b in random_bodies} == {
        ("qwen3.8-27b", br.WARMUP_OUTPUT_LEN, "salt-w", True)}
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    assert len(bodies) == 2 and all(b["prompt"] in texts and b["temperature"] == 0 for b in bodies)
    assert bodies[0]["prompt"] != bodies[1]["prompt"] and "ignore_eos" not in bodies[0]


def test_a_stopped_harness_keeps_what_it_measured(monkeypatch, tmp_path):
    """On the H200 a visit's device time ran out inside a harness call, and every figure it had measured was
    lost with it: the report is now written after each run, naming the runs still to come."""
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    fixtures = REPO / "bench" / "fixtures"
    raw = json.loads((fixtures / "vllm_bench_serve_C1.json").read_text())
    pages = itertools.cycle([(fixtures / "metrics_before.txt").read_text(),
                             (fixtures / "metrics_after.txt").read_text()])
    calls = []

    def fake_bench_serve(run, args, base, key, seed, salt, workdir):
        calls.append(run.name)
        if len(calls) > 1:
            raise KeyboardInterrupt  # the visit ends: nothing after this line runs
        return raw

    monkeypatch.setattr(harness, "bench_serve", fake_bench_serve)
    monkeypatch.setattr(harness, "metrics", lambda base, key: br.snapshot(next(pages)))
    monkeypatch.setattr(harness, "warm_up", lambda *a: None)
    monkeypatch.setattr(harness, "server_facts", lambda base, key: {
        "url": base, "vllm_version": "0.28.0", "model": {"id": "m", "root": "/m", "max_model_len": 65536},
        "cache_config": {}, "vllm_config": None})
    argv = ["single", "--cohorts", "1,2,4", "--num-prompts", "1", "--tag", "t", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        harness.main(argv)
    report = json.loads((tmp_path / "t.json").read_text())
    assert list(report["cohorts"]) == ["C1"] and calls == ["C1", "C2"]
    assert "unfinished: C2, C4 (the harness stopped before them)" in report["notes"]
    assert not list(tmp_path.glob("*.tmp*"))
