"""A verbatim copy inside a mixed four-way batch must come out the same in every round (issue #18 item 6).

    python bench/labd_soak.py [TAG] --url URL [--scripted MODEL_DIR | --document FILE] [--ctx 8192] [--rounds 3]
        [--others quote,summary,qa] [--jitter-ms 200] [--max-tokens N] [--out DIR] [--force]

Why: under DFlash2 with the long verify block, the block length is decided for the whole batch, so which length a
copying request gets can depend on when the other requests arrived: different block length, different rounding,
different greedy text (the spec caught exactly that with this check, and not with the hold off).

Each round sends the copy task of bench/labd_bench.py and three other tasks over the same document (--others,
default quote, summary, qa: answers of other lengths), all four at once, each after a seeded random delay of
0..--jitter-ms so that the arrival order changes between rounds; greedy, one cache_salt for the run (round 1
fills the prefix cache, later rounds hit it). Every answer is compared, as token ids, with its round-1 answer
(first divergence when it differs), and the copy is judged by bench/verbatim.py against the document.
Pass: the copy is identical in every round, and with --scripted (its greedy answer known) verbatim in every
round. The other three are reported, not judged. Each round records whether all four were in flight together
(a batch that never formed tests nothing) and its tokens per step from /metrics.
Report: OUT/TAG-labd-soak.json. Exit 0 passed, 1 failed, 2 bad input, 3 the server cannot be used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # also run as a file: python bench/labd_soak.py
    sys.path.insert(0, str(REPO))

from bench import harness, serving  # noqa: E402
from bench import labd_bench as lb  # noqa: E402
from bench import report as br  # noqa: E402
from bench import verbatim as vb  # noqa: E402

SCHEMA = "qwen-serving labd-soak/1"
COPY = "copy"


def digest(answer: vb.Answer) -> str:
    return hashlib.sha256(json.dumps([answer.token_ids, answer.text]).encode()).hexdigest()[:16]


def send_round(client: serving.Client, model: str, cases: list[vb.Case], delays: list[float], salt: str,
               ignore_eos: bool) -> tuple[list[vb.Answer], list[tuple[float, float]]]:
    """All cases at once, case i after delays[i] seconds: the answers and each request's (start, end) offsets."""
    t0 = time.monotonic()

    def one(i: int) -> tuple[vb.Answer, tuple[float, float]]:
        time.sleep(delays[i])
        start = time.monotonic() - t0
        answer = vb.ask(client, model, cases[i], salt=salt, ignore_eos=ignore_eos)
        return answer, (start, time.monotonic() - t0)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, range(len(cases))))
    return [a for a, _ in results], [span for _, span in results]


def compare(first: vb.Answer | None, answer: vb.Answer) -> dict:
    if first is None:
        return {"identical_to_round_1": True, "first_divergence": None}
    same = answer.token_ids == first.token_ids and answer.text == first.text
    where = None if same else vb.judge(first.token_ids or first.text, answer.token_ids or answer.text).first_divergence
    return {"identical_to_round_1": same, "first_divergence": where}


def summarize(rounds: list[dict], scripted: bool) -> dict:
    copies = [r["requests"][COPY] for r in rounds]
    differing = [r["round"] for r in rounds if not r["requests"][COPY]["identical_to_round_1"]]
    not_verbatim = [r["round"] for r in rounds if r["requests"][COPY].get("passed") is False]
    others = {name: [r["round"] for r in rounds if not r["requests"][name]["identical_to_round_1"]]
              for name in rounds[0]["requests"] if name != COPY} if rounds else {}
    passed = bool(rounds) and not differing and (not scripted or not not_verbatim)
    return {"rounds": len(rounds), "copy_identical_rounds": len(copies) - len(differing),
            "copy_differing_rounds": differing, "copy_not_verbatim_rounds": not_verbatim,
            "others_differing_rounds": others, "batches_formed": sum(r["overlapped"] for r in rounds),
            "passed": passed}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/labd_soak.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tag", nargs="?", help="report name: OUT/TAG-labd-soak.json (default: labd-soak-<date>-<time>)")
    lb.add_common_args(p, 8192)
    p.add_argument("--rounds", type=int, default=3, help="rounds of the same four requests (default %(default)s)")
    p.add_argument("--others", default="quote,summary,qa", help="the three tasks beside the copy (default %(default)s)")
    p.add_argument("--jitter-ms", type=float, default=200, help="largest random start delay (default %(default)s)")
    args = p.parse_args(argv)
    lb.check_common_args(p, args, "labd-soak")
    others = lb.parse_task_list(p, args.others)
    if len(others) != 3 or COPY in others:
        p.error("--others: three tasks besides copy")
    if args.rounds < 2 or args.jitter_ms < 0:
        p.error("--rounds must be >= 2 and --jitter-ms >= 0")
    args.tasks = [COPY, *others]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    opened = vb.open_run(args, SCHEMA, "labd-soak", "labd_soak", lambda client, model: lb.build_cases(args, client, model))
    if isinstance(opened, int):
        return opened
    path, client, report, (cases, facts) = opened
    model = report["server"]["model"]["id"]
    salt = f"{args.tag}-{secrets.token_hex(4)}"
    rng = random.Random(args.seed)
    report.update(settings={"ctx": args.ctx, "tasks": args.tasks, "rounds": args.rounds, "jitter_ms": args.jitter_ms,
                            "salt": salt, **facts, "max_tokens": {c.name: c.max_tokens for c in cases}}, rounds=[])
    firsts: dict[str, vb.Answer] = {}
    try:
        for number in range(1, args.rounds + 1):
            delays = [rng.uniform(0, args.jitter_ms) / 1000 for _ in cases]
            before = harness.metrics(client.base, client.key)
            answers, spans = send_round(client, model, cases, delays, salt, bool(args.scripted))
            delta = br.metrics_delta(before, harness.metrics(client.base, client.key))
            requests = {}
            for case, answer, delay, (start, end) in zip(cases, answers, delays, spans, strict=True):
                row = {"completion_tokens": answer.completion_tokens, "finish_reason": answer.finish_reason,
                       "delay_ms": round(delay * 1000, 1), "start_s": round(start, 3), "end_s": round(end, 3),
                       "digest": digest(answer), **compare(firsts.get(case.name), answer)}
                if case.expected is not None:
                    judged = answer.judged_against(case.expected)
                    row.update(verdict=judged.verdict, passed=judged.passed, coverage=judged.coverage,
                               judge_first_divergence=judged.first_divergence)
                firsts.setdefault(case.name, answer)
                requests[case.name] = row
            overlapped = max(s for s, _ in spans) < min(e for _, e in spans)
            report["rounds"].append({"round": number, "overlapped": overlapped, "requests": requests,
                                     "tokens_per_step": round(br.spec_figures(delta)["tokens_per_step"], 4)})
            report["summary"] = summarize(report["rounds"], bool(args.scripted))
            serving.write_json_atomic(path, report)
            copy = requests[COPY]
            print(f"round {number}: copy {'identical' if copy['identical_to_round_1'] else 'DIFFERS'}"
                  + ("" if copy["first_divergence"] is None else f" from token {copy['first_divergence']}")
                  + (f", {copy['verdict']}" if "verdict" in copy else "")
                  + ("" if overlapped else " (the four requests were never in flight together)"), flush=True)
    except (OSError, ValueError) as err:
        report["error"] = str(err)
        serving.write_json_atomic(path, report)
        print(f"labd_soak: a request failed: {err}", file=sys.stderr)
        return 3
    summary = report["summary"]
    for name, rounds in summary["others_differing_rounds"].items():
        if rounds:
            print(f"note: {name} differed from round 1 in rounds {rounds} (reported, not judged)")
    print(f"labd soak {'PASSED' if summary['passed'] else 'FAILED'}: the copy was identical in "
          f"{summary['copy_identical_rounds']}/{summary['rounds']} rounds; wrote {path}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
