"""Draft vocabulary: top-K choice and coverage, output counting against a server, the draft head."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from qwen_serving.checkpoint import ct_config, draft_vocab
from qwen_serving.checkpoint.model_dir import ModelDir
from qwen_serving.checkpoint.steps import DRAFT_HEAD
from tests.helpers.fake_http import send_json
from tests.helpers.tiny_checkpoint import EPOCH, REPO, load_check, make_tiny, run, tree_state


def test_top_k_and_coverage_on_a_small_known_distribution():
    counts = Counter({1: 50, 2: 30, 3: 15, 4: 5, 7: 15})
    assert draft_vocab.top_k_ids(counts, 2) == [1, 2]
    assert draft_vocab.top_k_ids(counts, 3) == [1, 2, 3]  # 3 and 7 tie: the lower id wins
    assert draft_vocab.top_k_ids(counts, 3, always=[9]) == [1, 2, 9]
    assert draft_vocab.coverage([1, 2], counts) == pytest.approx(80 / 115)
    held = Counter({1: 10, 3: 10, 8: 5})
    assert draft_vocab.coverage([1, 2], held) == pytest.approx(10 / 25)
    with pytest.raises(ValueError):
        draft_vocab.coverage([1], Counter())


def test_held_out_coverage_matches_the_true_mass():
    """Tokens drawn from a known Zipf law: the top-K list chosen on one sample covers the true
    top-K probability mass on another."""
    vocab, k = 5000, 400
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    p /= p.sum()
    rng = np.random.default_rng(0)
    perm = rng.permutation(vocab)  # frequent tokens are not the low ids
    sample = lambda n: Counter(perm[rng.choice(vocab, size=n, p=p)].tolist())  # noqa: E731
    train, held = sample(200_000), sample(50_000)
    ids = draft_vocab.top_k_ids(train, k)
    true_mass = p[:k].sum()
    assert draft_vocab.coverage(ids, held) == pytest.approx(true_mass, abs=0.01)
    assert len(set(ids) & set(perm[:k].tolist())) > 0.9 * k


class _FakeServer(BaseHTTPRequestHandler):
    """Answers chat/completions with token ids derived from the prompt; records what it got."""

    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body["_auth"] = self.headers.get("Authorization")
        body["_path"] = self.path
        _FakeServer.seen.append(body)
        text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        n = int(text.split()[-1])
        reply = {"choices": [{"token_ids": [n % 3, 100 + n] + [7] * n}]}
        send_json(self, reply)

    def log_message(self, *args):
        pass


def test_count_outputs_against_a_local_server(tmp_path):
    """The CLI on a JSONL prompt set: cycled until --tokens, every 5th prompt held out, the key sent."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        prompts = tmp_path / "prompts.jsonl"
        lines = [json.dumps({"messages": [{"role": "user", "content": f"say {n}"}]}) for n in range(1, 8)]
        lines += [json.dumps({"prompt": "complete 8"}), "plain 9", "plain 10"]
        prompts.write_text("\n".join(lines) + "\n")
        out = tmp_path / "counts.json"
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        proc = subprocess.run(
            [sys.executable, str(REPO / "prepare" / "count_outputs.py"), "--prompts", str(prompts), "--out", str(out),
             "--url", url, "--model", "m", "--api-key", "k3y", "--holdout-every", "5", "--max-tokens", "9",
             "--tokens", "120", "--concurrency", "1"],
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
    finally:
        server.shutdown()
        thread.join()
    counted = draft_vocab.read_counts([out])
    held = draft_vocab.read_counts([out], "holdout")
    requests = json.loads(out.read_text())["requests"]
    expected, expected_held = Counter(), Counter()
    for i in range(requests):
        n = i % 10 + 1
        (expected_held if n % 5 == 0 else expected).update([n % 3, 100 + n] + [7] * n)  # prompts 5 and 10
    assert counted == expected and held == expected_held
    assert sum(counted.values()) + sum(held.values()) >= 120 > sum(counted.values()) + sum(held.values()) - 12
    assert requests == len(_FakeServer.seen) > 10  # the set is cycled past its end
    assert all(b["return_token_ids"] and b["_auth"] == "Bearer k3y" and b["max_tokens"] == 9 for b in _FakeServer.seen)
    assert [b["seed"] for b in _FakeServer.seen[:11]] == [0] * 10 + [1]  # a new seed each pass
    assert sorted(b["_path"] for b in _FakeServer.seen[:10]).count("/v1/chat/completions") == 7


@pytest.fixture
def model(tmp_path_factory, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    dest = tmp_path / "models" / "tiny"
    shutil.copytree(make_tiny(tmp_path_factory), dest)
    return dest


def _build(model: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "prepare" / "build_draft_vocab.py"), str(model), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("lm_head_int8", [True, False])
def test_draft_head_rows_are_the_lm_head_rows(model, tmp_path, lm_head_int8):
    if lm_head_int8:
        assert run(model, "quant_lm_head") == 0
    counts = Counter({i: 1000 - i for i in range(0, 3000, 3)})
    draft_vocab.write_counts(tmp_path / "c.json", counts, {})
    draft_vocab.write_counts(tmp_path / "h.json", Counter({0: 5, 3: 5, 1: 10}), {})
    proc = _build(model, "--counts", str(tmp_path / "c.json"), "--k", "256", "--holdout", str(tmp_path / "h.json"),
                  "--write-ids", str(tmp_path / "ids.json"))
    assert proc.returncode == 0, proc.stderr
    assert "held-out coverage 50.00% of 20 tokens" in proc.stdout

    prepared = ModelDir.open(model)
    record = json.loads((model / "draft_vocab_ids.json").read_text())
    ids = record["ids"]
    stop = draft_vocab.stop_ids(prepared.config, json.loads((model / "generation_config.json").read_text()))
    assert len(ids) == 256 and set(stop) <= set(ids) and ids == sorted(ids)
    assert set(ids) - set(stop) == set(range(0, 3 * (256 - len(stop)), 3))
    assert json.loads((tmp_path / "ids.json").read_text())["ids"] == ids
    assert prepared.config["draft_vocab"] == {"size": 256, "ids_file": "draft_vocab_ids.json", "head": DRAFT_HEAD}
    suffixes = ("weight_packed", "weight_scale") if lm_head_int8 else ("weight",)
    for suffix in suffixes:
        head = np.asarray(prepared.shards[prepared.weight_map[f"lm_head.{suffix}"]].array(f"lm_head.{suffix}"))
        draft = np.asarray(prepared.shards[prepared.weight_map[f"{DRAFT_HEAD}.{suffix}"]].array(f"{DRAFT_HEAD}.{suffix}"))
        assert np.array_equal(draft, head[ids])
    qc = prepared.quantization_config
    for name in ("mtp.draft_lm_head", "model.draft_lm_head", "draft_lm_head"):
        assert ct_config.describes(ct_config.resolve(qc, name, "ParallelLMHead"), 8, 128) == lm_head_int8
    load_check(model)
    state = tree_state(model)
    again = _build(model, "--ids", str(tmp_path / "ids.json"))
    assert again.returncode == 0 and "already done" in again.stdout and tree_state(model) == state


def test_bad_id_lists_are_refused(model, tmp_path):
    state = tree_state(model)
    (tmp_path / "big.json").write_text(json.dumps([1, 2, 10**7]))
    proc = _build(model, "--ids", str(tmp_path / "big.json"))
    assert proc.returncode == 2 and "outside the vocabulary" in proc.stderr
    (tmp_path / "junk.json").write_text(json.dumps({"ids": ["a"]}))
    proc = _build(model, "--ids", str(tmp_path / "junk.json"))
    assert proc.returncode == 2 and "list of token ids" in proc.stderr
    assert tree_state(model) == state
