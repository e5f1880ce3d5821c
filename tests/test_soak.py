"""bench/soak.py against a fake vLLM in a child process (tests/helpers/soak_server.py): a clean server passes every
criterion, and a server that answers tool calls with 500, keeps a seat, or whose engine dies midway is caught by
the criterion that names it; the request mix is seeded and bounded; only loopback URLs are accepted."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import serving, soak

REPO = Path(__file__).resolve().parents[1]
FACTS = soak.ServerFacts("fake", 512, has_key=True)


class FakeServer:
    def __init__(self, tmp_path: Path, *flags: str):
        self.port = serving.free_port()
        self.log = tmp_path / "server.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.soak_server", "--port", str(self.port),
                                      "--log", str(self.log), *flags], cwd=REPO)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while serving.probe(self.url + "/health", timeout_s=2)[0] != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def fake(tmp_path):
    servers = []

    def start(*flags):
        servers.append(FakeServer(tmp_path, *flags))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def options(**overrides) -> soak.Options:
    base = dict(n=80, seed=0, concurrency=(1, 4, 8), max_tokens=16, max_seconds=60, request_timeout_s=20,
                settle_s=3, health_every_s=0.1)
    return soak.Options(**{**base, **overrides})


def run(server: FakeServer, key: str | None = "k", **overrides) -> dict:
    return soak.run_soak(server.url, key, options(server_log=server.log, **overrides))


def test_a_clean_server_passes_every_criterion(fake):
    server = fake("--key", "k")
    result = run(server, n=120, seed=0)  # 120 draws of seed 0 reach every kind
    assert result["passed"], json.dumps(result["criteria"], indent=1)
    assert result["pid"] == server.proc.pid  # found from the listening socket
    assert result["api_key_set"] and result["max_model_len"] == 512
    kinds = result["kinds"]
    assert len(kinds) == len(soak.KINDS) and sum(k["count"] for k in kinds.values()) == 120 and result["not_run"] == 0
    # the bad kinds got their 4xx, the good ones 200, a cancel either
    assert set(kinds["wrong_key"]["statuses"]) == {"401"} and set(kinds["over_context"]["statuses"]) == {"400"}
    assert set(kinds["malformed_json"]["statuses"]) == {"400"} and set(kinds["chat_stream"]["statuses"]) == {"200"}
    for bad in ("max_tokens_over", "bad_tool_choice", "bad_schema", "empty_messages", "anthropic_bad"):
        assert set(kinds[bad]["statuses"]) == {"400"}, (bad, kinds[bad])
    assert set(kinds["cancel"]["statuses"]) <= {"200", "cancelled"}
    assert all(k["p50_s"] <= k["p99_s"] for k in kinds.values())
    assert result["seats"] == {"before": 0, "after": 0} and result["kv_blocks"]["num_gpu_blocks"] == 64
    assert result["log"] == {"death_lines": 0, "deaths_first": [], "restarts": 0}
    assert isinstance(result["rss"]["drift"], float) and result["health"]["checks"] >= 2
    # this fake has no allocator figures to give (its /collective_rpc is no dev route): recorded, and still a pass
    assert result["allocator"]["end"]["available"] is False and result["allocator"]["summary"] is None


def test_5xx_answers_are_caught_with_their_body(fake):
    result = run(fake("--key", "k", "--fail-tools"))
    criteria = result["criteria"]
    assert not result["passed"] and not criteria["no_5xx"]["passed"]
    tool_requests = result["kinds"]["tool_auto"]["count"] + result["kinds"]["tool_forced"]["count"]
    assert criteria["no_5xx"]["value"] == len(result["server_errors"]) == tool_requests > 0
    assert all(e["kind"].startswith("tool_") and "KeyError" in e["body"] for e in result["server_errors"])
    assert criteria["no_engine_death"]["passed"] and criteria["no_leaked_seats"]["passed"]


def test_a_server_without_tool_calling_is_named_not_failed(fake):
    result = run(fake("--key", "k", "--no-tools"))
    assert result["passed"], json.dumps(result["criteria"], indent=1)
    assert set(result["kinds"]["tool_forced"]["statuses"]) == {"no_tool_parser"}


def test_a_leaked_seat_and_its_blocks_are_caught(fake):
    result = run(fake("--key", "k", "--leak-after", "30"))
    assert result["seats"] == {"before": 0, "after": 1}
    assert result["criteria"]["no_leaked_seats"]["value"] == 1
    assert result["criteria"]["no_leaked_blocks"]["value"] == 2  # the fake holds 2 blocks per seat
    assert not result["criteria"]["no_leaked_blocks"]["passed"] and not result["passed"]
    assert result["criteria"]["no_5xx"]["passed"]


def test_an_engine_death_midway_is_caught_by_health_and_log(fake):
    result = run(fake("--key", "k", "--die-after", "50"))
    death = result["criteria"]["no_engine_death"]
    assert not death["passed"] and result["health"]["deaths"] == 1
    assert result["log"]["death_lines"] >= 1 and "EngineDeadError" in "".join(result["log"]["deaths_first"])
    assert result["server_errors"] and not result["passed"]
    assert not result["stream_errors"]  # a 500 before a stream starts is one server error, not a stream error too


def test_an_error_event_inside_a_200_stream_counts_as_a_5xx(fake):
    result = run(fake("--key", "k", "--stream-error"))
    streamed = result["kinds"]["chat_stream"]["count"] + result["kinds"]["completion_stream"]["count"]
    assert {e["kind"] for e in result["stream_errors"]} <= {"chat_stream", "completion_stream", "disconnect"}
    assert len(result["stream_errors"]) >= streamed > 0 and not result["server_errors"]
    assert all(e["status"] == 200 and "Internal server error" in e["stream_error"] for e in result["stream_errors"])
    assert not result["criteria"]["no_5xx"]["passed"] and result["criteria"]["no_engine_death"]["passed"]


def test_a_server_that_vanishes_is_a_death_and_no_answers(fake):
    server = fake()
    threading.Timer(1.0, server.proc.kill).start()
    result = soak.run_soak(server.url, None, options(n=400, concurrency=(1,)))
    assert not result["criteria"]["no_engine_death"]["passed"]
    assert any("no_answer" in k["statuses"] for k in result["kinds"].values())
    assert result["rss"]["end"] is None and not result["criteria"]["rss_drift_under_5pct"]["passed"]


def test_the_plan_is_seeded_bounded_and_mixed():
    a = soak.build_plan(FACTS, 300, 7, (1, 2, 4), 16)
    assert soak.plan_digest(a) == soak.plan_digest(soak.build_plan(FACTS, 300, 7, (1, 2, 4), 16))
    assert soak.plan_digest(a) != soak.plan_digest(soak.build_plan(FACTS, 300, 8, (1, 2, 4), 16))
    requests = [r for wave in a for r in wave.requests]
    assert [r.index for r in requests] == list(range(300))
    assert {w.concurrency for w in a} == {1, 2, 4} and all(len(w.requests) <= 4 * w.concurrency for w in a)
    assert len({r.kind for r in requests}) == len(soak.KINDS)  # 300 draws reach every kind
    long = [r for r in requests if r.kind == "long_prompt"]
    assert all(FACTS.max_model_len - 48 <= len(r.body["prompt"]) < FACTS.max_model_len for r in long)
    over = [r for r in requests if r.kind == "over_context"]
    assert over and all(len(r.body["prompt"]) > FACTS.max_model_len for r in over)


def test_the_bad_kinds_send_what_they_are_named_for():
    requests = [r for w in soak.build_plan(FACTS, 400, 2, (4,), 16) for r in w.requests]
    for r in (r for r in requests if r.kind == "bad_tool_choice"):
        assert {k: r.body[k] for k in ("tool_choice", "tools") if k in r.body} in soak.BAD_TOOL_CHOICES
    assert {json.dumps(r.body["response_format"]["json_schema"]["schema"]) for r in requests
            if r.kind == "bad_schema"} == {json.dumps(s) for s in soak.BAD_SCHEMAS}
    empty = [r for r in requests if r.kind == "empty_messages"]
    assert {r.path for r in empty} == {"/v1/chat/completions", "/v1/messages"} and all(
        r.body["messages"] == [] for r in empty)
    over = [r for r in requests if r.kind == "max_tokens_over"]
    assert over and all(r.body["max_tokens"] > FACTS.max_model_len for r in over)
    assert any(r.body.get("tool_choice") == {"type": "any"} and "tools" not in r.body
               for r in requests if r.kind == "anthropic_bad")


def test_auth_kinds_need_a_key_and_weights_pick_kinds():
    unkeyed = soak.ServerFacts("fake", 512, has_key=False)
    kinds = {r.kind for w in soak.build_plan(unkeyed, 400, 1, (4,), 8) for r in w.requests}
    assert "wrong_key" not in kinds and "missing_key" not in kinds
    weights = soak.parse_weights("chat=1," + ",".join(f"{k}=0" for k in soak.KINDS if k != "chat"))
    assert {r.kind for w in soak.build_plan(FACTS, 50, 1, (4,), 8, weights) for r in w.requests} == {"chat"}
    with pytest.raises(soak.SoakError, match="KIND=WEIGHT"):
        soak.parse_weights("nonsense=3")


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_only_loopback_urls(url):
    with pytest.raises(soak.SoakError, match="loopback"):
        soak.require_loopback(url)
    res = subprocess.run([sys.executable, "-m", "bench.soak", "--url", url, "--n", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "loopback" in res.stderr


def test_cli_writes_json_and_markdown(fake, tmp_path):
    server = fake()
    out, table = tmp_path / "soak.json", tmp_path / "soak.md"
    res = subprocess.run([sys.executable, "-m", "bench.soak", "--url", server.url, "--n", "40", "--seed", "1",
                          "--concurrency", "2,4", "--settle", "2", "--json", str(out), "--markdown", str(table)],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_API_KEY": ""})
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert result["n"] == 40 and result["passed"] and "soak PASSED" in res.stdout
    assert table.read_text().startswith("| kind | requests |") and "| no_5xx" in table.read_text()
    assert "40/40" in res.stderr  # the progress line


def test_process_tree_rss_sums_the_children(tmp_path):
    for pid, ppid, kb in ((10, 1, 100), (11, 10, 50), (12, 11, 25), (13, 1, 999)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nPPid:\t{ppid}\nVmRSS:\t {kb} kB\n")
    assert soak.process_tree_rss(10, tmp_path) == {"pids": [10, 11, 12], "bytes": 175 * 1024}
    assert soak.process_tree_rss(99, tmp_path) is None


def test_log_events_counts_deaths_and_restarts():
    text = ("INFO ok\nERROR EngineCore encountered a fatal error.\n"
            "INFO vLLM API server version 0.28.0\nRuntimeError: CUDA error: an illegal memory access\n")
    events = soak.log_events(text)
    assert events["death_lines"] == 2 and events["restarts"] == 1


def test_answers_are_checked_where_any_weights_must_get_them_right():
    forced = soak.Request(0, "tool_forced", "/v1/chat/completions", body={})

    def chat(message, finish="stop"):
        return json.dumps({"choices": [{"message": message, "finish_reason": finish}]})

    call = {"tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Aarhus"}'}}]}
    assert soak.answer_problem(forced, chat(call)) == ""
    wrong = {"tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert "forced call" in soak.answer_problem(forced, chat(wrong))
    assert soak.answer_problem(forced, chat({"tool_calls": []}, "length")) == ""  # cut: nothing to check
    structured = soak.Request(0, "structured", "/v1/chat/completions", body={})
    assert "outside the schema" in soak.answer_problem(structured, chat({"content": '{"city": "Odense"}'}))
    assert "unreadable" in soak.answer_problem(structured, chat({"content": "not json"}))


def test_the_gpu_visit_runner_bounds_the_soak_by_its_budget(fake, tmp_path):
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    import soak_visit

    server = fake("--key", "k")
    out = tmp_path / "soak-batch.json"
    out.write_text('{"stale": true}')
    rc = soak_visit.main(["--url", server.url, "--out", str(out), "--mode", "batch", "--api-key", "k", "--n", "60",
                          "--budget-s", "200", "--server-log", str(server.log)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["mode"] == "batch" and result["passed"] and "stale" not in result
    assert out.with_suffix(".md").read_text().startswith("| kind |")
    argv = soak_visit.soak_argv(soak_visit.argparse.Namespace(
        url="u", n=1000, seed=0, budget_s=360, api_key=None, pid=None, server_log=None), out)
    assert argv[argv.index("--max-seconds") + 1] == "200" and "--api-key" not in argv
    assert argv[argv.index("--request-timeout") + 1] == "120"
    with pytest.raises(SystemExit, match="need >= 30"):
        soak_visit.main(["--url", server.url, "--out", str(out), "--budget-s", "180"])


def test_the_preemptions_during_the_soak_are_read_from_the_metrics_page():
    page = ('vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} 0\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.0\n'
            'vllm:cache_config_info{engine="0",num_gpu_blocks="237"} 1\n')
    client = argparse.Namespace(get_text=lambda path, timeout_s: page + 'vllm:num_preemptions_total{engine="0"} 7\n')
    assert soak.metrics_state(client)["preemptions"] == 7
    assert soak.metrics_state(argparse.Namespace(get_text=lambda path, timeout_s: page))["preemptions"] is None


# ---------------------------------------------------------------------------------------------
# The engine's allocator figures over POST /collective_rpc (worker-memory-stats.patch; recorded, never judged)

MiB = 1 << 20


class RpcServer:
    """tests/helpers/soak_server.py's fake vLLM in a thread of this process, with vLLM's dev route POST
    /collective_rpc (unguarded by the API key, as vLLM's is) answered three ways: "patched" runs the patched
    worker's qs_memory_stats on a little allocator model (1 MiB more allocated per request served, a start-up peak
    above it all, the peaks reset by args ["1"]); "unpatched" as a VLLM_SERVER_DEV_MODE=1 server without the patch (500, run_method's
    NotImplementedError); "no-dev-mode" as a server without the dev routes (404)."""

    def __init__(self, mode: str):
        from tests.helpers import soak_server
        from tests.helpers.fake_http import send_json

        state = soak_server.State(argparse.Namespace(key="k", no_tools=False, fail_tools=False, stream_error=False,
                                                     leak_after=0, die_after=0, log=None))
        self.calls: list[dict] = []
        self.answers: list[dict] = []  # what each patched answer said
        self.peak = 9000 * MiB  # the engine's start-up peak (the profile run's): what a reset must clear
        server = self

        class Handler(soak_server.make_handler(state)):
            def do_POST(self):  # noqa: N802
                if self.path != "/collective_rpc":
                    return super().do_POST()
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                server.calls.append(body)
                if mode == "no-dev-mode":
                    return send_json(self, {"detail": "Not Found"}, 404)
                if mode == "unpatched" or body.get("method") != "qs_memory_stats":
                    return send_json(self, {"error": {"message": "Call to collective_rpc method failed: Method "
                                                      f"{body.get('method')!r} is not implemented.", "code": 500}}, 500)
                with state.lock:
                    allocated = (1000 + state.requests) * MiB
                server.peak = max(server.peak, allocated)
                stats = {"device": "cuda:0", "allocated_bytes": allocated, "reserved_bytes": 4000 * MiB,
                         "cached_bytes": 4000 * MiB - allocated, "peak_allocated_bytes": server.peak,
                         "peak_reserved_bytes": 4500 * MiB, "num_alloc_retries": 2 + len(server.calls),
                         "num_ooms": 0, "device_free_bytes": 20000 * MiB, "device_total_bytes": 24000 * MiB,
                         "peak_reset": body.get("args") == ["1"]}
                if body.get("args") == ["1"]:
                    server.peak = allocated
                server.answers.append(stats)
                send_json(self, {"results": [stats]})

        self.httpd = soak_server.WideBacklog(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def rpc_server():
    servers = []

    def start(mode):
        servers.append(RpcServer(mode))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


CRITERIA = {"no_5xx", "no_engine_death", "no_leaked_seats", "no_leaked_blocks", "rss_drift_under_5pct",
            "expected_answers"}


def test_the_engines_allocator_figures_at_start_warmup_and_end(rpc_server):
    server = rpc_server("patched")
    result = soak.run_soak(server.url, "k", options(n=60, pid=os.getpid()))
    # asked three times, the peaks reset once: after the warm-up, so the end's peak is the soak's own
    assert [c["method"] for c in server.calls] == ["qs_memory_stats"] * 3
    assert [c["args"] for c in server.calls] == [["0"], ["1"], ["0"]]
    allocator = result["allocator"]
    assert allocator["method"] == "qs_memory_stats"
    start, warm, end = allocator["start"], allocator["after_warmup"], allocator["end"]
    assert start["available"] and warm["available"] and end["available"]
    assert warm["peak_reset"] and not start["peak_reset"] and not end["peak_reset"]
    assert [start["workers"], warm["workers"], end["workers"]] == [[a] for a in server.answers]
    assert start["workers"][0]["allocated_bytes"] == 1000 * MiB  # nothing served before the first call
    served = end["workers"][0]["allocated_bytes"] // MiB - 1000
    assert served > warm["workers"][0]["allocated_bytes"] // MiB - 1000 > 0  # the warm-up, then the rest
    assert start["workers"][0]["peak_allocated_bytes"] == warm["workers"][0]["peak_allocated_bytes"] == 9000 * MiB
    summary = allocator["summary"]
    assert summary == {"workers": 1, "allocated_mib": 1000 + served, "reserved_mib": 4000,
                       "cached_mib": 3000 - served, "peak_allocated_mib": 1000 + served, "peak_reserved_mib": 4500,
                       "peak_since": "after_warmup", "alloc_retries": 2, "ooms": 0, "counted_from": "start"}
    # recorded, not judged: no criterion of its own
    assert set(result["criteria"]) == CRITERIA
    line = [x for x in soak.markdown(result).splitlines() if x.startswith("engine allocator")]
    assert line == [f"engine allocator at the end (worker 0): {1000 + served:,} MiB allocated, 4,000 MiB reserved "
                    f"({3000 - served:,} MiB kept by the cache); peak since the warm-up {1000 + served:,} MiB "
                    "allocated / 4,500 MiB reserved; 2 allocation retries and 0 OOMs during the soak (recorded, not "
                    "judged)"]


@pytest.mark.parametrize("mode, reason", [("no-dev-mode", "without VLLM_SERVER_DEV_MODE=1"),
                                          ("unpatched", "worker-memory-stats.patch not applied")])
def test_a_server_without_the_figures_is_recorded_not_failed(rpc_server, mode, reason):
    server = rpc_server(mode)
    result = soak.run_soak(server.url, "k", options(n=40, pid=os.getpid()))
    allocator = result["allocator"]
    for when in ("start", "after_warmup", "end"):
        assert allocator[when]["available"] is False and reason in allocator[when]["reason"], allocator[when]
    assert allocator["summary"] is None and set(result["criteria"]) == CRITERIA
    assert result["criteria"]["no_5xx"]["passed"] and result["criteria"]["expected_answers"]["passed"]
    assert not result["server_errors"]  # the probe's own 500 is not one of the soak's answers
    line = [x for x in soak.markdown(result).splitlines() if x.startswith("engine allocator")]
    assert len(line) == 1 and "unavailable" in line[0] and reason in line[0]


def test_an_answer_without_figures_is_unavailable():
    client = serving.Client("http://127.0.0.1:9")  # nothing listens on the discard port
    record = soak.allocator_stats(client, timeout_s=2)
    assert record["available"] is False and record["reason"].startswith("no answer")
