"""The soak of issue #21 on the GPU machine, against a server that is already up (one call per mode), finishing
within --budget-s whatever the server does:

    python3 bench/gpu/soak_visit.py --url http://127.0.0.1:8000 --out /tmp/soak-single.json \
        [--mode single] [--api-key K] [--pid PID] [--server-log PATH] [--n 1000] [--budget-s 180]

It runs `python -m bench.soak` with the visit's settings: short answers (max_tokens up to 16, JSON kinds 48), waves
at concurrency 1/4/16/32, prompts near max_model_len at a quarter of the default share (after the first one the
prefix cache holds their shared prefix; without a prefix cache each is a full prefill), a 120 s request timeout.
No request starts after budget - the request timeout - 15 s settle - 25 s for the final reads, so the call ends within
the budget while the server answers /metrics; a request that never started is counted as not run (the
`expected_answers` criterion fails, and the JSON says how many). Writes OUT (the soak's JSON, with "mode") and
OUT with .md (the per-kind table). Exit code is the soak's: 0 passed, 1 a criterion failed, 2 the soak could not run.

Measured (visit 14, H200, scripted full checkpoint, 180 s budget and 30 s timeouts then): the single-user plan ran
871 of 1,000 requests in 113 s; the batch plan 540, 35 of them past 30 s, while prompts of ~150k tokens (its
max_model_len) filled 194 of its 237 KV blocks and vLLM preempted the rest (KV use 99%, 10 tok/s generated). The
server stayed up and answered; the timeout was the client's. Hence 120 s and a 360 s budget (200 s of sending).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import serving, soak  # noqa: E402

REQUEST_TIMEOUT_S = 120
SETTLE_S = 15
FINAL_READS_S = 25  # /health and /metrics after the last request, each bounded by its own timeout
LONG_SHARE = 0.25  # of the default weight of each near-max_model_len kind


def soak_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """bench.soak's command line for one visit call."""
    max_seconds = args.budget_s - REQUEST_TIMEOUT_S - SETTLE_S - FINAL_READS_S
    if max_seconds < 30:
        raise SystemExit(f"--budget-s {args.budget_s}: leaves {max_seconds} s to send requests (need >= 30)")
    weights = ",".join(f"{kind}={soak.KINDS[kind].weight * LONG_SHARE}" for kind in ("long_prompt", "max_tokens_over"))
    argv = ["--url", args.url, "--n", str(args.n), "--seed", str(args.seed), "--concurrency", "1,4,16,32",
            "--max-tokens", "16", "--max-seconds", str(max_seconds), "--request-timeout", str(REQUEST_TIMEOUT_S),
            "--settle", str(SETTLE_S), "--weights", weights, "--json", str(out),
            "--markdown", str(out.with_suffix(".md"))]
    for flag, value in (("--api-key", args.api_key), ("--pid", args.pid), ("--server-log", args.server_log)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--out", type=Path, required=True, help="the soak's JSON (the table goes beside it as .md)")
    p.add_argument("--mode", default="", help="a label written into the JSON (single, batch)")
    p.add_argument("--api-key")
    p.add_argument("--pid", type=int)
    p.add_argument("--server-log", type=Path)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=int, default=360, help="wall-clock seconds the whole call may take")
    args = p.parse_args(argv)
    argv = soak_argv(args, args.out)
    args.out.unlink(missing_ok=True)  # a record left from an earlier call is never labelled as this one
    rc = soak.main(argv)
    if args.out.exists():  # label the record with the mode it measured
        serving.write_json_atomic(args.out, {"mode": args.mode, **json.loads(args.out.read_text())})
    return rc


if __name__ == "__main__":
    sys.exit(main())
