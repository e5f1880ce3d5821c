"""The quality battery: what quantization costs, measured against a running server (docs/quality.md).

    python -m bench.quality_battery TAG --url URL [--gsm8k-n 200] [--gsm8k-file test.jsonl] [--parts ...]
    python -m bench.quality_battery TAG --url URL --expect-scripted MODEL_DIR   # scripted checkpoint check

- **perplexity**: the bundled held-out texts (bench/texts/: English, Danish, code), each sent as one
  completions prompt with `prompt_logprobs` (vLLM 0.28.0: the raw log-softmax of the model's logits at every
  prompt position, the first position has none). Perplexity = exp(mean negative log-likelihood) over the
  scored tokens, per text and pooled over all of them.
- **gsm8k**: the first N questions of GSM8K's test split (OpenAI's file at a pinned commit, checked against its
  sha256; `--gsm8k-file` for a machine without network), chat completions, greedy, thinking off, exact match of
  the final number (`final_number`: the rule is in its docstring).
- **scripted** (`--expect-scripted MODEL_DIR`): perplexity of walks sampled from a scripted checkpoint's
  context-free table, sent as token ids, judged against the perplexity of the same tokens under the float32
  reference forward of the checkpoint's tensors; the table's own perplexity of them is recorded beside it
  (docs/quality.md says why walks and not text).

Results: `OUT/TAG-quality.json` (written beside and renamed after every item, so a stopped run keeps what it
measured; run the same command again and it continues), and a table on stdout. IFBench is not included: see
bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # also run as a file: python bench/quality_battery.py
    sys.path.insert(0, str(REPO))

from bench import harness, serving  # noqa: E402

SCHEMA = "qwen-serving quality-battery/1"
TEXTS = REPO / "bench" / "texts"
TEXT_FILES = {"en": "en.txt", "da": "da.txt", "code": "code.txt"}
PARTS = ("perplexity", "gsm8k", "scripted")

# GSM8K's test split as OpenAI published it (MIT licence), pinned to a commit and checked by hash
GSM8K_URL = ("https://raw.githubusercontent.com/openai/grade-school-math/3101c7d5072418e28b9008a6636bde82a006892c/"
             "grade_school_math/data/test.jsonl")
GSM8K_SHA256 = "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
GSM8K_INSTRUCTION = ("Solve the following math problem step by step. End your answer with a line of the form "
                     "'#### <number>' holding only the final numeric answer.")
GSM8K_MAX_TOKENS = 2048

SCRIPTED_TOLERANCE = 0.005  # relative perplexity difference, battery vs the reference forward
SCRIPTED_WALK_SEED = 0


class BatteryError(RuntimeError):
    """A run that cannot go on (no data, a results file of another run): one line for the user."""


# ---------------------------------------------------------------------------------------------
# GSM8K: the final number


_NUMBER = re.compile(r"(?<![\w.])\$?[-\u2212]?\$?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_MARKER = "####"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def normalize_number(text: str) -> str | None:
    """A number as written ("$1,234.50", "-7", "3.0", "\u22125") -> its canonical decimal string ("1234.5",
    "-7", "3", "-5"); None when `text` is not a number."""
    cleaned = text.strip().replace("\u2212", "-").replace("$", "").replace(",", "").replace(" ", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    value = value.normalize()
    if value == 0:
        return "0"  # "-0" and "0.00"
    return format(value, "f")


def _numbers(text: str) -> list[str]:
    return [n for n in (normalize_number(m.group(0)) for m in _NUMBER.finditer(text)) if n is not None]


def final_number(answer: str) -> str | None:
    """The final numeric answer of a model's (or GSM8K's reference) solution, canonical (normalize_number).

    The rule, in order:
    1. text after the last "####": its first number ("#### 42", "#### $1,000.", "####-3");
    2. else the last \\boxed{...}: its last number;
    3. else the last number anywhere in the text.
    A number is an optional minus sign (also U+2212), an optional "$", digits with optional comma
    thousands separators ("1,234" but not "1,23"), an optional decimal part; a period that ends a sentence is
    not a decimal point ("is 42." -> 42); a number glued to a letter or a period ("v1.2", "x2") is not read. "50%" is 50.
    Values compare as decimals: "3.0" equals "3", "0.50" equals "0.5". None when no number is found.
    """
    if _MARKER in answer:
        after = _numbers(answer.rsplit(_MARKER, 1)[1])
        if after:
            return after[0]
    boxed = _BOXED.findall(answer)
    if boxed:
        inside = _numbers(boxed[-1])
        if inside:
            return inside[-1]
    found = _numbers(answer)
    return found[-1] if found else None


def gsm8k_questions(path: Path | None, n: int, *, url: str = GSM8K_URL, sha256: str = GSM8K_SHA256,
                    timeout_s: float = 60) -> tuple[list[dict], dict]:
    """The first n questions ({question, answer}) and where they came from. From `path` when given,
    else downloaded from the pinned URL and checked against its sha256; a BatteryError says what to do
    when the machine has no network."""
    if path is not None:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise BatteryError(f"--gsm8k-file {path}: {err.strerror or err}") from None
        source = {"file": str(path), "sha256": hashlib.sha256(data).hexdigest()}
    else:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                data = response.read()
        except OSError as err:
            raise BatteryError(f"could not download GSM8K ({url}): {getattr(err, 'reason', err)}. Without network, "
                               f"fetch that file elsewhere and pass --gsm8k-file PATH, or leave gsm8k out of --parts"
                               ) from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise BatteryError(f"GSM8K download from {url} has sha256 {digest}, expected {sha256}")
        source = {"url": url, "sha256": digest}
    items = []
    for lineno, line in enumerate(data.decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append({"question": row["question"], "answer": row["answer"]})
        except (ValueError, KeyError, TypeError):
            raise BatteryError(f"GSM8K file line {lineno}: not a JSON object with question and answer") from None
    if len(items) < n:
        raise BatteryError(f"GSM8K file has {len(items)} questions, --gsm8k-n asks for {n}")
    source["questions_in_file"] = len(items)
    return items[:n], source


def gsm8k_request(model: str, question: str, max_tokens: int) -> dict:
    return {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": f"{GSM8K_INSTRUCTION}\n\n{question}"}]}


def score_gsm8k(item: dict, answer_text: str) -> dict:
    reference = final_number(item["answer"])
    extracted = final_number(answer_text)
    return {"reference": reference, "extracted": extracted, "correct": extracted is not None and extracted == reference,
            "answer": answer_text}


# ---------------------------------------------------------------------------------------------
# Perplexity from prompt logprobs


def prompt_token_logprobs(client: serving.Client, model: str, prompt: str | list[int], top: int = 1
                          ) -> list[dict]:
    """One completions call with prompt logprobs; per scored prompt position (all but the first):
    {"token", "logprob", "top": the server's rank-1 token}. vLLM 0.28.0 returns `prompt_logprobs` as a list of
    {token id: {logprob, rank, decoded_token}} (None first) holding the prompt token plus the top `top`."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": top,
            "return_token_ids": True}
    out = client.post_json("/v1/completions", body)
    choice = out["choices"][0]
    ids, per_position = choice.get("prompt_token_ids"), choice.get("prompt_logprobs")
    if ids is None or per_position is None:
        raise BatteryError("the server's completion has no prompt_token_ids / prompt_logprobs (not vLLM >= 0.28?)")
    if len(ids) != len(per_position) or len(ids) < 2:
        raise BatteryError(f"{len(ids)} prompt tokens against {len(per_position)} prompt logprobs")
    scored = []
    for token, entry in zip(ids[1:], per_position[1:], strict=True):
        entry = {int(k): v for k, v in entry.items()}
        best = min(entry, key=lambda k: entry[k].get("rank") or math.inf)
        scored.append({"token": token, "logprob": float(entry[token]["logprob"]), "top": best})
    return scored


def perplexity(logprobs: Iterable[float]) -> dict:
    values = list(logprobs)
    nll = -sum(values)
    return {"tokens": len(values), "nll": nll, "ppl": math.exp(nll / len(values))}


def pooled(parts: Iterable[dict]) -> dict:
    parts = list(parts)
    tokens, nll = sum(p["tokens"] for p in parts), sum(p["nll"] for p in parts)
    return {"tokens": tokens, "nll": nll, "ppl": math.exp(nll / tokens)}


def text_sources(texts_dir: Path = TEXTS) -> dict[str, dict]:
    out = {}
    for name, file in TEXT_FILES.items():
        data = (texts_dir / file).read_bytes()
        out[name] = {"file": file, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return out


# ---------------------------------------------------------------------------------------------
# The scripted checkpoint's closed forms (torch: only with --expect-scripted)


def scripted_walks(table: ContextFreeTable, tokens: int, walk_len: int, seed: int = SCRIPTED_WALK_SEED
                   ) -> list[list[int]]:
    """Walks of `walk_len` ids (the last one shorter) that score `tokens` tokens in all, sampled at temperature 1
    from the checkpoint's context-free table, each from a seeded active token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    walks, left = [], tokens
    while left > 0:
        length = min(walk_len, left + 1)  # a walk of L ids scores L - 1 tokens
        walk = [table.active[int(torch.randint(len(table.active), (1,), generator=gen))]]
        while len(walk) < length:
            walk.append(table.sample(walk[-1], gen))
        walks.append(walk)
        left -= length - 1
    return walks


class ContextFreeTable:
    """The scripted design's Markov next-token distribution from the checkpoint's tensors: rows of
    lm_head(norm(embed(t))) for every active t, without the residual branches (the walks' sampling distribution
    and the design check's closed form; the judged one is forward_logprobs). Kept as the log-normalizer over the
    whole vocabulary and the float64 logits of the active columns: at full size the whole table is
    3,800 x 248,320, the active block 3,800 x 3,800. Inactive tokens sit 28 logits below the background, so
    sampling among the active columns leaves out ~1e-9 of the mass a step; the closed form of a token is exact
    either way (its logit minus the full normalizer)."""

    def __init__(self, ref, active: list[int]):
        import torch

        self.active = list(active)
        self.index = {t: i for i, t in enumerate(self.active)}
        logits = ref.context_free_logits(self.active)  # [n, V] float32 on the reference's device
        columns = torch.tensor(self.active, device=logits.device)
        self.lse = torch.cat([row.double().logsumexp(-1) for row in logits.split(256)]).cpu()
        self.logits = logits[:, columns].double().cpu()

    def logprob(self, prev: int, nxt: int) -> float:
        i = self.index[prev]
        return float(self.logits[i, self.index[nxt]] - self.lse[i])

    def sample(self, prev: int, gen) -> int:
        import torch

        probs = (self.logits[self.index[prev]] - self.lse[self.index[prev]]).exp()
        return self.active[int(torch.multinomial(probs, 1, generator=gen))]

    def closed_form(self, walk: list[int]) -> list[float]:
        """The designed log-probability of each token of the walk after the first."""
        return [self.logprob(prev, nxt) for prev, nxt in zip(walk, walk[1:], strict=False)]

    def argmax(self, token: int) -> int:
        return self.active[int(self.logits[self.index[token]].argmax())]


FORWARD_ROWS = 256  # positions per lm_head product: [256, 248,320] float32 is 254 MB at full size


def forward_logprobs(ref, walks: list[list[int]]) -> tuple[list[list[float]], list[list[int]]]:
    """The float32 reference forward (Reference.hidden_batch, then its lm_head) of each walk: the exact
    log-probability of every token after its prefix (log-softmax in float64), and the forward's top token at each
    scored position. The lm_head (dequantized once, after the body) and the log-softmax go FORWARD_ROWS positions
    at a time."""
    import torch

    longest = max(len(w) for w in walks)
    # the forward is causal throughout (attention mask, conv, recurrence): a position reads only its prefix, so a
    # shorter walk padded at its end runs in the same batch, and each layer's matrices are dequantized once
    padded = [w + [w[-1]] * (longest - len(w)) for w in walks]
    logprobs, tops = [], []
    with torch.no_grad():
        hidden = ref.hidden_batch(padded)
        lm_head = ref.w.linear("lm_head")
        for walk, states in zip(walks, hidden, strict=True):
            scored = torch.tensor(walk[1:], device=states.device)
            walk_lp, walk_top = [], []
            for rows, ids in zip(states[: len(walk) - 1].split(FORWARD_ROWS), scored.split(FORWARD_ROWS), strict=True):
                logits = (rows @ lm_head.T).double()
                walk_lp.append(logits.gather(-1, ids[:, None])[:, 0] - logits.logsumexp(-1))
                walk_top.append(logits.argmax(-1))
            logprobs.append(torch.cat(walk_lp).tolist())
            tops.append(torch.cat(walk_top).tolist())
    return logprobs, tops


def forward_peak_gib(device: str) -> float | None:
    """The GPU memory peak of this process so far (torch.cuda.max_memory_allocated), GiB; None off CUDA. Beside a
    server on one GPU, what the check adds to the card's use."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def compare(measured: list[float], expected: list[float], engine_top: list[int], expected_top: list[int]) -> dict:
    """Battery perplexity against a closed form over the same tokens, and how the per-token values differ."""
    if len(measured) != len(expected) or len(engine_top) != len(expected_top) or len(measured) != len(engine_top):
        raise ValueError("measured and closed-form token lists differ in length")
    battery, closed = perplexity(measured), perplexity(expected)
    diffs = [m - e for m, e in zip(measured, expected, strict=True)]
    return {"battery_ppl": battery["ppl"], "closed_form_ppl": closed["ppl"], "tokens": battery["tokens"],
            "relative_difference": battery["ppl"] / closed["ppl"] - 1,
            "logprob_diff_rms": math.sqrt(sum(d * d for d in diffs) / len(diffs)),
            "logprob_diff_max": max(abs(d) for d in diffs),
            "top1_agreement": sum(a == b for a, b in zip(engine_top, expected_top, strict=True)) / len(engine_top)}


def scripted_check(measured: list[float], expected: list[float], engine_top: list[int], expected_top: list[int],
                   tolerance: float = SCRIPTED_TOLERANCE) -> dict:
    """The judged comparison: `compare` within `tolerance` of relative perplexity."""
    out = compare(measured, expected, engine_top, expected_top)
    return {**out, "tolerance": tolerance, "within_tolerance": abs(out["relative_difference"]) <= tolerance}


# ---------------------------------------------------------------------------------------------
# Results


class Results:
    """The results file: loaded when it exists (a resumed run), rewritten atomically after every item."""

    def __init__(self, path: Path, identity: dict):
        self.path = path
        identity = json.loads(json.dumps(identity))  # as a resumed file holds it (tuples are lists there)
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except ValueError:
                raise BatteryError(f"{path} is not JSON: move it away to start again") from None
            if data.get("schema") != SCHEMA or data.get("identity") != identity:
                raise BatteryError(f"{path} holds another run (server model, texts, GSM8K source or settings differ):"
                                   " pick another tag, or --force to start again")
            self.data = data
            self.resumed = True
        else:
            started = _now()
            self.data = {"schema": SCHEMA, "identity": identity, "date": started[:10], "started": started}
            self.resumed = False

    def section(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def save(self) -> None:
        self.data["updated"] = _now()
        serving.write_json_atomic(self.path, self.data)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------
# The parts


def run_perplexity(client: serving.Client, model: str, results: Results, texts_dir: Path) -> None:
    section = results.section("perplexity")
    texts = section.setdefault("texts", {})
    todo = [name for name in TEXT_FILES if name not in texts]
    bar = serving.Progress("perplexity", len(TEXT_FILES), len(TEXT_FILES) - len(todo))
    for name in todo:
        scored = prompt_token_logprobs(client, model, (texts_dir / TEXT_FILES[name]).read_text())
        texts[name] = {"file": TEXT_FILES[name], **perplexity(s["logprob"] for s in scored)}
        section["pooled"] = pooled(texts.values())
        results.save()
        bar.step(f"{name}: {texts[name]['ppl']:.3f}")
    section["pooled"] = pooled(texts.values())
    results.save()


def run_gsm8k(client: serving.Client, model: str, results: Results, items: list[dict], max_tokens: int,
              concurrency: int) -> None:
    section = results.section("gsm8k")
    answers = section.setdefault("items", {})
    todo = [i for i in range(len(items)) if str(i) not in answers]
    bar = serving.Progress("gsm8k", len(items), len(items) - len(todo))

    def ask(i: int) -> tuple[int, dict]:
        out = client.post_json("/v1/chat/completions", gsm8k_request(model, items[i]["question"], max_tokens))
        choice = out["choices"][0]
        scored = score_gsm8k(items[i], choice["message"].get("content") or "")
        scored["finish_reason"] = choice.get("finish_reason")
        return i, scored

    def summarize() -> None:
        correct = sum(a["correct"] for a in answers.values())
        section.update(answered=len(answers), correct=correct, accuracy=correct / len(answers) if answers else None)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for i, scored in pool.map(ask, todo):  # in order, so an interrupted run leaves a prefix done
            answers[str(i)] = scored
            summarize()
            results.save()
            bar.step(f"{section['accuracy']:.1%}")
    summarize()
    results.save()


def run_scripted(client: serving.Client, model: str, results: Results, model_dir: Path, tokens: int,
                 walk_len: int, device: str) -> None:
    from qwen_serving.checkpoint.scripted import Design
    from qwen_serving.checkpoint.scripted_reference import Reference

    ref = Reference(model_dir, device)
    table = ContextFreeTable(ref, Design.read(model_dir).active)
    walks = scripted_walks(table, tokens, walk_len)
    section = results.section("scripted")
    done = section.setdefault("walks", [])
    bar = serving.Progress("scripted", len(walks), len(done))
    for walk in walks[len(done):]:
        scored = prompt_token_logprobs(client, model, walk)
        if [s["token"] for s in scored] != walk[1:]:
            raise BatteryError("the server's prompt tokens are not the ids sent (a tokenizer re-encoded them?)")
        done.append({"ids": walk, "logprobs": [s["logprob"] for s in scored], "engine_top": [s["top"] for s in scored]})
        results.save()
        bar.step()
    started = time.monotonic()
    forward, forward_top = forward_logprobs(ref, [w["ids"] for w in done])
    section["forward_s"] = round(time.monotonic() - started, 2)
    section["forward_peak_gib"] = forward_peak_gib(device)
    for walk, lp in zip(done, forward, strict=True):
        walk["forward"] = lp  # per token, so a failure can be traced to the walk and position that carry it
    measured = [lp for w in done for lp in w["logprobs"]]
    engine_top = [t for w in done for t in w["engine_top"]]
    section["check"] = {**scripted_check(measured, [lp for w in forward for lp in w],
                                         engine_top, [t for w in forward_top for t in w]),
                        "per_walk": [perplexity(w["logprobs"])["ppl"] / perplexity(w["forward"])["ppl"] - 1
                                     for w in done],
                        "closed_form": "reference forward: Reference.hidden_batch of the checkpoint's tensors in "
                                       "float32, its lm_head, log-softmax in float64; judged"}
    section["design_check"] = {**compare(measured, [lp for w in done for lp in table.closed_form(w["ids"])],
                                         engine_top, [table.argmax(t) for w in done for t in w["ids"][:-1]]),
                               "closed_form": "context-free table lm_head(norm(embed(t))) of the checkpoint's "
                                              "tensors, float64, the walks' sampling distribution (temperature 1); "
                                              "recorded, not judged"}
    results.save()


# ---------------------------------------------------------------------------------------------
# Table and CLI


def table(data: dict) -> str:
    lines = [f"### quality battery: {data['identity']['tag']} ({data['identity']['model']})", ""]
    ppl = data.get("perplexity", {})
    if ppl.get("texts"):
        lines += ["| text | tokens | perplexity |", "|---|---|---|"]
        lines += [f"| {name} | {t['tokens']} | {t['ppl']:.3f} |" for name, t in ppl["texts"].items()]
        lines.append(f"| **pooled** | {ppl['pooled']['tokens']} | **{ppl['pooled']['ppl']:.3f}** |")
        lines.append("")
    gsm = data.get("gsm8k", {})
    if gsm.get("answered"):
        lines.append(f"GSM8K exact match: {gsm['correct']}/{gsm['answered']} = {gsm['accuracy']:.1%} "
                     "(greedy, thinking off)")
        lines.append("")
    scripted = data.get("scripted", {})
    check, design = scripted.get("check"), scripted.get("design_check")
    if check:
        verdict = "within" if check["within_tolerance"] else "OUTSIDE"
        lines.append(f"scripted: battery perplexity {check['battery_ppl']:.5f}, reference forward (judged) "
                     f"{check['closed_form_ppl']:.5f} over {check['tokens']} tokens: {check['relative_difference']:+.3%}"
                     f" ({verdict} {check['tolerance']:.1%}); logprob difference rms {check['logprob_diff_rms']:.4f}, "
                     f"top-1 agreement with the forward {check['top1_agreement']:.1%}")
    if design:
        lines.append(f"scripted, not judged: context-free table {design['closed_form_ppl']:.5f}: "
                     f"{design['relative_difference']:+.3%}; logprob difference rms {design['logprob_diff_rms']:.4f}, "
                     f"top-1 agreement with the design {design['top1_agreement']:.1%}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.quality_battery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tag", help="results name: OUT/TAG-quality.json")
    p.add_argument("--url", default="http://127.0.0.1:18020")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--results-file", type=Path, help="write here instead of OUT/TAG-quality.json")
    p.add_argument("--parts", default=None,
                   help=f"comma-separated, of {', '.join(PARTS)} (default: perplexity,gsm8k; scripted alone with "
                        "--expect-scripted)")
    p.add_argument("--gsm8k-n", type=int, default=200, help="the first N test questions (default %(default)s)")
    p.add_argument("--gsm8k-file", type=Path, help="GSM8K test.jsonl on disk instead of the download")
    p.add_argument("--gsm8k-max-tokens", type=int, default=GSM8K_MAX_TOKENS)
    p.add_argument("--concurrency", type=int, default=8, help="GSM8K requests in flight (default %(default)s)")
    p.add_argument("--texts", type=Path, default=TEXTS, help=argparse.SUPPRESS)
    p.add_argument("--expect-scripted", type=Path, metavar="MODEL_DIR",
                   help="the served scripted checkpoint: score walks of its distribution against its reference forward")
    p.add_argument("--scripted-tokens", type=int, default=4096, help="tokens scored (default %(default)s)")
    p.add_argument("--scripted-walk", type=int, default=1024, help="ids per request (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device for the reference forward (default %(default)s)")
    p.add_argument("--force", action="store_true", help="start again over an existing results file of this tag")
    args = p.parse_args(argv)
    if args.parts is None:
        args.parts = "scripted" if args.expect_scripted else "perplexity,gsm8k"
    args.parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown or not args.parts:
        p.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    if "scripted" in args.parts and not args.expect_scripted:
        p.error("--parts scripted needs --expect-scripted MODEL_DIR")
    if args.expect_scripted and not (args.expect_scripted / "scripted.json").is_file():
        p.error(f"--expect-scripted {args.expect_scripted}: no scripted.json (not a scripted checkpoint)")
    if args.gsm8k_n < 1 or args.concurrency < 1 or args.scripted_tokens < 1 or args.scripted_walk < 2:
        p.error("--gsm8k-n, --concurrency and --scripted-tokens must be >= 1, --scripted-walk >= 2")
    if "/" in args.tag or args.tag.startswith("."):
        p.error(f"tag {args.tag!r}: a plain file name please")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    client = serving.Client(args.url, serving.api_key(args.api_key))
    try:
        server = harness.server_facts(client.base, client.key)
    except (OSError, ValueError, KeyError, IndexError) as err:
        print(f"quality_battery: no usable vLLM server at {args.url}: {err}", file=sys.stderr)
        return 3
    model = server["model"]["id"]
    try:
        items, gsm_source = (gsm8k_questions(args.gsm8k_file, args.gsm8k_n) if "gsm8k" in args.parts else ([], None))
        identity = {"tag": args.tag, "model": model, "model_root": server["model"].get("root"), "parts": args.parts,
                    "texts": text_sources(args.texts) if "perplexity" in args.parts else None,
                    "gsm8k": {"n": args.gsm8k_n, "max_tokens": args.gsm8k_max_tokens, "source_sha256":
                              gsm_source["sha256"], "instruction": GSM8K_INSTRUCTION} if gsm_source else None,
                    "scripted": {"model_dir": str(args.expect_scripted), "tokens": args.scripted_tokens,
                                 "walk": args.scripted_walk, "seed": SCRIPTED_WALK_SEED}
                    if "scripted" in args.parts else None}
        path = args.results_file or args.out / f"{args.tag}-quality.json"
        if args.force:
            path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        results = Results(path, identity)
        results.data.update(server={k: server.get(k) for k in ("url", "vllm_version", "model")},
                            machine=harness.machine_facts(), gsm8k_source=gsm_source)
        if results.resumed:
            print(f"quality_battery: continuing {path}", file=sys.stderr)
        runs: dict[str, Callable[[], None]] = {
            "perplexity": lambda: run_perplexity(client, model, results, args.texts),
            "gsm8k": lambda: run_gsm8k(client, model, results, items, args.gsm8k_max_tokens, args.concurrency),
            "scripted": lambda: run_scripted(client, model, results, args.expect_scripted, args.scripted_tokens,
                                             args.scripted_walk, args.device),
        }
        for part in args.parts:
            runs[part]()
    except BatteryError as err:
        print(f"quality_battery: {err}", file=sys.stderr)
        return 2
    except serving.HttpError as err:
        print(f"quality_battery: the server refused a request: {err}", file=sys.stderr)
        return 3
    results.data["finished"] = _now()
    results.save()
    print(table(results.data))
    print(f"wrote {path}")
    check = results.data.get("scripted", {}).get("check")
    return 1 if check and not check["within_tolerance"] else 0


if __name__ == "__main__":
    sys.exit(main())
