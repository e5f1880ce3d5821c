"""The verbatim judge: how much of a document came back in an answer, and the copy requests it judges
(bench/residue_sweep.py, bench/labd_bench.py, bench/labd_soak.py).

    python bench/verbatim.py                                  # the self-test: the five shapes, exit 1 on a miss
    python bench/verbatim.py --document DOC.txt --answer ANSWER.txt [--json]   # judge one answer (text)

The judge compares sequences: token ids (the scripted checkpoint, whose greedy answer is known as ids) or text
(a real model; characters, outer whitespace of both ignored). It measures
- common_prefix: how many elements answer and document share from the start; first_divergence is where that
  run ends (None when the answer is the document);
- matched runs: the answer aligned to the document, left to right, as runs of at least `min_run` equal elements
  (8 tokens or 24 characters: shorter coincidences are what two unrelated texts in one language share);
  longest_run is the longest of them, coverage the share of the document those runs cover;
and a verdict, which is the shape of the answer, because the spec's corrupted residue did not fail one way:
it returned an empty answer, a one-character answer and fluent text of its own (2 of 1,146 characters).
- `empty`: nothing (or only whitespace);
- `verbatim`: the answer is the document;
- `embedded`: the whole document in one run, with other text around it (a fence, a preamble);
- `truncated`: one clean run from the document's start to the answer's end, short of the document's end;
- `corrupted`: most of the document came back (coverage >= 0.5), but not in one run;
- `unrelated`: most of the document did not come back.
Only `verbatim` and `embedded` pass.

The copy requests: a `Case` is a prompt as token ids and what its answer must reproduce (ids or text); `ask`
sends it to /v1/completions (token-id prompts are a list of ints there), greedy, streamed, with the answer's
token ids. Text prompts are rendered by the server's own chat template and tokenizer (/tokenize), so a real model
gets its chat format and the tools know every prompt's exact length. `--scripted DIR` in the tools builds
documents from a scripted checkpoint's chain instead (docs/scripted-model.md): its greedy output is known.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # also run as a file: python bench/verbatim.py
    sys.path.insert(0, str(REPO))

from bench import harness, serving  # noqa: E402
from bench import report as br  # noqa: E402

MIN_RUN = {"tokens": 8, "chars": 24}
COVERED_MIN = 0.5  # corrupted (most came back) vs unrelated
MAX_CANDIDATES = 64  # document positions tried per answer position (a repetitive document has many)
PASSING = ("verbatim", "embedded")
TEXTS = REPO / "bench" / "texts"
NO_THINK = {"enable_thinking": False}

Seq = str | Sequence[int]


# ---------------------------------------------------------------------------------------------
# The judge


@dataclass(frozen=True)
class Judgement:
    units: str  # tokens | chars
    document_len: int
    answer_len: int
    common_prefix: int
    first_divergence: int | None
    longest_run: int
    coverage: float
    runs: int
    verdict: str
    passed: bool

    def line(self) -> str:
        where = "-" if self.first_divergence is None else self.first_divergence
        return (f"{self.verdict}: {self.answer_len} {self.units} against {self.document_len}, prefix "
                f"{self.common_prefix}, longest run {self.longest_run}, coverage {self.coverage:.1%}, "
                f"first divergence {where}")

    def to_dict(self) -> dict:
        return asdict(self)


def _units(document: Seq, answer: Seq) -> str:
    if isinstance(document, str) != isinstance(answer, str):
        raise TypeError("judge text against text and token ids against token ids")
    return "chars" if isinstance(document, str) else "tokens"


def _extend(answer: Seq, i: int, document: Seq, p: int) -> int:
    m = 0
    while i + m < len(answer) and p + m < len(document) and answer[i + m] == document[p + m]:
        m += 1
    return m


def matched_runs(document: Seq, answer: Seq, min_run: int) -> list[tuple[int, int, int]]:
    """(answer start, document start, length) of each run, scanning the answer left to right: at each position the
    longest run starting there (ties: the document position nearest after the previous run), then past it."""
    k = min(min_run, len(document))
    if k == 0 or len(answer) < k:
        return []
    gram = (lambda s, i: s[i:i + k]) if isinstance(document, str) else (lambda s, i: tuple(s[i:i + k]))
    index: dict[Any, list[int]] = {}
    for p in range(len(document) - k + 1):
        index.setdefault(gram(document, p), []).append(p)
    runs, i, expected = [], 0, 0
    while i + k <= len(answer):
        positions = index.get(gram(answer, i))
        if not positions:
            i += 1
            continue
        at = bisect.bisect_left(positions, expected)
        nearest = positions[max(0, at - MAX_CANDIDATES // 2):at + MAX_CANDIDATES // 2]
        length, p = max((_extend(answer, i, document, p), -abs(p - expected), p) for p in nearest)[::2]
        runs.append((i, p, length))
        expected, i = p + length, i + length
    return runs


def judge(document: Seq, answer: Seq, min_run: int | None = None) -> Judgement:
    """How much of `document` came back verbatim in `answer` (module docstring)."""
    units = _units(document, answer)
    if units == "chars":
        document, answer = document.strip(), answer.strip()
    else:
        document, answer = list(document), list(answer)
    prefix = _extend(answer, 0, document, 0)
    runs = matched_runs(document, answer, min_run or MIN_RUN[units])
    covered, reach = 0, 0
    for _, p, length in sorted(runs, key=lambda r: r[1]):  # the union of the runs' document spans
        covered += max(0, p + length - max(p, reach))
        reach = max(reach, p + length)
    coverage = covered / len(document) if document else 0.0
    longest = max((r[2] for r in runs), default=prefix)
    if not answer:
        verdict = "empty"
    elif answer == document:
        verdict = "verbatim"
    elif document and longest == len(document):
        verdict = "embedded"
    elif prefix == len(answer) or (len(runs) == 1 and runs[0][1] == 0 and sum(runs[0][::2]) == len(answer)):
        verdict = "truncated"
    elif coverage >= COVERED_MIN:
        verdict = "corrupted"
    else:
        verdict = "unrelated"
    return Judgement(units, len(document), len(answer), prefix, None if answer == document else prefix, longest,
                     round(coverage, 6), len(runs), verdict, verdict in PASSING)


# ---------------------------------------------------------------------------------------------
# The self-test: the three shapes the spec saw, a clean copy, one corrupted token


def self_test_cases() -> list[tuple[str, Seq, Seq, str]]:
    """(name, document, answer, expected verdict), on a text document (the start of bench/texts/en.txt, with
    bench/texts/da.txt as the fluent answer of another text) and on a token-id document."""
    text = TEXTS.joinpath("en.txt").read_text()[:1200]
    danish = TEXTS.joinpath("da.txt").read_text()[:1200]
    words = text.split(" ")
    middle = len(words) // 2
    one_word_off = " ".join(words[:middle] + ["harbour" if words[middle] != "harbour" else "ferry"] + words[middle + 1:])
    ids = random.Random(0).sample(range(1000, 9000), 400)
    one_id_off = ids[:200] + [ids[200] + 1] + ids[201:]
    return [
        ("text: a correct copy", text, text + "\n", "verbatim"),
        ("text: the copy inside a fence", text, "Here it is:\n```\n" + text + "\n```", "embedded"),
        ("text: empty", text, "  \n", "empty"),
        ("text: one character", text, text[0], "truncated"),
        ("text: truncated copy", text, text[:500], "truncated"),
        ("text: fluent but wrong", text, danish, "unrelated"),
        ("text: one word corrupted in the middle", text, one_word_off, "corrupted"),
        ("ids: a correct copy", ids, ids, "verbatim"),
        ("ids: empty", ids, [], "empty"),
        ("ids: truncated copy", ids, ids[:150], "truncated"),
        ("ids: fluent but wrong (another sequence)", ids, random.Random(1).sample(range(1000, 9000), 400), "unrelated"),
        ("ids: one token corrupted in the middle", ids, one_id_off, "corrupted"),
    ]


def self_test() -> list[dict]:
    return [{"case": name, "expected": want, **judge(doc, answer).to_dict()}
            for name, doc, answer, want in self_test_cases()]


# ---------------------------------------------------------------------------------------------
# Copy requests


@dataclass(frozen=True)
class Case:
    """One judged request: the prompt as token ids, what the answer must reproduce, and its token budget."""

    name: str
    prompt: list[int]
    expected: list[int] | str | None  # token ids (scripted checkpoint), text (a real model), None: not judged
    max_tokens: int


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int
    seconds: float  # request sent -> stream ended
    ttft_s: float | None  # request sent -> first token
    decode_s: float | None  # first token -> last token
    extra: dict = field(default_factory=dict)

    def judged_against(self, expected: list[int] | str) -> Judgement:
        return judge(expected, self.text if isinstance(expected, str) else self.token_ids)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first (a streamed chunk can carry several tokens)."""
        if not self.decode_s or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / self.decode_s


def request_body(model: str, case: Case, salt: str | None, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": case.prompt, "max_tokens": case.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if ignore_eos:
        body["ignore_eos"] = True
    if salt:
        body["cache_salt"] = salt  # vLLM folds it into the first block hash: another salt never hits this cache
    return body


def ask(client: serving.Client, model: str, case: Case, *, salt: str | None = None, ignore_eos: bool = False,
        timeout_s: float = 600) -> Answer:
    """One greedy completion of `case`, streamed: its text, token ids and timing."""
    text, ids, finish, usage = [], [], None, {}
    start = time.monotonic()
    first = last = None
    for _, data in client.post_events("/v1/completions", request_body(model, case, salt, ignore_eos), timeout_s):
        if data == serving.SSE_DONE:
            break
        if "error" in data:
            raise serving.HttpError("POST", client.base + "/v1/completions", 200, json.dumps(data))
        usage = data.get("usage") or usage
        for choice in data.get("choices") or []:
            piece, piece_ids = choice.get("text") or "", choice.get("token_ids") or []
            if piece or piece_ids:
                last = time.monotonic()
                first = first or last
            text.append(piece)
            ids.extend(piece_ids)
            finish = choice.get("finish_reason") or finish
    end = time.monotonic()
    completion = usage.get("completion_tokens", len(ids))
    return Answer("".join(text), ids, finish, usage.get("prompt_tokens"), completion, end - start,
                  None if first is None else first - start, None if first is None else last - first)


def ask_measured(client: serving.Client, model: str, case: Case, *, salt: str | None = None, ignore_eos: bool = False,
                 before: br.MetricsSnapshot | None = None, timeout_s: float = 600
                 ) -> tuple[Answer, dict, br.MetricsSnapshot]:
    """ask() alone on the server, between two /metrics pages: the answer, its figures (tokens per step and
    acceptance as bench/report.py defines them, prefix-cache hit tokens, decode rate, TTFT, the judgement when
    the case has an expected answer) and the page after it (the next request's `before`)."""
    before = before or harness.metrics(client.base, client.key)
    answer = ask(client, model, case, salt=salt, ignore_eos=ignore_eos, timeout_s=timeout_s)
    after = harness.metrics(client.base, client.key)
    delta = br.metrics_delta(before, after)
    spec = br.spec_figures(delta)
    figures = {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
               "finish_reason": answer.finish_reason, "cache_hit_tokens": int(delta.counters["prefix_cache_hits"]),
               "tokens_per_step": round(spec["tokens_per_step"], 4), "drafts": spec["drafts"],
               "accepted_tokens": spec.get("accepted_tokens", 0),
               "per_position_acceptance": [round(a, 4) for a in spec["per_position_acceptance"]],
               "decode_tok_s": None if answer.decode_tok_s is None else round(answer.decode_tok_s, 2),
               "decode_s": answer.decode_s, "ttft_ms": None if answer.ttft_s is None else round(answer.ttft_s * 1e3, 1),
               "seconds": round(answer.seconds, 3)}
    if case.expected is not None:
        verdict = answer.judged_against(case.expected)
        figures.update(verdict.to_dict(), answer_head=None if verdict.verdict == "verbatim" else answer.text[:160])
    return answer, figures, after


# ---------------------------------------------------------------------------------------------
# Prompts: the server's tokenizer for text, a scripted design for ids


class ServerTokenizer:
    """The served model's chat template and tokenizer, through vLLM's /tokenize (thinking off)."""

    FILLERS = (" .", " -", " *", " x")  # a filler line's unit; the first that is one repeatable token is used

    def __init__(self, client: serving.Client, model: str):
        self.client, self.model = client, model

    def chat(self, content: str) -> list[int]:
        out = self.client.post_json("/tokenize", {"model": self.model, "messages": [{"role": "user", "content": content}],
                                                  "add_generation_prompt": True, "chat_template_kwargs": NO_THINK})
        return list(out["tokens"])

    def count(self, text: str) -> int:
        out = self.client.post_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return int(out["count"])

    def padded(self, before: str, after: str) -> Layout:
        """The chat prompt of `before` + n filler units + `after` as a Layout (n >= 1): a prompt of any length
        from one message, sent as ids. The filler is found by tokenizing one and two units."""
        for unit in self.FILLERS:
            one, two = self.chat(before + unit + after), self.chat(before + unit * 2 + after)
            at = next((i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b), len(one))
            if at and len(two) == len(one) + 1 and two[:at] + two[at + 1:] == one and two[at] == two[at - 1]:
                return Layout(one[:at - 1], two[at], one[at:])
        raise ValueError(f"the server's tokenizer merges every filler unit {self.FILLERS}: no exact prompt lengths")


@dataclass(frozen=True)
class Layout:
    """A prompt of any length >= minimum: head, `n` filler ids, tail."""

    head: list[int]
    filler: int
    tail: list[int]

    @property
    def minimum(self) -> int:
        return len(self.head) + 1 + len(self.tail)

    def prompt(self, length: int) -> list[int]:
        if length < self.minimum:
            raise ValueError(f"a prompt of {length} tokens is shorter than its layout's {self.minimum}")
        return self.head + [self.filler] * (length - len(self.head) - len(self.tail)) + self.tail


class ScriptedChain:
    """A scripted checkpoint's chain (docs/scripted-model.md): greedy decoding follows it whatever the context,
    so a prompt's answer is known as ids. Segments are cut from one walk around the cycle; fillers are seeded
    active tokens (no chain bigrams, so the context lookup finds nothing in them)."""

    def __init__(self, model_dir: Path, seed: int = 0):
        from qwen_serving.checkpoint.scripted import Design  # torch: only where a scripted checkpoint is used

        self.design = Design.read(model_dir)
        self.cycle = self.design.walk(self.design.active[0], len(self.design.active) - 1)
        self.rng = random.Random(seed)

    def segment(self, start: int, length: int) -> list[int]:
        if length > len(self.cycle):
            raise ValueError(f"{length} chain tokens do not fit the {len(self.cycle)}-token cycle")
        return [self.cycle[(start + j) % len(self.cycle)] for j in range(length)]

    def filler(self, length: int) -> list[int]:
        return [self.rng.choice(self.design.active) for _ in range(length)]

    def answer(self, last_token: int, length: int) -> list[int]:
        """The greedy answer after a prompt ending in `last_token`."""
        return self.design.walk(last_token, length)[1:]


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The server, document and report flags every labd tool shares (what open_run reads)."""
    p.add_argument("--url", default="http://127.0.0.1:18020")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    add_source_args(p)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--force", action="store_true", help="overwrite an existing report of this tag")


def check_run_args(p: argparse.ArgumentParser, args: argparse.Namespace, prefix: str) -> None:
    """The document checks, and the report's tag: a plain file name, default PREFIX-<date>-<time>."""
    check_source_args(p, args)
    args.tag = args.tag or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    if "/" in args.tag or args.tag.startswith("."):
        p.error(f"tag {args.tag!r}: a plain file name please")


def add_source_args(p: argparse.ArgumentParser) -> None:
    """The document flags every labd tool shares."""
    p.add_argument("--scripted", type=Path, metavar="MODEL_DIR",
                   help="the served scripted checkpoint: documents are its chain, prompts token ids, the greedy "
                        "answer known (default: text documents through the server's chat template)")
    p.add_argument("--document", type=Path, help="a text document (default: bench/texts)")
    p.add_argument("--seed", type=int, default=0, help="the scripted documents' seed (default %(default)s)")


def check_source_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.scripted and not (args.scripted / "scripted.json").is_file():
        p.error(f"--scripted {args.scripted}: no scripted.json (not a scripted checkpoint)")
    if args.scripted and args.document:
        p.error("--scripted and --document: one source please")
    if args.document and not args.document.is_file():
        p.error(f"--document {args.document}: no such file")


def default_text() -> str:
    """The bundled held-out texts, one after another (bench/texts/README.md), code first: a document's first
    60 lines are then code, the coding assistant's copy."""
    return "\n\n".join(TEXTS.joinpath(name).read_text().strip() for name in ("code.txt", "en.txt", "da.txt"))


def report_header(schema: str, tag: str, client: serving.Client) -> dict:
    """What every labd report starts with: the date, the machine (GPU, driver, harness commit) and the server
    (vLLM version, model, cache config; its whole config in dev mode), as bench/harness.py records them."""
    return {"schema": schema, "tag": tag, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": harness.machine_facts(), "server": harness.server_facts(client.base, client.key)}


def open_run(args: argparse.Namespace, schema: str, suffix: str, tool: str, build: Callable[[serving.Client, str], Any]):
    """The start every labd tool shares: (report path OUT/TAG-suffix.json, client, report header, what
    `build(client, model)` made of the server), or the exit code after one line on stderr: 2 for a report that
    exists (without --force) or bad input (a ValueError of `build`), 3 for a server that cannot be used."""
    path = args.out / f"{args.tag}-{suffix}.json"
    if path.exists() and not args.force:
        print(f"{tool}: {path} exists (pick another tag, or --force)", file=sys.stderr)
        return 2
    client = serving.Client(args.url, serving.api_key(args.api_key))
    try:
        report = report_header(schema, args.tag, client)
        built = build(client, report["server"]["model"]["id"])
    except ValueError as err:
        print(f"{tool}: {err}", file=sys.stderr)
        return 2
    except (OSError, KeyError, IndexError) as err:
        print(f"{tool}: no usable vLLM server at {args.url}: {err}", file=sys.stderr)
        return 3
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, client, report, built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/verbatim.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--document", type=Path, help="the document (text file); with --answer, judge that answer")
    p.add_argument("--answer", type=Path, help="the answer (text file)")
    p.add_argument("--json", action="store_true", help="print the judgement (or the self-test) as JSON")
    args = p.parse_args(argv)
    if bool(args.document) != bool(args.answer):
        p.error("--document and --answer go together (neither: the self-test)")
    if args.document:
        result = judge(args.document.read_text(), args.answer.read_text())
        print(json.dumps(result.to_dict(), indent=2) if args.json else result.line())
        return 0 if result.passed else 1
    rows = self_test()
    missed = [r for r in rows if r["verdict"] != r["expected"]]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            mark = "ok  " if r["verdict"] == r["expected"] else "MISS"
            print(f"{mark} {r['case']}: {r['verdict']} (expected {r['expected']}), prefix {r['common_prefix']}, "
                  f"longest run {r['longest_run']}, coverage {r['coverage']:.1%}")
        print(f"verbatim self-test: {len(rows) - len(missed)}/{len(rows)} shapes judged as expected")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
