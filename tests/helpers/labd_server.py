"""A loopback fake of the vLLM routes the labd tools use (bench/residue_sweep.py, labd_bench.py, labd_soak.py),
run as a child process (`FakeVllm`; in the test's own process the client and server threads would hand the GIL
to each other every 5 ms, the interpreter's switch interval, for each of a sweep's ~800 requests):

    python -m tests.helpers.labd_server --port P [--design DIR] [--tokens-per-step X] [--chunk-sleep S]
        [--corrupt-visit N] [--corrupt-residue R] [--corrupt-shape middle|empty|truncated|unrelated]
        [--max-model-len N] [--lose-from P] [--fail-longer-than N]

Routes: /v1/models (with --max-model-len), /version, /metrics (prefix-cache and spec-decode counters), /tokenize
(a token is one character with the space before it, so " ." is one token and " . ." two, as a filler unit is in
a real tokenizer) and streamed /v1/completions with `return_token_ids`.

Its model: a prompt ending in a token of a scripted design's chain (scripted.json, written by `write_design`)
is answered by walking the chain, as the scripted checkpoint's greedy decoding does; a text prompt holding
"<document>\\n...\\n</document>" is answered with that document (a perfect copier); anything else with "ok ".
A prompt hits the prefix cache for the leading whole blocks (16 tokens) an earlier prompt of the same
cache_salt shared. Spec decode emits `tokens_per_step` tokens a step. It can be told to damage one answer: the `corrupt_visit`-th time a prompt is
seen (2 = its cache hit), optionally only at prompt length % 128 == `corrupt_residue`, in `corrupt_shape`
(middle: one token changed in the middle; empty; truncated: the first third; unrelated: other tokens).
`lose_from` models a KV cache that loses every position from P on: an answer whose first token the prompt holds
only at or past P (a quote placed that deep) is damaged the same way. A request whose prompt and max_tokens
exceed max_model_len is refused with HTTP 400, as vLLM refuses it; `fail_longer_than` answers a longer prompt with
HTTP 500 (an engine error).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench import serving
from tests.helpers.fake_http import send_json

REPO = Path(__file__).resolve().parents[2]

MAX_MODEL_LEN = 65536
BLOCK = 16
DRAFTS_PER_STEP = 7
TEXT_IDS_FROM = 100_000  # text token ids start here, above any scripted design's ids


def write_design(model_dir: Path, active: list[int], seed: int = 0) -> list[int]:
    """A scripted.json whose chain is a seeded cycle through `active` (only the fields the tools read matter);
    the cycle, from active[0]."""
    order = active[1:]
    random.Random(seed).shuffle(order)
    cycle = [active[0], *order]
    successor = {t: cycle[(i + 1) % len(cycle)] for i, t in enumerate(cycle)}
    design = {"format": "qwen-serving scripted design v1", "hidden": 64, "vocab": max(active) + 1, "seed": seed,
              "mtp_agree": 1.0, "active": active, "chain": [successor[t] for t in active],
              "alternatives": [[t, t, t] for t in active], "mtp_source": active, "core": active[:8],
              "draft_ids": None}
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "scripted.json").write_text(json.dumps(design))
    return cycle


class FakeVllm:
    """The server in a child process, as a context manager: its URL once it answers."""

    def __init__(self, *flags: str):
        self.flags = [str(f) for f in flags]
        self.port = serving.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> FakeVllm:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.labd_server", "--port", str(self.port),
                                      *self.flags], cwd=REPO)
        deadline = time.monotonic() + 30
        while serving.probe(self.url + "/v1/models", timeout_s=2)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake vLLM did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


class LabdServer:
    def __init__(self, design_dir: Path | None = None, tokens_per_step: float = 1.0, chunk_sleep_s: float = 0.0,
                 corrupt_visit: int | None = None, corrupt_residue: int | None = None, corrupt_shape: str = "middle",
                 port: int = 0, max_model_len: int = MAX_MODEL_LEN, lose_from: int | None = None,
                 fail_longer_than: int | None = None, block_size: int = BLOCK):
        self.successor = None
        self.block_size = block_size
        if design_dir is not None:
            design = json.loads((design_dir / "scripted.json").read_text())
            self.successor = dict(zip(design["active"], design["chain"], strict=True))
        self.tokens_per_step, self.chunk_sleep_s = tokens_per_step, chunk_sleep_s
        self.corrupt_visit, self.corrupt_residue, self.corrupt_shape = corrupt_visit, corrupt_residue, corrupt_shape
        self.max_model_len, self.lose_from, self.fail_longer_than = max_model_len, lose_from, fail_longer_than
        self.lock = threading.Lock()
        self.running = 0  # streams being answered: vllm:num_requests_running
        self.visits: dict[tuple, int] = {}
        self.blocks: set[int] = set()
        self.counters = dict.fromkeys(("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                                       "prefix_cache_hits", "request_success", "spec_decode_num_drafts",
                                       "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"), 0)
        self.vocab: dict[str, int] = {}
        self.pieces: dict[int, str] = {}
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True

    # the model -------------------------------------------------------------------------------

    def answer(self, prompt: list[int], n: int) -> list[int]:
        if self.successor is not None and prompt and prompt[-1] in self.successor:
            out = [prompt[-1]]
            for _ in range(n):
                out.append(self.successor[out[-1]])
            return out[1:]
        text = self.text_of(prompt)
        start, end = text.find("<document>\n"), text.rfind("\n</document>")
        reply = text[start + len("<document>\n"):end] if 0 <= start < end else "ok " * n
        return self.tokenize(reply)[:n]

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for piece in re.findall(r" ?.", text, re.S):
            if piece not in self.vocab:
                self.vocab[piece] = TEXT_IDS_FROM + len(self.vocab)
                self.pieces[self.vocab[piece]] = piece
            ids.append(self.vocab[piece])
        return ids

    def damage(self, ids: list[int]) -> list[int]:
        if self.corrupt_shape == "empty":
            return []
        if self.corrupt_shape == "truncated":
            return ids[:len(ids) // 3]
        if self.corrupt_shape == "unrelated":
            return self.tokenize("z" * len(ids))
        middle = len(ids) // 2
        return ids[:middle] + [ids[middle] + 1] + ids[middle + 1:]

    def complete(self, body: dict) -> list[int]:
        prompt = body["prompt"]
        with self.lock:
            salt = body.get("cache_salt")
            key = (salt, tuple(prompt))
            visit = self.visits[key] = self.visits.get(key, 0) + 1
            ids = self.answer(prompt, body["max_tokens"])
            # prefix caching: the leading whole blocks an earlier prompt of the same salt left (never the last token);
            # a block's hash chains its predecessor's, as vLLM's does, so it names the whole prefix in linear time
            blocks, chained = [], hash(salt)
            size = self.block_size
            for end in range(size, len(prompt), size):
                chained = hash((chained, tuple(prompt[end - size:end])))
                blocks.append(chained)
            hit = size * next((i for i, b in enumerate(blocks) if b not in self.blocks), len(blocks))
            self.blocks.update(blocks)
            if visit == self.corrupt_visit and self.corrupt_residue in (None, len(prompt) % 128):
                ids = self.damage(ids)
            elif self.lose_from is not None and ids and ids[0] not in prompt[:self.lose_from]:
                ids = self.damage(ids)
            steps = math.ceil(len(ids) / self.tokens_per_step)
            c = self.counters
            c["prompt_tokens"] += len(prompt)
            c["generation_tokens"] += len(ids)
            c["prefix_cache_queries"] += len(prompt)
            c["prefix_cache_hits"] += hit
            c["request_success"] += 1
            c["spec_decode_num_drafts"] += steps
            c["spec_decode_num_draft_tokens"] += steps * DRAFTS_PER_STEP
            c["spec_decode_num_accepted_tokens"] += len(ids) - steps
        return ids

    def metrics(self) -> str:
        with self.lock:
            lines = [f'vllm:{name}_total{{engine="0",model_name="fake"}} {value}'
                     for name, value in self.counters.items()]
        lines.append(f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",'
                     'engine="0"} 1.0')
        lines.append(f'vllm:num_requests_running{{engine="0",model_name="fake"}} {self.running}')
        return "\n".join(lines) + "\n"

    def text_of(self, ids: list[int]) -> str:
        return "".join(self.pieces.get(t, f"{t} ") for t in ids)

    # HTTP --------------------------------------------------------------------------------------

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                if self.path == "/metrics":
                    data = server.metrics().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif self.path == "/v1/models":
                    send_json(self, {"data": [{"id": "fake", "root": "/models/fake",
                                               "max_model_len": server.max_model_len}]})
                elif self.path == "/version":
                    send_json(self, {"version": "0.28.0-fake"})
                else:
                    send_json(self, {"detail": "Not Found"}, 404)

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path == "/tokenize":
                    text = (f"<user>{body['messages'][0]['content']}<assistant>" if "messages" in body
                            else body["prompt"])
                    with server.lock:
                        tokens = server.tokenize(text)
                    return send_json(self, {"count": len(tokens), "tokens": tokens,
                                            "max_model_len": server.max_model_len})
                if self.path != "/v1/completions" or not body.get("stream"):
                    return send_json(self, {"detail": "Not Found"}, 404)
                if len(body["prompt"]) + body["max_tokens"] > server.max_model_len:
                    return send_json(self, {"error": {"message": f"This model's maximum context length is "
                                                      f"{server.max_model_len} tokens", "code": 400}}, 400)
                if server.fail_longer_than is not None and len(body["prompt"]) > server.fail_longer_than:
                    return send_json(self, {"error": {"message": "EngineCore encountered an issue", "code": 500}}, 500)
                ids = server.complete(body)
                with server.lock:
                    server.running += 1
                try:
                    self._stream(ids, len(body["prompt"]))
                finally:
                    with server.lock:
                        server.running -= 1

            def _stream(self, ids: list[int], prompt_tokens: int) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                step = max(1, round(server.tokens_per_step))
                chunks = [ids[i:i + step] for i in range(0, len(ids), step)] or [[]]
                for n, piece in enumerate(chunks):
                    last = n == len(chunks) - 1
                    choice = {"index": 0, "text": server.text_of(piece), "token_ids": piece,
                              "finish_reason": "length" if last else None}
                    self._event({"choices": [choice]})
                    time.sleep(server.chunk_sleep_s)  # a decode time for the rate figures
                self._event({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids)}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def _event(self, data: dict) -> None:
                self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()

        return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--design", type=Path)
    p.add_argument("--tokens-per-step", type=float, default=1.0)
    p.add_argument("--chunk-sleep", type=float, default=0.0)
    p.add_argument("--corrupt-visit", type=int)
    p.add_argument("--corrupt-residue", type=int)
    p.add_argument("--corrupt-shape", default="middle", choices=("middle", "empty", "truncated", "unrelated"))
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--lose-from", type=int)
    p.add_argument("--fail-longer-than", type=int)
    p.add_argument("--block-size", type=int, default=BLOCK)
    a = p.parse_args()
    LabdServer(a.design, a.tokens_per_step, a.chunk_sleep, a.corrupt_visit, a.corrupt_residue, a.corrupt_shape,
               a.port, a.max_model_len, a.lose_from, a.fail_longer_than, a.block_size).httpd.serve_forever()


if __name__ == "__main__":
    main()
