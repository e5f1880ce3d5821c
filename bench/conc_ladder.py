"""Per-stream and aggregate decode at 1/2/4/8 concurrent streams over the OpenAI API.

    python bench/conc_ladder.py --n 1,2,4,8 --ctx-tokens 4096 [--max-tokens 256] [--shared] [--out FILE]

Each stream is a streamed /v1/completions request whose prompt is ~ctx-tokens long. By default every
prompt is distinct and salted (a random document per stream and rung, plus a per-request cache_salt),
so nothing is served from the prefix cache; --shared gives every stream the same document with its
own question at the end, which is what a prefix cache is for. Token arrival times come from
continuous usage stats, so a chunk carrying several speculated tokens counts as several tokens.
Figures (bench.report.ladder_figures): per-stream decode, aggregate decode over the window
in which all streams decode, end-to-end aggregate, mean TTFT.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import report as br  # noqa: E402
from bench import serving  # noqa: E402

WORDS = ("harbour ledger north river winter engine copper signal garden market thunder lantern orchard "
         "bridge meadow compass silver island forest canvas mirror pocket velvet marble anchor window "
         "station quarry saddle timber beacon candle cellar ribbon hammer violin parcel").split()


def document(n_words: int, seed: str) -> str:
    rng = random.Random(seed)
    sentences, words = [], 0
    while words < n_words:
        length = rng.randint(8, 18)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(length)).capitalize() + ".")
        words += length
    return " ".join(sentences)


STREAM_TIMEOUT_S = 1800  # eight streams of long prompts at once can take this long on a 24 GB card


def count_tokens(client: serving.Client, model: str, text: str) -> int | None:
    try:
        return client.post_json("/tokenize", {"model": model, "prompt": text})["count"]
    except OSError:
        return None


def sized_document(client: serving.Client, model: str, tokens: int, seed: str) -> str:
    """A document of about `tokens` tokens, sized with the server's /tokenize (1 token/word without it)."""
    words = tokens
    for _ in range(3):
        text = document(words, seed)
        count = count_tokens(client, model, text)
        if count is None or abs(count - tokens) <= max(16, tokens // 100):
            return text
        words = max(1, int(words * tokens / count))
    return document(words, seed)


def stream_one(client: serving.Client, body: dict, out: dict) -> None:
    """Fills out['start'] and out['times'] (one entry per generated token)."""
    out["start"] = time.perf_counter()
    times, seen = [], 0
    try:
        for _, chunk in client.post_events("/v1/completions", body, timeout_s=STREAM_TIMEOUT_S):
            if chunk == serving.SSE_DONE:
                continue
            now = time.perf_counter()
            done = (chunk.get("usage") or {}).get("completion_tokens", seen)
            times += [now] * (done - seen)
            seen = done
    except OSError as e:
        out["error"] = str(e)
    out["times"] = times


def rung(client: serving.Client, model: str, n: int, args, docs: list[str]) -> dict:
    bodies = []
    for i in range(n):
        prompt = docs[i] + f"\n\nQuestion {i + 1}: summarise the text above in detail, as a numbered list.\n"
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if not args.shared:
            body["cache_salt"] = f"ladder-{args.seed}-{n}-{i}"
        if args.temperature is not None:
            body["temperature"] = args.temperature
        bodies.append(body)
    outs = [{} for _ in range(n)]
    threads = [threading.Thread(target=stream_one, args=(client, b, o)) for b, o in zip(bodies, outs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o["error"] for o in outs if "error" in o or not o["times"]]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0] if errors[0] else 'no tokens'}")
    return br.ladder_figures([o["start"] for o in outs], [o["times"] for o in outs])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:18020")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    p.add_argument("--n", default="1,2,4,8", help="stream counts (default %(default)s)")
    p.add_argument("--ctx-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--shared", action="store_true", help="one document shared by all streams")
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--out", type=Path, help="JSON report (default: print only)")
    args = p.parse_args(argv)
    try:
        ladder = [int(x) for x in args.n.split(",")]
        assert ladder and min(ladder) >= 1
    except (ValueError, AssertionError):
        p.error(f"--n {args.n!r}: comma-separated positive integers please")
    if args.ctx_tokens < 1 or args.max_tokens < 2:
        p.error("--ctx-tokens >= 1 and --max-tokens >= 2 please")
    client = serving.Client(args.url, serving.api_key(args.api_key))
    try:
        model = client.served_model()
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"conc_ladder: no usable server at {args.url}: {e}", file=sys.stderr)
        return 3
    shared_doc = sized_document(client, model, args.ctx_tokens, f"shared-{args.seed}") if args.shared else None
    report = {"url": client.base, "model": model, "ctx_tokens": args.ctx_tokens, "max_tokens": args.max_tokens,
              "shared": args.shared, "seed": args.seed, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ladder": {}}
    print("| streams | per-stream decode tok/s | aggregate decode tok/s | e2e aggregate tok/s | mean TTFT ms |")
    print("|---|---|---|---|---|")
    for n in ladder:
        docs = [shared_doc or sized_document(client, model, args.ctx_tokens, f"{args.seed}-{n}-{i}") for i in range(n)]
        try:
            fig = rung(client, model, n, args, docs)
        except RuntimeError as e:
            print(f"conc_ladder: {n} streams: {e}", file=sys.stderr)
            report["ladder"][str(n)] = {"error": str(e)}
            continue
        report["ladder"][str(n)] = fig
        agg = fig["aggregate_decode_tok_s"]
        print(f"| {n} | {fig['per_stream_decode_tok_s']:.1f} | {'-' if agg is None else f'{agg:.1f}'} | "
              f"{fig['e2e_aggregate_tok_s']:.1f} | {fig['mean_ttft_ms']:.0f} |", flush=True)
    if args.out:
        serving.write_json_atomic(args.out, report)
        print(f"wrote {args.out}")
    return sum("error" in r for r in report["ladder"].values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
