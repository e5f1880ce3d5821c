"""Count the token ids a running server generates (input for build_draft_vocab.py), resumably.

    python prepare/count_outputs.py --out counts.json [--prompts prompts.jsonl] [--tokens 900000] \
        [--url http://127.0.0.1:18020/v1] [--max-tokens 1024] [--holdout-every 10]
    python prepare/count_outputs.py --out counts.json --proxy 18021 [--url ...]   # count your own traffic

Prompts: the bundled set (prepare/calibration_prompts.json) or JSONL of {"messages": [...]} or
{"prompt": "..."}; the set is cycled (a new seed each pass) until --tokens are counted. Every
--holdout-every-th prompt is counted apart ("holdout" in the same file), so the chosen list's coverage
is measured on outputs it was not chosen from. The counts are written beside and renamed into place
every --save-every requests; a re-run with the same --out continues where the last one stopped.

--proxy PORT listens on 127.0.0.1:PORT and forwards to --url: point your client there, and every
completion the server generates for you is counted (the ids come from vLLM's return_token_ids, which
the proxy asks for and strips again unless your request asked too). Ctrl-C saves and stops.

The API key comes from --api-key, VLLM_API_KEY or api_key.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402
from qwen_serving.checkpoint import draft_vocab  # noqa: E402

PROMPT_SET = REPO / "prepare" / "calibration_prompts.json"
# ~15 min of a 3090 in batch mode: the spec's ~1,035 tok/s steady decode at 64 concurrent x 900 s = 931,500
DEFAULT_TOKENS = 900_000
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class Tally:
    """What has been counted: the first `requests` requests of the sequence, in order (resumable)."""

    counts: Counter = field(default_factory=Counter)
    holdout: Counter = field(default_factory=Counter)
    requests: int = 0
    failed: int = 0
    meta: dict = field(default_factory=dict)

    def tokens(self) -> int:
        return sum(self.counts.values()) + sum(self.holdout.values())

    def add(self, ids: list[int], held: bool) -> None:
        (self.holdout if held else self.counts).update(ids)

    def save(self, path: Path) -> None:
        draft_vocab.write_counts(path, self.counts, {**self.meta, "requests": self.requests, "failed": self.failed},
                                 self.holdout)

    @classmethod
    def load(cls, path: Path, meta: dict) -> Tally:
        """The counts so far at `path` (none yet: empty); counts of another model or prompt set are refused."""
        if not path.exists():
            return cls(meta=meta)
        data = draft_vocab.read_count_file(path)
        for key, value in meta.items():
            if data.get(key) != value:
                raise ValueError(f"{path} counts {key}={data.get(key)!r}, this run {value!r}: pass another --out "
                                 "or delete it to start over")
        return cls(draft_vocab.read_counts([path]), draft_vocab.read_counts([path], "holdout"),
                   int(data.get("requests", 0)), int(data.get("failed", 0)), meta)


def load_prompts(path: Path) -> list[dict]:
    if path.suffix == ".json":
        return draft_vocab.expand_prompt_set(json.loads(path.read_text()))
    return draft_vocab.read_prompts(path)


def generated_ids(client: serving.Client, item: dict, settings: dict, seed: int, timeout_s: float) -> list[int]:
    """One request; the ids the server generated (vLLM's return_token_ids)."""
    path = COMPLETIONS[0] if "messages" in item else COMPLETIONS[1]
    reply = client.post_json(path, {**settings, **item, "seed": seed, "return_token_ids": True}, timeout_s=timeout_s)
    ids = reply["choices"][0].get("token_ids")
    if ids is None:
        raise ValueError("the server returned no token_ids (vLLM's return_token_ids, vLLM >= 0.10.2)")
    return [int(i) for i in ids]


def count(client: serving.Client, prompts: list[dict], settings: dict, tally: Tally, *, budget: int,
          concurrency: int, holdout_every: int, save: Callable[[Tally], None], save_every: int = 32,
          progress: Callable[[Tally], None] = lambda t: None, timeout_s: float = 600) -> Tally:
    """Send request tally.requests, tally.requests+1, ... (request i: prompt i mod len, seed i div len) until
    `budget` tokens are counted. Results are folded in request order, so what is saved is always a prefix
    of the sequence and a re-run continues it exactly."""
    n = len(prompts)
    finished: dict[int, list[int] | None] = {}  # done out of order, waiting for the ones before
    since_save = 0
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        running: dict = {}
        issued = tally.requests

        def top_up() -> None:
            nonlocal issued
            buffered = sum(len(ids or ()) for ids in finished.values())
            while len(running) < concurrency and tally.tokens() + buffered < budget:
                running[pool.submit(generated_ids, client, prompts[issued % n], settings, issued // n, timeout_s)] = issued
                issued += 1

        top_up()
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                index = running.pop(future)
                try:
                    finished[index] = future.result()
                except (OSError, ValueError, KeyError, IndexError) as e:  # one bad request must not lose the run
                    finished[index] = None
                    print(f"\ncount_outputs: request {index} failed: {e}", file=sys.stderr, flush=True)
            while tally.requests in finished:
                ids = finished.pop(tally.requests)
                if ids is None:
                    tally.failed += 1
                else:
                    tally.add(ids, draft_vocab.is_held_out(tally.requests % n, holdout_every))
                tally.requests += 1
                since_save += 1
            if tally.failed > max(8, tally.requests // 10):
                save(tally)
                raise RuntimeError(f"{tally.failed} of {tally.requests} requests failed; the counts so far are saved")
            if since_save >= save_every:
                save(tally)
                since_save = 0
            progress(tally)
            top_up()
    save(tally)
    return tally


def progress_bar(budget: int, out=sys.stderr) -> Callable[[Tally], None]:
    """A one-line bar on a terminal (a line every 5% elsewhere): tokens, rate, time left."""
    start, first = time.monotonic(), None
    step = {"next": 0.0}

    def show(tally: Tally) -> None:
        nonlocal first
        first = tally.tokens() if first is None else first
        done = min(1.0, tally.tokens() / budget)
        rate = (tally.tokens() - first) / max(time.monotonic() - start, 1e-9)
        left = f"{(budget - tally.tokens()) / rate / 60:.0f} min left" if rate > 0 and done < 1 else ""
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        line = f"[{bar}] {tally.tokens():,}/{budget:,} tokens {100 * done:5.1f}%  {rate:,.0f} tok/s  {left}"
        if out.isatty():
            out.write("\r" + line.ljust(100))
        elif done >= step["next"]:
            out.write(line + "\n")
            step["next"] = done + 0.05
        out.flush()

    return show


# ---- the counting proxy: the user's own traffic ----

def _strip(choice_holder: dict, keep: bool) -> list[int]:
    """The generated ids of every choice of a reply or a streamed chunk; removed from it unless `keep`."""
    ids: list[int] = []
    for choice in choice_holder.get("choices") or ():
        ids += [int(i) for i in (choice.get("token_ids") or ())]
        if not keep:
            choice.pop("token_ids", None)
    if not keep:
        choice_holder.pop("prompt_token_ids", None)
    return ids


def proxy(listen_port: int, client: serving.Client, tally: Tally, save: Callable[[Tally], None], *,
          holdout_every: int, save_every: int = 8, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server on host:listen_port that forwards the OpenAI routes to `client`'s server and counts what it
    generates (request i is held out as prompt i would be). The caller runs serve_forever()."""
    lock = threading.Lock()

    def record(ids: list[int]) -> None:
        with lock:
            tally.add(ids, draft_vocab.is_held_out(tally.requests, holdout_every))
            tally.requests += 1
            if tally.requests % save_every == 0:
                save(tally)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _upstream(self) -> serving.Client:
            auth = self.headers.get("Authorization", "")
            return serving.Client(client.base, auth.removeprefix("Bearer ").strip() or client.key)

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 (http.server's naming)
            try:
                self._send(200, self._upstream().get_text(self.path).encode())
            except serving.HttpError as e:
                self._send(e.status, e.body.encode())

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            counted = self.path in COMPLETIONS
            keep = bool(body.get("return_token_ids"))
            upstream = self._upstream()
            try:
                if counted and body.get("stream"):
                    self._stream(upstream.post_events(self.path, {**body, "return_token_ids": True}), keep)
                    return
                reply = upstream.post_json(self.path, {**body, "return_token_ids": True} if counted else body)
            except serving.HttpError as e:
                self._send(e.status, e.body.encode())
                return
            if counted and isinstance(reply, dict):
                record(_strip(reply, keep))
            self._send(200, json.dumps(reply).encode())

        def _stream(self, events: Iterator, keep: bool) -> None:
            ids: list[int] = []
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for _name, data in events:
                if data != serving.SSE_DONE:
                    ids += _strip(data, keep)
                self.wfile.write(f"data: {data if data == serving.SSE_DONE else json.dumps(data)}\n\n".encode())
                self.wfile.flush()
            self.close_connection = True
            record(ids)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer((host, listen_port), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="counts file (JSON): continued if it exists")
    parser.add_argument("--prompts", type=Path, default=PROMPT_SET, help="a template set (.json) or JSONL prompts")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="stop once this many tokens are counted")
    parser.add_argument("--url", default="http://127.0.0.1:18020/v1")
    parser.add_argument("--model", help="served model name (default: the server's first)")
    parser.add_argument("--api-key")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--holdout-every", type=int, default=10, help="0: no held-out split")
    parser.add_argument("--save-every", type=int, default=32, help="requests between two writes of --out")
    parser.add_argument("--proxy", type=int, metavar="PORT", help="count your own traffic through 127.0.0.1:PORT")
    parser.add_argument("--extra-body", default="{}", help='JSON merged into every request, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'')
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """count_outputs with parsed arguments (prepare/calibrate.py calls it too); an exit code."""
    try:
        client = serving.Client(args.url, serving.api_key(args.api_key))
        model = args.model or client.served_model()
    except OSError as e:
        print(f"count_outputs: error: no server answers at {args.url} ({e}); start it first", file=sys.stderr)
        return 2
    try:
        if args.proxy:
            tally = Tally.load(args.out, {"model": model, "source": "proxy"})
            server = proxy(args.proxy, client, tally, lambda t: t.save(args.out), holdout_every=args.holdout_every)
            print(f"count_outputs: counting your traffic: point your client at http://127.0.0.1:{args.proxy}/v1 "
                  f"(forwarded to {args.url}); Ctrl-C saves and stops", flush=True)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
            server.server_close()
            tally.save(args.out)
        else:
            prompts = load_prompts(args.prompts)
            settings = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                        "top_p": args.top_p, **json.loads(args.extra_body)}
            tally = Tally.load(args.out, {"model": model, "source": args.prompts.name, "settings": settings,
                                          "prompts": len(prompts), "holdout_every": args.holdout_every})
            if tally.requests:
                print(f"count_outputs: continuing {args.out}: {tally.requests} requests, {tally.tokens():,} tokens "
                      "counted", flush=True)
            print(f"count_outputs: {len(prompts)} prompts ({args.prompts.name}) -> {args.url} ({model}), "
                  f"until {args.tokens:,} tokens", flush=True)
            try:
                count(client, prompts, settings, tally, budget=args.tokens, concurrency=args.concurrency,
                      holdout_every=args.holdout_every, save=lambda t: t.save(args.out), save_every=args.save_every,
                      progress=progress_bar(args.tokens))
            except KeyboardInterrupt:
                tally.save(args.out)
                print(f"\ncount_outputs: stopped; {tally.tokens():,} tokens saved in {args.out}; re-run to continue",
                      file=sys.stderr)
                return 130
            print(file=sys.stderr)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"count_outputs: error: {e}", file=sys.stderr)
        return 2
    print(f"count_outputs: {sum(tally.counts.values()):,} tokens ({len(tally.counts):,} distinct), "
          f"{sum(tally.holdout.values()):,} held out, {tally.requests} requests -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
