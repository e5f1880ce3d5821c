"""Probe a running server (verify.sh's server checks): one `PASS|WARN|FAIL message` line per check.

    python -m bench.server_check [--mode single|batch] [--url URL] [--log FILE]

The address comes from the same knobs as the launchers (HOST, PORT; the environment over .env), the key
from VLLM_API_KEY or api_key.txt. Checks: /health, the served model (/v1/models), one short greedy chat
request, the KV pool (/metrics' vllm:cache_config_info), and the attention backend and speculative
decoding, which vLLM 0.28.0 reports in /server_info only with VLLM_SERVER_DEV_MODE=1 and always in its
boot log (--log: the server's output, e.g. `journalctl --user -u qwen-serving -b > server.log`).
Exit 1 when a check FAILs; a server that is down is one FAIL line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from bench import serving
from qwen_serving import dotenv, knobs

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is a package of the repo root
    sys.path.insert(0, str(REPO))
PROMPT = "Reply with the single word: ready"
# vLLM 0.28.0's boot log lines (platforms/cuda.py, v1/core/kv_cache_utils.py, v1/engine/core.py)
LOG_BACKEND = re.compile(r"Using (\S+) attention backend out of potential backends")
LOG_KV_TOKENS = re.compile(serving.KV_TOKENS_LINE)
LOG_SPEC = re.compile(r"speculative_config=(None|SpeculativeConfig\(method='([^']*)', .*?num_spec_tokens=(\d+)\))")
CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(.*)\}", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Probe:
    def __init__(self, base: str, key: str, timeout: float):
        self.base, self.key, self.timeout = base.rstrip("/"), key, timeout

    def request(self, path: str, body: dict | None = None) -> tuple[int, str]:
        """(HTTP status, body); status 0 with the reason when nothing answered."""
        return serving.probe(self.base + path, body, key=self.key or None, timeout_s=self.timeout)


def address(mode: str, env: Mapping[str, str]) -> str:
    settings = knobs.resolve(mode, env)
    return serving.local_url(str(settings["HOST"].value), settings["PORT"].value)


def log_facts(path: Path) -> dict[str, str]:
    """attention backend, KV tokens and speculative config as the boot log states them (the last boot's)."""
    text = path.read_text(errors="replace")
    facts = {}
    for name, pattern in (("backend", LOG_BACKEND), ("kv_tokens", LOG_KV_TOKENS), ("spec", LOG_SPEC)):
        found = pattern.findall(text)
        if found:
            last = found[-1]
            if name == "spec":
                last = "off" if last[0] == "None" else f"{last[1]} with {last[2]} speculative tokens"
            facts[name] = last
    return facts


def checks(probe: Probe, log: Path | None) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    status, body = probe.request("/health")
    if status == 0:
        return [("FAIL", f"server: nothing answers at {probe.base} ({body}); start it (bash single-user/start_qwen.sh "
                         "or bash batch/start_qwen.sh), set PORT/HOST to where it runs, or pass --no-server")]
    if status != 200:
        return [("FAIL", f"server: {probe.base}/health answered HTTP {status} (still loading, or not this server)")]
    out.append(("PASS", f"server: {probe.base}/health OK"))

    status, body = probe.request("/v1/models")
    if status == 401:
        return [*out, ("FAIL", "server: 401 Unauthorized; set VLLM_API_KEY (or api_key.txt) to the server's key")]
    try:
        model = json.loads(body)["data"][0]["id"] if status == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        model = None
    if not model:
        return [*out, ("FAIL", f"server: /v1/models answered HTTP {status} without a model: {body[:200]!r}")]

    start = time.monotonic()
    status, body = probe.request("/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0})
    took = time.monotonic() - start
    try:
        answer = json.loads(body)
        text = answer["choices"][0]["message"].get("content") or ""
        tokens = answer.get("usage", {}).get("completion_tokens", "?")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        answer = None
    if status != 200 or answer is None:
        out.append(("FAIL", f"chat: HTTP {status} from /v1/chat/completions: {body[:200]!r}"))
    else:
        out.append(("PASS", f"chat: {model} answered {tokens} tokens in {took:.1f} s: {text.strip()[:60]!r}"))

    facts = log_facts(log) if log else {}
    status, body = probe.request("/metrics")
    match = CACHE_INFO.search(body) if status == 200 else None
    if match:
        cache = dict(LABEL.findall(match.group(1)))
        tokens = cache.get("kv_cache_size_tokens") or facts.get("kv_tokens", "?")
        out.append(("PASS", f"kv pool: {cache.get('num_gpu_blocks', '?')} blocks of {cache.get('block_size', '?')} "
                            f"tokens, {tokens} tokens in all (kv dtype {cache.get('cache_dtype', '?')})"))
    elif "kv_tokens" in facts:
        out.append(("PASS", f"kv pool: {facts['kv_tokens']} tokens (from the log)"))
    else:
        out.append(("WARN", f"kv pool: not in /metrics (HTTP {status}) and no --log given"))

    status, body = probe.request("/server_info?config_format=json")
    config = {}
    if status == 200:
        try:
            config = json.loads(body).get("vllm_config") or {}
        except ValueError:
            config = {}
    spec = config.get("speculative_config") if isinstance(config, dict) else None
    backend = (config.get("attention_config") or {}).get("backend") if isinstance(config, dict) else None
    if spec:
        facts["spec"] = f"{spec.get('method')} with {spec.get('num_speculative_tokens')} speculative tokens"
    elif config and "spec" not in facts:
        facts["spec"] = "off"
    if backend:
        facts["backend"] = backend
    where = "the log" if log else "/server_info"
    hint = ("pass --log FILE with the server's output" if not log else f"{log} has no vLLM 0.28.0 boot lines") + \
        ("" if config else "; /server_info needs VLLM_SERVER_DEV_MODE=1")
    out.append(("PASS", f"attention backend: {facts['backend']} ({where})") if "backend" in facts
               else ("WARN", f"attention backend: not known ({hint})"))
    out.append(("PASS", f"spec decode: {facts['spec']}") if "spec" in facts
               else ("WARN", f"spec decode: not known ({hint})"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.server_check", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=knobs.MODES, default="single", help="whose knobs give HOST and PORT")
    ap.add_argument("--url", help="the server's base URL (default: from HOST and PORT)")
    ap.add_argument("--log", type=Path, help="the server's output, for what /server_info does not say")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = ap.parse_args(argv)
    env = dotenv.environment_or_exit(REPO / ".env")
    try:
        base = args.url or address(args.mode, env)
    except knobs.KnobError as e:
        print(f"FAIL server: {e}")
        return 1
    if args.log and not args.log.is_file():
        print(f"FAIL server: --log {args.log} is not a file")
        return 1
    results = checks(Probe(base, serving.api_key(env.get("VLLM_API_KEY"), REPO) or "", args.timeout), args.log)
    for level, message in results:
        print(f"{level} {message}")
    return 1 if any(level == "FAIL" for level, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
