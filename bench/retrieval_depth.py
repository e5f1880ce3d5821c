"""Retrieval at depth on the scripted checkpoint (issue #20 item 4): a quoted chain segment placed at 8k / 64k /
128k / 200k / 240k of a long prompt must come back verbatim (greedy), then a follow-up turn over a cached prefix.

    python bench/retrieval_depth.py TAG --url URL --scripted MODEL_DIR [--depths 8192,65536,131072,204800,245760]
        [--segment-tokens 64] [--after-tokens 256 | --prompt-tokens N] [--followup-prefix 100000] [--seed 0]
        [--timeout 1800] [--out DIR] [--force]

Each depth D is one prompt of token ids (docs/scripted-model.md, `scripted.depth_prompt`): seeded filler, an 8-token
cue and the --segment-tokens segment (one run along the chain, the segment's first token at position D), more
filler (--after-tokens, or as many as make every prompt --prompt-tokens long), then the cue again. The scripted
model's greedy continuation of the cue is the chain, so a correct server answers with the segment: greedy,
max_tokens = the segment's length, ignore_eos, judged by bench/verbatim.py (tokens reproduced before the first
divergence, the verdict). A depth whose prompt and answer do not fit the server's max_model_len (/v1/models) is
reported as skipped, with the reason, never as a failure.

The follow-up turn: a --followup-prefix-token prompt (the same construction, its segment at the middle) sent cold,
then a second turn (that prompt, its answer, a short new suffix ending in the cue again) that the prefix cache serves:
TTFT of each (streamed), prefix-cache hit tokens of each (vllm:prefix_cache_hits_total deltas from /metrics), both
answers judged. Every run has its own cache_salt, so the cold turn and every depth hit nothing an earlier run left.

What it shows on the scripted checkpoint: its greedy answer is the chain after the last token whatever the context
(the KV cache moves the logits by ~0.01, never the argmax), so a pass says the server takes a prompt that long under
its KV mode and answers it intact (no refusal, crash or damaged output from a broken cache, position or prefix path);
it does not show that attention found the quote. That needs a needle in a real model's text (not built here).
Not run to the end on a GPU yet (visit 14's 245,696-token request was cut at 317 s, the server silent meanwhile).

Report: OUT/retrieval-TAG.json (date, machine, server, settings; per depth the segment's position, tokens reproduced,
verbatim or not, first divergence; the follow-up), rewritten atomically after every request; beside it
OUT/retrieval-TAG-progress.jsonl, one /metrics read (running and waiting requests, KV cache use, prompt and generated
token counters) every --watch-every seconds while a request runs, so a request cut short still shows how far it got.
Resumable: an existing report of the same settings and server is continued, a finished depth (or follow-up) not
re-run unless --force.
Exit 0 when every depth run and both follow-up turns came back verbatim, 1 otherwise (or a request failed), 2 on bad
input or a report of another run, 3 when the server cannot be used.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # also run as a file: python bench/retrieval_depth.py
    sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402
from bench import verbatim as vb  # noqa: E402

SCHEMA = "qwen-serving retrieval-depth/1"
DEPTHS = (8192, 65536, 131072, 204800, 245760)  # the 8k / 64k / 128k / 200k / 240k
CUE_TOKENS = 8
SEGMENT_TOKENS = 64
AFTER_TOKENS = 256  # filler between the segment and the final cue: the quote is never the prompt's recent tail
FOLLOWUP_PREFIX = 100_000  # the spec's follow-up turn: 4.7 s vs 169 s cold over 100k (reference RTX 3090 (spec))
FOLLOWUP_SUFFIX = 16  # the second turn's new tokens before its cue


def parse_depths(spec: str) -> list[int]:
    """"8192,65536" or "8k,64k" (k = 1,024) -> sorted distinct depths."""
    out = set()
    for part in filter(None, (x.strip().lower() for x in spec.split(","))):
        match = re.fullmatch(r"(\d+)(k?)", part)
        if not match:
            raise ValueError(f"depth {part!r}: a token count (8192) or kibi-tokens (8k) please")
        out.add(int(match.group(1)) * (1024 if match.group(2) else 1))
    if not out:
        raise ValueError("no depths given")
    return sorted(out)


def after_tokens(args: argparse.Namespace, depth: int) -> int:
    """Filler between the segment and the final cue at this depth."""
    if args.prompt_tokens is None:
        return args.after_tokens
    return args.prompt_tokens - depth - args.segment_tokens - CUE_TOKENS


def prompt_tokens(args: argparse.Namespace, depth: int) -> int:
    return depth + args.segment_tokens + after_tokens(args, depth) + CUE_TOKENS


def does_not_fit(needed: int, max_model_len: int) -> str | None:
    """Why a request of `needed` tokens (prompt and answer) is skipped, or None when it fits."""
    if needed <= max_model_len:
        return None
    return f"prompt and answer need {needed:,} tokens, the server's max_model_len is {max_model_len:,}"


def depth_case(design, args: argparse.Namespace, depth: int) -> tuple[vb.Case, int]:
    """The request for one depth and where its segment starts in the prompt."""
    from qwen_serving.checkpoint import scripted  # torch: only where a scripted checkpoint is used

    built = scripted.depth_prompt(design, args.seed, depth, args.segment_tokens, CUE_TOKENS, after_tokens(args, depth))
    start, end = built["quoted_span"]
    if built["ids"][start:end] != built["continuation"]:
        raise AssertionError(f"depth {depth}: the segment is not at {start} (a bug in depth_prompt)")
    return vb.Case(f"d{depth}", built["ids"], built["continuation"], args.segment_tokens), start


def followup_cases(design, args: argparse.Namespace) -> tuple[vb.Case, vb.Case, int]:
    """(cold turn, follow-up turn, where the segment starts): the first is --followup-prefix tokens long, the second
    is the first, its answer and a short new suffix ending in the cue, so it shares the first's whole prefix."""
    from qwen_serving.checkpoint import scripted

    prefix, depth = args.followup_prefix, args.followup_prefix // 2
    built = scripted.depth_prompt(design, args.seed + 1, depth, args.segment_tokens, CUE_TOKENS,
                                  prefix - depth - args.segment_tokens - CUE_TOKENS)
    ids, segment = built["ids"], built["continuation"]
    cue = ids[-CUE_TOKENS:]
    follow = [*ids, *segment, *ids[:FOLLOWUP_SUFFIX], *cue]  # the prompt's first tokens are filler: new text here
    return (vb.Case("followup-cold", ids, segment, len(segment)),
            vb.Case("followup-cached", follow, segment, len(segment)), built["quoted_span"][0])


def progress_path(report: Path) -> Path:
    """Beside the report: the /metrics reads taken while each request ran (serving.MetricsWatch), one JSON line
    each, kept even when the run is killed before its report says anything of that request."""
    return report.with_name(report.stem + "-progress.jsonl")


def depth_row(depth: int, placed_at: int, sent: int, figures: dict) -> dict:
    reproduced = figures["common_prefix"]
    return {"depth": depth, "placed_at": placed_at, "prompt_tokens_sent": sent, "segment_tokens": figures["document_len"],
            "tokens_reproduced": reproduced, "reproduced_fraction": round(reproduced / figures["document_len"], 6),
            "verbatim": figures["verdict"] == "verbatim", "first_divergence": figures["first_divergence"], **figures}


def summarize(report: dict, depths: list[int]) -> dict:
    rows = [report["depths"][str(d)] for d in depths if str(d) in report["depths"]]
    run = [r for r in rows if "verbatim" in r]
    followup = report.get("followup") or {}
    return {"depths": len(depths), "run": len(run), "verbatim": sum(r["verbatim"] for r in run),
            "failed_depths": [r["depth"] for r in run if not r["verbatim"]],
            "skipped_depths": [r["depth"] for r in rows if "skipped" in r],
            "followup_verbatim": followup.get("verbatim"),
            # skipped depths never fail a run, but a run that judged nothing passes nothing
            "passed": bool(run or "verbatim" in followup) and all(r["verbatim"] for r in run)
            and followup.get("verbatim") is not False and not report.get("errors")}


def markdown(report: dict, depths: list[int]) -> str:
    lines = ["| depth | placed at | prompt | reproduced | verbatim | first divergence | TTFT ms |",
             "|---|---|---|---|---|---|---|"]
    for d in depths:
        r = report["depths"].get(str(d), {})
        if "skipped" in r:
            lines.append(f"| {d:,} | - | - | - | skipped: {r['skipped']} | - | - |")
        elif "verbatim" in r:
            lines.append(f"| {d:,} | {r['placed_at']:,} | {r['prompt_tokens_sent']:,} | {r['tokens_reproduced']}/"
                         f"{r['segment_tokens']} | {'yes' if r['verbatim'] else 'NO: ' + r['verdict']} | "
                         f"{'-' if r['first_divergence'] is None else r['first_divergence']} | {r['ttft_ms']} |")
        else:
            lines.append(f"| {d:,} | - | - | - | not run (error) | - | - |")
    f = report.get("followup") or {}
    if "skipped" in f:
        lines.append(f"\nfollow-up turn: skipped: {f['skipped']}")
    elif "verbatim" in f:
        lines.append(f"\nfollow-up turn over {f['prefix_tokens']:,} tokens: TTFT cold {f['ttft_ms'][0]} ms, cached "
                     f"{f['ttft_ms'][1]} ms; prefix-cache hit tokens {f['cache_hit_tokens'][0]:,} / "
                     f"{f['cache_hit_tokens'][1]:,}; {'both verbatim' if f['verbatim'] else 'NOT verbatim'}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/retrieval_depth.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tag", help="report name: OUT/retrieval-TAG.json (an existing one of the same settings continues)")
    p.add_argument("--url", default="http://127.0.0.1:18020")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    p.add_argument("--scripted", type=Path, required=True, metavar="MODEL_DIR",
                   help="the served scripted checkpoint (its scripted.json designs the prompts and answers)")
    p.add_argument("--seed", type=int, default=0, help="the filler's and segment's seed (default %(default)s)")
    p.add_argument("--depths", default=",".join(map(str, DEPTHS)),
                   help="where each segment starts, in tokens; 8k = 8,192 (default %(default)s)")
    p.add_argument("--segment-tokens", type=int, default=SEGMENT_TOKENS, help="the quote's length and max_tokens "
                   "(default %(default)s)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--after-tokens", type=int, default=AFTER_TOKENS,
                        help="filler between the segment and the final cue (default %(default)s)")
    length.add_argument("--prompt-tokens", type=int, help="every prompt this long instead (a needle at each depth of "
                        "one context length)")
    p.add_argument("--followup-prefix", type=int, default=FOLLOWUP_PREFIX,
                   help="the follow-up turn's cached prefix in tokens; 0 skips the follow-up (default %(default)s)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one request may take (default %(default)s)")
    p.add_argument("--watch-every", type=float, default=10.0, help="seconds between the /metrics reads taken while a "
                   "request runs, written to OUT/retrieval-TAG-progress.jsonl (default %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--force", action="store_true", help="start the report of this tag again")
    args = p.parse_args(argv)
    if "/" in args.tag or args.tag.startswith("."):
        p.error(f"tag {args.tag!r}: a plain file name please")
    if not (args.scripted / "scripted.json").is_file():
        p.error(f"--scripted {args.scripted}: no scripted.json (not a scripted checkpoint)")
    try:
        args.depths = parse_depths(args.depths)
    except ValueError as err:
        p.error(str(err))
    if args.segment_tokens < 1 or args.after_tokens < 0 or args.timeout <= 0:
        p.error("--segment-tokens must be >= 1, --after-tokens >= 0 and --timeout > 0")
    if args.depths[0] < CUE_TOKENS:
        p.error(f"depth {args.depths[0]}: the {CUE_TOKENS}-token cue sits before the segment, so depths start at "
                f"{CUE_TOKENS}")
    if args.prompt_tokens is not None and after_tokens(args, args.depths[-1]) < 0:
        p.error(f"--prompt-tokens {args.prompt_tokens} cannot hold a segment at depth {args.depths[-1]} (it needs "
                f"{args.depths[-1] + args.segment_tokens + CUE_TOKENS})")
    if args.followup_prefix and (args.followup_prefix // 2 < CUE_TOKENS + FOLLOWUP_SUFFIX or args.followup_prefix
                                 - args.followup_prefix // 2 < args.segment_tokens + CUE_TOKENS):
        p.error(f"--followup-prefix {args.followup_prefix} is too short for a {args.segment_tokens}-token segment "
                "at its middle")
    return args


def identity_of(args: argparse.Namespace, design, server: dict) -> dict:
    """What a resumed report must share with this run: the same prompts, answers and server."""
    return {"model": server["model"]["id"], "model_root": server["model"].get("root"),
            "max_model_len": server["model"].get("max_model_len"), "scripted": str(args.scripted.resolve()),
            "design_seed": design.seed, "cycle": len(design.active), "seed": args.seed,
            "segment_tokens": args.segment_tokens, "cue_tokens": CUE_TOKENS,
            "after_tokens": None if args.prompt_tokens is not None else args.after_tokens,
            "prompt_tokens": args.prompt_tokens, "followup_prefix": args.followup_prefix,
            "followup_suffix": FOLLOWUP_SUFFIX}


def open_report(args: argparse.Namespace) -> tuple[Path, serving.Client, dict, object] | int:
    """(report path, client, the report, the design), or an exit code after one line on stderr."""
    from qwen_serving.checkpoint.scripted import Design

    path = args.out / f"retrieval-{args.tag}.json"
    try:
        design = Design.read(args.scripted)
    except (ValueError, KeyError) as err:
        print(f"retrieval_depth: {err}", file=sys.stderr)
        return 2
    client = serving.Client(args.url, serving.api_key(args.api_key))
    try:
        header = vb.report_header(SCHEMA, args.tag, client)
    except (OSError, KeyError, IndexError, ValueError) as err:
        print(f"retrieval_depth: no usable vLLM server at {args.url}: {err}", file=sys.stderr)
        return 3
    if not header["server"]["model"].get("max_model_len"):
        print(f"retrieval_depth: the server at {args.url} gives no max_model_len in /v1/models", file=sys.stderr)
        return 3
    identity = json.loads(json.dumps(identity_of(args, design, header["server"])))
    if path.exists() and not args.force:
        try:
            report = json.loads(path.read_text())
        except ValueError:
            print(f"retrieval_depth: {path} is not JSON: move it away, or --force", file=sys.stderr)
            return 2
        if report.get("schema") != SCHEMA or report.get("identity") != identity:
            print(f"retrieval_depth: {path} holds another run (server, checkpoint or settings differ): pick another "
                  "tag, or --force to start again", file=sys.stderr)
            return 2
        report.setdefault("resumed", []).append(header["date"])
        print(f"retrieval_depth: continuing {path}", file=sys.stderr)
    else:
        report = {**header, "identity": identity, "depths": {}, "followup": None}
    report["errors"] = []  # this invocation's: a depth that failed to run has no row and runs again on resume
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, client, report, design


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    opened = open_report(args)
    if isinstance(opened, int):
        return opened
    path, client, report, design = opened
    model, max_len = report["server"]["model"]["id"], report["server"]["model"]["max_model_len"]
    run_id = secrets.token_hex(4)  # a new salt per run: nothing earlier answers a cold request from the cache
    todo = [d for d in args.depths if "verbatim" not in report["depths"].get(str(d), {})]
    followup_todo = bool(args.followup_prefix) and "verbatim" not in (report.get("followup") or {})
    bar = serving.Progress("retrieval", len(args.depths) + bool(args.followup_prefix),
                           len(args.depths) - len(todo) + (bool(args.followup_prefix) and not followup_todo))
    page = None  # the last /metrics page: one read between two requests
    for depth in todo:
        reason = does_not_fit(prompt_tokens(args, depth) + args.segment_tokens, max_len)
        if reason:
            report["depths"][str(depth)] = {"depth": depth, "skipped": reason}
            serving.write_json_atomic(path, report)
            bar.step(f"depth {depth}: skipped")
            continue
        case, placed_at = depth_case(design, args, depth)
        try:
            with serving.MetricsWatch(client, progress_path(path), f"depth {depth}", args.watch_every):
                _, figures, page = vb.ask_measured(client, model, case, salt=f"{args.tag}-{run_id}-d{depth}",
                                                   ignore_eos=True, before=page, timeout_s=args.timeout)
        except (OSError, ValueError) as err:
            page = None
            report["errors"].append({"request": f"depth {depth}", "error": str(err)})
            serving.write_json_atomic(path, report)
            bar.step(f"depth {depth}: FAILED to run")
            continue
        row = report["depths"][str(depth)] = depth_row(depth, placed_at, len(case.prompt), figures)
        report["summary"] = summarize(report, args.depths)
        serving.write_json_atomic(path, report)
        bar.step(f"depth {depth}: {row['tokens_reproduced']}/{row['segment_tokens']} {row['verdict']}")
    if followup_todo:
        report["followup"] = run_followup(client, model, design, args, max_len, f"{args.tag}-{run_id}-followup",
                                          report["errors"], progress_path(path))
        bar.step("follow-up: " + ("skipped" if "skipped" in report["followup"] else
                                  "verbatim" if report["followup"].get("verbatim") else "NOT verbatim"))
    summary = report["summary"] = summarize(report, args.depths)
    report["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    serving.write_json_atomic(path, report)
    print(markdown(report, args.depths), end="")
    for error in report["errors"]:
        print(f"FAILED to run the {error['request']} request: {error['error']}")
    followup = report.get("followup") or {}
    if "cache_hit_tokens" in followup and followup["cache_hit_tokens"][1] == 0:
        print("warning: the follow-up turn hit no prefix cache (is the server running with prefix caching?)")
    print(f"retrieval: {summary['verbatim']}/{summary['run']} depths verbatim, {len(summary['skipped_depths'])} "
          f"skipped (max_model_len {max_len:,}); wrote {path}")
    return 0 if summary["passed"] else 1


def run_followup(client: serving.Client, model: str, design, args: argparse.Namespace, max_len: int, salt: str,
                 errors: list[dict], progress: Path) -> dict:
    """Both turns of the follow-up under one salt: cold, then over the cached prefix."""
    cold, cached, placed_at = followup_cases(design, args)
    reason = does_not_fit(len(cached.prompt) + cached.max_tokens, max_len)
    if reason:
        return {"prefix_tokens": args.followup_prefix, "skipped": reason}
    turns, page = [], None
    try:
        for case in (cold, cached):
            with serving.MetricsWatch(client, progress, case.name, args.watch_every):
                _, figures, page = vb.ask_measured(client, model, case, salt=salt, ignore_eos=True, before=page,
                                                   timeout_s=args.timeout)
            turns.append(figures)
    except (OSError, ValueError) as err:
        errors.append({"request": "follow-up", "error": str(err)})
        return {"prefix_tokens": args.followup_prefix, "error": str(err)}
    return {"prefix_tokens": len(cold.prompt), "placed_at": placed_at, "suffix_tokens": len(cached.prompt) -
            len(cold.prompt), "ttft_ms": [t["ttft_ms"] for t in turns],
            "cache_hit_tokens": [t["cache_hit_tokens"] for t in turns],
            "verbatim": all(t["verdict"] == "verbatim" for t in turns), "cold": turns[0], "cached": turns[1]}


if __name__ == "__main__":
    sys.exit(main())
