"""The long-document task suite (issue #18 item 6): six tasks over one document at a given context length, one
after the other on an otherwise idle server, tokens per step and decode rate per task.

    python bench/labd_bench.py [TAG] --url URL --ctx 20000 [--scripted MODEL_DIR | --document FILE]
        [--tasks copy,edit,quote,commands,summary,qa] [--max-tokens N] [--no-warmup] [--out DIR] [--force]

The tasks, from the spec's table (reproduce the first 60 lines; shorten, keep the commands; quote and explain;
reproduce every command; free-form summary; free-form Q&A):
- text documents (default: bench/texts' three texts, code first, repeated under part headings until the prompt reaches
  --ctx; --document FILE, cut to --ctx): each task is an instruction after the document, in the server's chat
  template, thinking off, greedy; the copy task's answer is judged against the document's first 60 lines
  (unless --max-tokens leaves it too short a budget for them: the report says so).
- scripted (`--scripted`): the document is seeded filler with, for each task, a chain segment holding the first
  `quoted_share` of that task's answer; the prompt is the document plus the segment's first 8 tokens, so the
  greedy answer (known) reproduces the segment and then walks on where the document has nothing: copy 1.0,
  commands 0.8, edit 0.5, quote 0.3, summary and qa 0. Every answer is judged against the chain.

Per task: tokens per step (1 + accepted / drafts from the /metrics deltas around the request, bench/report.py),
decode tok/s (tokens after the first over the time after the first, from the stream), TTFT, prefix-cache hit
tokens, answer length; `all`: tokens per step and decode rate over every task together. Every prompt shares the
document, under one cache_salt per run: an unmeasured warm-up (the first task, 16 tokens; --no-warmup skips it)
puts it in the prefix cache and compiles the shapes, so TTFT is a follow-up turn's. Report: OUT/TAG-labd.json
with the date, machine and server facts (bench/harness.py). Exit 0, 1 when a judged answer failed, 2 on bad
input, 3 when the server cannot be used.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # also run as a file: python bench/labd_bench.py
    sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402
from bench import verbatim as vb  # noqa: E402

SCHEMA = "qwen-serving labd-bench/1"
CUE_TOKENS = 8
COPY_LINES = 60
PROMPT_RESERVE = 256  # tokens of the chat template and the instruction around the document
WARMUP_TOKENS = 16
COPY_MARGIN_TOKENS = 64  # the copy's budget beyond its lines' own tokens


@dataclass(frozen=True)
class Task:
    instruction: str  # after a text document
    max_tokens: int
    quoted_share: float  # scripted documents: the share of the answer the document holds


TASKS = {
    "copy": Task(f"Reproduce the first {COPY_LINES} lines of the document above verbatim, exactly as they are "
                 "written, and nothing else.", 1024, 1.0),
    "edit": Task("Rewrite the document above to about half its length. Keep every line of code exactly as it is.",
                 768, 0.5),
    "quote": Task("Quote the three sentences of the document above that matter most, word for word, and explain "
                  "each one in a sentence.", 512, 0.3),
    "commands": Task("Reproduce every line of code in the document above, verbatim and in order, and nothing else.",
                     768, 0.8),
    "summary": Task("Summarise the document above in about 200 words.", 384, 0.0),
    "qa": Task("What is the document above about, and who or what appears in it? Answer in a few sentences.",
               192, 0.0),
}


def budgets(names: list[str], cap: int | None) -> dict[str, int]:
    return {n: min(TASKS[n].max_tokens, cap or TASKS[n].max_tokens) for n in names}


def text_document(tokenizer: vb.ServerTokenizer, source: str, target: int, repeat: bool) -> tuple[str, int]:
    """(document, copies of the source in it): `source` repeated under part headings (when `repeat`) until it
    holds `target` tokens, then cut back by whole lines to at most `target`."""
    parts, copies = [source], 1
    while repeat and tokenizer.count("\n\n".join(parts)) < target:
        copies += 1
        parts.append(f"## Part {copies}\n\n{source}")
    lines = "\n\n".join(parts).splitlines()
    lo, hi = 1, len(lines)  # the most lines that fit: binary search over the server's token counts
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tokenizer.count("\n".join(lines[:mid])) <= target else (lo, mid - 1)
    return "\n".join(lines[:lo]), copies


def text_cases(client: serving.Client, model: str, names: list[str], ctx: int, cap: int | None,
               document: Path | None) -> tuple[list[vb.Case], dict]:
    tokenizer = vb.ServerTokenizer(client, model)
    tokens = budgets(names, cap)
    source = document.read_text().strip() if document else vb.default_text()
    target = ctx - max(tokens.values()) - PROMPT_RESERVE
    if target < 64:
        raise ValueError(f"--ctx {ctx} leaves no room for a document after the answers and the prompt")
    doc, copies = text_document(tokenizer, source, target, repeat=document is None)
    first_lines = "\n".join(doc.splitlines()[:COPY_LINES])
    copy_needs = tokenizer.count(first_lines) + COPY_MARGIN_TOKENS
    facts = {"source": "text", "document": str(document or "bench/texts (code, en, da)"),
             "document_tokens": tokenizer.count(doc), "source_copies": copies}
    cases = []
    for name in names:
        expected = first_lines if name == "copy" and tokens[name] >= copy_needs else None
        if name == "copy" and expected is None:
            facts["copy_not_judged"] = f"its budget of {tokens[name]} tokens is below the {copy_needs} its lines need"
        budget = min(tokens[name], copy_needs) if name == "copy" else tokens[name]
        prompt = tokenizer.chat(f"<document>\n{doc}\n</document>\n\n{TASKS[name].instruction}")
        cases.append(vb.Case(name, prompt, expected, budget))
    return cases, facts


def scripted_cases(model_dir: Path, seed: int, names: list[str], ctx: int, cap: int | None
                   ) -> tuple[list[vb.Case], dict]:
    chain = vb.ScriptedChain(model_dir, seed)
    tokens = budgets(names, cap)
    needed = sum(CUE_TOKENS + n for n in tokens.values())
    if needed > len(chain.cycle):
        raise ValueError(f"the tasks' answers need {needed} distinct chain tokens, the cycle has {len(chain.cycle)}: "
                         "lower --max-tokens")
    doc_len = ctx - CUE_TOKENS - max(tokens.values())
    slot = doc_len // len(names)
    doc = chain.filler(doc_len)
    start = chain.rng.randrange(len(chain.cycle))
    cases = []
    for i, name in enumerate(names):
        answer_len = tokens[name]
        segment = chain.segment(start, CUE_TOKENS + answer_len)
        start += len(segment)  # the next task's chain starts after this one's answer: no answer holds another's
        quoted = round(TASKS[name].quoted_share * answer_len)
        if quoted:
            if CUE_TOKENS + quoted > slot:
                raise ValueError(f"--ctx {ctx} is too short to hold the {name} task's {quoted} quoted tokens")
            at = i * slot + chain.rng.randrange(slot - CUE_TOKENS - quoted + 1)
            doc[at:at + CUE_TOKENS + quoted] = segment[:CUE_TOKENS + quoted]
        cue = segment[:CUE_TOKENS]
        cases.append(vb.Case(name, doc + cue, chain.answer(cue[-1], answer_len), answer_len))
    return cases, {"source": "scripted", "document": str(model_dir), "document_tokens": doc_len, "seed": seed}


def build_cases(args: argparse.Namespace, client: serving.Client, model: str) -> tuple[list[vb.Case], dict]:
    if args.scripted:
        return scripted_cases(args.scripted, args.seed, args.tasks, args.ctx, args.max_tokens)
    return text_cases(client, model, args.tasks, args.ctx, args.max_tokens, args.document)


def overall(rows: dict[str, dict]) -> dict:
    """Every task together: 1 + accepted / drafts, and decode tokens over decode time."""
    drafts = sum(r["drafts"] for r in rows.values())
    accepted = sum(r["accepted_tokens"] for r in rows.values())
    timed = [r for r in rows.values() if r["decode_s"]]
    decode_s = sum(r["decode_s"] for r in timed)
    return {"tokens_per_step": round(1 + accepted / drafts, 4) if drafts else 1.0,
            "decode_tok_s": round(sum(r["completion_tokens"] - 1 for r in timed) / decode_s, 2) if decode_s else None,
            "completion_tokens": sum(r["completion_tokens"] for r in rows.values())}


def markdown(report: dict) -> str:
    lines = ["| task | tokens/step | decode tok/s | TTFT ms | prompt | answer | judged |", "|---|---|---|---|---|---|---|"]
    for name, r in {**report["tasks"], "all": report.get("all", {})}.items():
        lines.append(f"| {name} | {r.get('tokens_per_step', '-')} | {r.get('decode_tok_s', '-')} | "
                     f"{r.get('ttft_ms', '-')} | {r.get('prompt_tokens', '-')} | {r.get('completion_tokens', '-')} | "
                     f"{r.get('verdict', '-')} |")
    return "\n".join(lines) + "\n"


def add_common_args(p: argparse.ArgumentParser, ctx_default: int) -> None:
    """The flags labd_bench and labd_soak share."""
    vb.add_run_args(p)
    p.add_argument("--ctx", type=int, default=ctx_default, help="context length: prompt + answer (default %(default)s)")
    p.add_argument("--max-tokens", type=int, help="cap every task's answer budget (default: each task's own)")


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace, prefix: str) -> None:
    vb.check_run_args(p, args, prefix)
    if args.ctx < 256 or (args.max_tokens is not None and args.max_tokens < 1):
        p.error("--ctx must be >= 256 and --max-tokens >= 1")


def parse_task_list(p: argparse.ArgumentParser, value: str) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()]
    unknown = [x for x in names if x not in TASKS]
    if unknown or not names or len(set(names)) != len(names):
        p.error(f"tasks {value!r}: distinct names from {', '.join(TASKS)}")
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/labd_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tag", nargs="?", help="report name: OUT/TAG-labd.json (default: labd-<date>-<time>)")
    add_common_args(p, 20000)
    p.add_argument("--tasks", default=",".join(TASKS), help="which tasks, in order (default %(default)s)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the unmeasured warm-up request")
    args = p.parse_args(argv)
    check_common_args(p, args, "labd")
    args.tasks = parse_task_list(p, args.tasks)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    opened = vb.open_run(args, SCHEMA, "labd", "labd_bench", lambda client, model: build_cases(args, client, model))
    if isinstance(opened, int):
        return opened
    path, client, report, (cases, facts) = opened
    model = report["server"]["model"]["id"]
    salt = f"{args.tag}-{secrets.token_hex(4)}"
    ignore_eos = bool(args.scripted)
    report.update(settings={"ctx": args.ctx, "tasks": args.tasks, "salt": salt, "warmup": args.warmup, **facts,
                            "max_tokens": {c.name: c.max_tokens for c in cases}}, tasks={})
    try:
        if args.warmup:
            first = cases[0]
            vb.ask(client, model, vb.Case("warmup", first.prompt, None, WARMUP_TOKENS), salt=salt, ignore_eos=ignore_eos)
        page = None
        for case in cases:
            _, row, page = vb.ask_measured(client, model, case, salt=salt, ignore_eos=ignore_eos, before=page)
            report["tasks"][case.name] = row
            report["all"] = overall(report["tasks"])
            serving.write_json_atomic(path, report)
            print(f"{case.name}: {row['tokens_per_step']:.2f} tokens/step, {row['decode_tok_s']} decode tok/s, "
                  f"{row['completion_tokens']} tokens" + (f", {row['verdict']}" if "verdict" in row else ""), flush=True)
    except (OSError, ValueError) as err:
        report["error"] = str(err)
        serving.write_json_atomic(path, report)
        print(f"labd_bench: a request failed: {err}", file=sys.stderr)
        return 3
    print(markdown(report), end="")
    print(f"wrote {path}")
    return 1 if any(not r.get("passed", True) for r in report["tasks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
