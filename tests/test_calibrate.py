"""Calibrating the MTP draft head against a fake OpenAI server on loopback: the bundled prompt set, resumable
counts, the counting proxy, and the whole calibrate.sh flow on the tiny synthetic checkpoint (count -> build
the head -> the plan serves it: no build step left, VLLM_MTP_DRAFT_VOCAB=1)."""

from __future__ import annotations

import hashlib
import http.server
import importlib.util
import json
import shutil
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from bench import serving
from qwen_serving import knobs, plan
from qwen_serving.checkpoint import draft_vocab
from tests.helpers.fake_http import send_json
from tests.helpers.tiny_checkpoint import make_tiny

REPO = Path(__file__).resolve().parents[1]
VOCAB = 4096  # the tiny synthetic checkpoint's


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "prepare" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there; calibrate imports count_outputs by name
    spec.loader.exec_module(module)
    return module


count_outputs = _load("count_outputs")
calibrate = _load("calibrate")


def reply_ids(body: dict) -> list[int]:
    """What the fake model generates for a request: a function of the prompt and the seed (Zipf-ish ids)."""
    text = json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True) + str(body.get("seed"))
    h = int(hashlib.sha256(text.encode()).hexdigest(), 16)
    return [((h >> (j % 200)) % (40 + 40 * (j % 5))) * 7 % VOCAB for j in range(5 + h % 20)]


class FakeServer(http.server.ThreadingHTTPServer):
    """/v1/models and chat/completions with vLLM's return_token_ids, streaming or not; records every body."""

    def __init__(self):
        self.seen: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                send_json(self, {"data": [{"id": "qwen3.8-27b"}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body["_auth"] = self.headers.get("Authorization")
                fake.seen.append(body)
                ids = reply_ids(body)
                with_ids = lambda part: {"token_ids": part} if body.get("return_token_ids") else {}  # noqa: E731
                if not body.get("stream"):
                    send_json(self, {"choices": [{"message": {"content": "x"}, **with_ids(ids)}], "prompt_token_ids": [1]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for part in (ids[:3], ids[3:]):
                    chunk = {"choices": [{"delta": {"content": "x"}, **with_ids(part)}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


@pytest.fixture
def server():
    fake = FakeServer()
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.shutdown()
    thread.join()
    fake.server_close()


def test_the_bundled_prompt_set_is_mixed():
    prompts = count_outputs.load_prompts(count_outputs.PROMPT_SET)
    assert 300 <= len(prompts) <= 1000 and count_outputs.PROMPT_SET.stat().st_size < 200_000
    users = [p["messages"][-1]["content"] for p in prompts]
    assert len(set(users)) == len(users) and not any("{" in u and "}" in u and "{}" not in u for u in users[:50])
    first = prompts[:40]  # interleaved: any prefix holds every kind
    assert any("tools" in p for p in first) and any("Forklar" in p["messages"][-1]["content"] for p in first)
    assert any("function" in p["messages"][-1]["content"] for p in first)
    tools = {t["function"]["name"] for p in prompts for t in p.get("tools", ())}
    assert {"get_weather", "search_web", "run_python", "send_email"} <= tools
    assert count_outputs.DEFAULT_TOKENS == 900_000 <= 1035 * 15 * 60  # the spec's batch rate, 15 minutes


def run_count(server, out: Path, budget: int, **kw) -> object:
    client = serving.Client(server.url, "k")
    prompts = [{"messages": [{"role": "user", "content": f"prompt {i}"}]} for i in range(7)]
    meta = {"model": "m", "source": "test"}
    tally = count_outputs.Tally.load(out, meta)
    return count_outputs.count(client, prompts, {"model": "m"}, tally, budget=budget, concurrency=kw.pop("concurrency", 1),
                               holdout_every=3, save=lambda t: t.save(out), **kw)


def expected(n_requests: int) -> tuple[Counter, Counter]:
    counts, held = Counter(), Counter()
    for i in range(n_requests):
        body = {"messages": [{"role": "user", "content": f"prompt {i % 7}"}], "seed": i // 7}
        (held if i % 7 % 3 == 2 else counts).update(reply_ids(body))
    return counts, held


def test_counts_are_the_servers_own_outputs_and_hold_out_prompts(server, tmp_path):
    tally = run_count(server, tmp_path / "c.json", 400, concurrency=4)
    assert tally.tokens() >= 400 and (tally.counts, tally.holdout) == expected(tally.requests)
    assert all(b["return_token_ids"] and b["_auth"] == "Bearer k" for b in server.seen)
    saved = draft_vocab.read_counts([tmp_path / "c.json"]), draft_vocab.read_counts([tmp_path / "c.json"], "holdout")
    assert saved == (tally.counts, tally.holdout)


def test_an_interrupted_count_continues_where_it_stopped(server, tmp_path):
    fresh = run_count(server, tmp_path / "fresh.json", 600)
    out = tmp_path / "c.json"
    seen = []

    def interrupt(t):
        seen.append(t.requests)
        if t.requests == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_count(server, out, 600, save_every=4, progress=interrupt)
    saved = json.loads(out.read_text())
    assert saved["requests"] == 8  # the last save before the interruption: whole requests, in order
    before = len(server.seen)
    again = run_count(server, out, 600, save_every=4)
    first_again = server.seen[before]
    assert first_again["messages"][0]["content"] == "prompt 1" and first_again["seed"] == 1  # request 8 = 7 + 1
    assert (again.counts, again.holdout, again.requests) == (fresh.counts, fresh.holdout, fresh.requests)


def test_counts_of_another_model_are_not_mixed_in(server, tmp_path):
    run_count(server, tmp_path / "c.json", 50)
    with pytest.raises(ValueError, match="delete it to start over"):
        count_outputs.Tally.load(tmp_path / "c.json", {"model": "other", "source": "test"})


def test_the_proxy_counts_the_users_own_traffic(server, tmp_path):
    out = tmp_path / "traffic.json"
    tally = count_outputs.Tally(meta={"model": "m", "source": "proxy"})
    proxy = count_outputs.proxy(0, serving.Client(server.url, None), tally, lambda t: t.save(out), holdout_every=0,
                                save_every=1)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        user = serving.Client(f"http://127.0.0.1:{proxy.server_address[1]}", "users-key")
        assert user.served_model() == "qwen3.8-27b"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        plain = user.post_json("/v1/chat/completions", chat)
        assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain  # not asked: stripped
        asked = user.post_json("/v1/chat/completions", {**chat, "return_token_ids": True})
        assert asked["choices"][0]["token_ids"] == reply_ids({**chat, "return_token_ids": True})
        events = list(user.post_events("/v1/chat/completions", {**chat, "stream": True}))
        assert events[-1][1] == serving.SSE_DONE and all("token_ids" not in e[1]["choices"][0] for e in events[:-1])
    finally:
        proxy.shutdown()
        thread.join()
        proxy.server_close()
    assert all(b["return_token_ids"] and b["_auth"] == "Bearer users-key" for b in server.seen if "messages" in b)
    want = Counter()
    for b in server.seen:
        want.update(reply_ids(b))
    assert tally.requests == 3 and tally.counts == want and draft_vocab.read_counts([out]) == want


@pytest.fixture
def checkout(tmp_path_factory, tmp_path) -> Path:
    """A checkout whose served checkpoint (MODEL=auto: the fast variant) is the tiny synthetic one, no draft head."""
    repo = tmp_path / "checkout"
    shutil.copytree(make_tiny(tmp_path_factory), repo / knobs.FAST_MODEL)
    return repo


def test_calibrate_builds_the_head_the_plan_then_serves(server, checkout, capfd):
    env = {"PORT": str(server.server_address[1])}
    before = plan.build("single", env, plan.Probe(repo=checkout))
    assert before.env["VLLM_MTP_DRAFT_VOCAB"] == "0" and before.served == knobs.FAST_MODEL
    rc = calibrate.main(["--tokens", "2000", "--k", "64", "--concurrency", "4", "--save-every", "5"], env=env,
                        repo=checkout)
    out = capfd.readouterr()
    assert rc == 0, out.err
    assert "held-out coverage" in out.out and "Restart the server" in out.out
    counts_file = checkout / calibrate.COUNTS
    counted = draft_vocab.read_counts([counts_file])
    assert sum(counted.values()) + sum(draft_vocab.read_counts([counts_file], "holdout").values()) >= 2000
    ids = json.loads((checkout / knobs.DRAFT_IDS).read_text())["ids"]
    model = checkout / knobs.FAST_MODEL
    config = json.loads((model / "config.json").read_text())
    stop = draft_vocab.stop_ids(config, json.loads((model / "generation_config.json").read_text()))
    assert ids == draft_vocab.top_k_ids(counted, 64, always=stop)  # the most frequent, and the end of turn
    after = plan.build("single", env, plan.Probe(repo=checkout))
    assert not [s for s in after.missing if "build_draft_vocab" in s.command]
    assert after.env["VLLM_MTP_DRAFT_VOCAB"] == "1"
    assert config["draft_vocab"]["size"] == len(ids) == 64
    # the bundled set, from its start (in any order: four requests are in flight at once)
    first = count_outputs.load_prompts(count_outputs.PROMPT_SET)[:len(server.seen)]
    assert sorted(json.dumps(b["messages"]) for b in server.seen) == sorted(json.dumps(p["messages"]) for p in first)


def test_calibrate_without_a_server_says_to_start_it(checkout, capsys):
    env = {"PORT": str(serving.free_port())}
    assert calibrate.main(["--tokens", "10"], env=env, repo=checkout) == 2
    assert "start it first" in capsys.readouterr().err
