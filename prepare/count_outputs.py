"""Count the token ids a running server generates for a prompt set (input for build_draft_vocab.py).

    python prepare/count_outputs.py --prompts prompts.jsonl --out counts.json \
        [--url http://127.0.0.1:18020/v1] [--max-tokens 1024] [--holdout-every 10]

Prompts: JSONL of {"messages": [...]} (chat, what the drafter will see) or {"prompt": "..."}.
Every --holdout-every-th prompt is counted into <out>.holdout.json instead, so the chosen list's
coverage can be measured on outputs it was not chosen from. The API key comes from --api-key,
VLLM_API_KEY or api_key.txt.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402
from qwen_serving.checkpoint import draft_vocab  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True, help="counts file (JSON); held-out counts go to <out>.holdout.json")
    parser.add_argument("--url", default="http://127.0.0.1:18020/v1")
    parser.add_argument("--model", help="served model name (default: the server's first)")
    parser.add_argument("--api-key")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--holdout-every", type=int, default=10, help="0: no held-out split")
    parser.add_argument("--extra-body", default="{}", help='JSON merged into every request, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'')
    args = parser.parse_args(argv)
    try:
        prompts = draft_vocab.read_prompts(args.prompts)
        key = serving.api_key(args.api_key)
        model = args.model or serving.Client(args.url, key).served_model()
        settings = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                    "top_p": args.top_p, **json.loads(args.extra_body)}
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"count_outputs: error: {e}", file=sys.stderr)
        return 2
    print(f"count_outputs: {len(prompts)} prompts -> {args.url} ({model})", flush=True)
    counts, held, failures = draft_vocab.count_outputs(
        args.url, prompts, settings, api_key=key, concurrency=args.concurrency, holdout_every=args.holdout_every,
        log=lambda line: print(line, flush=True),
    )
    if failures > len(prompts) // 10:
        print(f"count_outputs: error: {failures} of {len(prompts)} requests failed; nothing written", file=sys.stderr)
        return 1
    meta = {"server": args.url, "model": model, "settings": settings}
    out = Path(args.out)
    held_prompts = len(prompts) // args.holdout_every if args.holdout_every > 0 else 0
    draft_vocab.write_counts(out, counts, {**meta, "prompts": len(prompts) - held_prompts})
    print(f"count_outputs: {sum(counts.values())} tokens, {len(counts)} distinct -> {out}")
    if args.holdout_every > 0:
        held_path = out.with_name(out.stem + ".holdout.json")
        draft_vocab.write_counts(held_path, held, {**meta, "prompts": held_prompts})
        print(f"count_outputs: {sum(held.values())} held-out tokens -> {held_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
