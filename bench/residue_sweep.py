"""The prompt-length residue sweep: one copy request at every prompt length L = base + r, r = 0..127, each sent
twice (cold, then again so that it hits the prefix cache), every answer judged by bench/verbatim.py.

    python bench/residue_sweep.py TAG --url URL [--scripted MODEL_DIR | --document FILE] [--base N]
        [--residues 0-127] [--doc-tokens 256] [--doc-chars 1200] [--drafts K] [--out DIR] [--force]

Why: the spec saw prefix caching with FULL CUDA graphs corrupt one prompt length in every 128, only for a request
that hits the cache, at residue R = 117 + k for k drafts (SPEC=mtp CTX=huge at residue 4), and saw the damage
take different shapes on the same residue (empty, one character, fluent text of its own). So every length is
tried, and judged on how much of the document came back, never on one symptom.

The prompt (the spec gives no exact construction; this one puts the whole length in one filler run):
- scripted (`--scripted`): a chain segment of --doc-tokens ids, a run of one filler token, then the segment's
  first 8 tokens as a cue; the greedy answer is the rest of the segment (known from the design), judged as ids;
- text (default): the server's chat template around "reproduce the document between the markers", a filler line
  and the first --doc-chars characters (cut at a word boundary) of --document or bench/texts/en.txt, sent as the ids the
  server's /tokenize gives, so L is exact; judged as text.
base is a multiple of 128 (default: the smallest that fits the prompt and is longer than one KV cache block of the
server, vllm:cache_config_info's block_size: a prompt hits the prefix cache in whole blocks, never its last token,
so a shorter one could not; two blocks under mamba cache mode `align` with an MTP or DFlash2 drafter, which back the
last position whose recurrent state is kept off one block: visit 14's DFlash2 twins of 512-639 tokens, 448-token
blocks, hit nothing), so r = L mod 128. Each length's pair has its own cache_salt, new for every run: the
cold request hits nothing an earlier request left, and its twin hits what the cold one left (the report counts the
hit tokens of each from /metrics). A sweep whose twins did not all hit the cache fails: it has not tried the path
the spec saw corrupted.

Report: OUT/TAG-residue.json (rewritten every 8 residues and at the end): per residue both judgements, hit tokens, tokens
per step; `summary.passed` of 128 (both requests verbatim), the failed residues with their shapes, the suspect
residue (117 + k, k from --drafts or the server's speculative config) and how many cached twins hit the cache.
Exit 0 when every residue passed and every twin hit the cache, 1 otherwise, 2 on bad input, 3 when the server cannot
be used.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # also run as a file: python bench/residue_sweep.py
    sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402
from bench import verbatim as vb  # noqa: E402

SCHEMA = "qwen-serving residue-sweep/1"
MODULUS = 128
SUSPECT_BASE = 117  # the spec's broken residue is 117 + k for k drafts (mod 128)
CUE_TOKENS = 8
COPY_INSTRUCTION = ("Reproduce the document between the markers exactly as it is written, character for character. "
                    "Write nothing before or after it.")
SAVE_EVERY = 8  # residues between report rewrites
TEXT_MARGIN_TOKENS = 64  # answer budget beyond the document's own tokens (a closing newline, a fence)


def copy_layout(args: argparse.Namespace, client: serving.Client, model: str) -> tuple[vb.Layout, list[int] | str,
                                                                                         int]:
    """(layout, the answer it must give, max_tokens) for the copy request of this sweep."""
    if args.scripted:
        chain = vb.ScriptedChain(args.scripted, args.seed)
        doc = chain.segment(chain.rng.randrange(len(chain.cycle)), args.doc_tokens)
        filler = next(t for t in chain.filler(len(chain.cycle)) if t not in doc)
        expected = chain.answer(doc[CUE_TOKENS - 1], args.doc_tokens - CUE_TOKENS)
        return vb.Layout(doc, filler, doc[:CUE_TOKENS]), expected, len(expected)
    text = args.document.read_text() if args.document else vb.TEXTS.joinpath("en.txt").read_text()
    doc = text.strip()
    if len(doc) > args.doc_chars:  # cut at the last word boundary inside the budget
        doc = doc[:args.doc_chars + 1].rsplit(None, 1)[0] if " " in doc[:args.doc_chars] else doc[:args.doc_chars]
    tokenizer = vb.ServerTokenizer(client, model)
    layout = tokenizer.padded("", f"\n\n{COPY_INSTRUCTION}\n\n<document>\n{doc}\n</document>")
    return layout, doc, tokenizer.count(doc) + TEXT_MARGIN_TOKENS


def parse_residues(spec: str) -> list[int]:
    """"0-127", "117,121", "100-110,117" -> sorted residues."""
    out: set[int] = set()
    for part in filter(None, (x.strip() for x in spec.split(","))):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out or min(out) < 0 or max(out) >= MODULUS:
        raise ValueError(f"residues {spec!r}: 0..{MODULUS - 1} please")
    return sorted(out)


def drafts_of(server: dict) -> int | None:
    """k of the server's speculative config (recorded only when it runs with VLLM_SERVER_DEV_MODE=1)."""
    spec = ((server.get("vllm_config") or {}).get("speculative_config")) or {}
    k = spec.get("num_speculative_tokens") if isinstance(spec, dict) else None
    return int(k) if k else None


def block_size_of(server: dict) -> int | None:
    """The server's KV cache block size (vllm:cache_config_info, in the report's server facts), if it gave one."""
    size = str((server.get("cache_config") or {}).get("block_size", ""))
    return int(size) if size.isdigit() else None


# speculative methods vLLM 0.28.0's scheduler counts as drafting from the target's hidden states
# (SpeculativeConfig.use_eagle): under mamba cache mode `align` they back the last cacheable position off one block
HIDDEN_STATE_DRAFTERS = ("eagle", "eagle3", "mtp", "dflash", "dspark")


def blocks_before_a_hit(server: dict) -> int:
    """How many whole KV blocks a prompt needs before its last token for a repeat to hit the prefix cache. One, but
    two under mamba cache mode `align` with a drafter on the target's hidden states: the scheduler keeps a hybrid
    model's recurrent state only at `last_cache_position`, the prompt's last block boundary less one block for such
    a drafter (vLLM 0.28.0's Scheduler._mamba_block_aligned_split), and a hit needs that state."""
    align = str((server.get("cache_config") or {}).get("mamba_cache_mode", "")) == "align"
    spec = (server.get("vllm_config") or {}).get("speculative_config") or {}
    method = spec.get("method") if isinstance(spec, dict) else None
    return 2 if align and method in HIDDEN_STATE_DRAFTERS else 1


def default_base(minimum: int, block_size: int | None, blocks: int = 1) -> int:
    """The smallest multiple of 128 that holds the prompt and `blocks` whole blocks before the last token."""
    shortest = max(minimum, blocks * (block_size or 0) + 1)
    return -(-shortest // MODULUS) * MODULUS


def summarize(rows: list[dict], wanted: list[int], suspect: int | None) -> dict:
    failed = [{"residue": row["residue"], "length": row["length"], "pass": name, "verdict": row[name]["verdict"],
               "coverage": row[name]["coverage"], "first_divergence": row[name]["first_divergence"],
               "answer_head": row[name]["answer_head"]}
              for row in rows for name in ("cold", "cached") if not row[name]["passed"]]
    hit = sum(row["cached"]["cache_hit_tokens"] > 0 for row in rows)
    by_residue = {row["residue"]: row for row in rows}
    return {
        "residues": len(wanted), "done": len(rows),
        "passed": sum(row["cold"]["passed"] and row["cached"]["passed"] for row in rows),
        "failed_residues": sorted({f["residue"] for f in failed}), "failed": failed,
        "cached_twins_hit_cache": hit,
        "suspect_residue": suspect,
        "suspect_passed": None if suspect not in by_residue else
        by_residue[suspect]["cold"]["passed"] and by_residue[suspect]["cached"]["passed"],
    }


def failure_line(f: dict) -> str:
    where = "" if f["first_divergence"] is None else f", first divergence at {f['first_divergence']}"
    return f"r={f['residue']} (L={f['length']}) {f['pass']}: {f['verdict']} (coverage {f['coverage']:.1%}{where})"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/residue_sweep.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tag", nargs="?", help="report name: OUT/TAG-residue.json (default: residue-<date>-<time>)")
    vb.add_run_args(p)
    p.add_argument("--base", type=int, help=f"a multiple of {MODULUS}: L = base + r (default: the smallest that fits)")
    p.add_argument("--residues", default=f"0-{MODULUS - 1}", help="which r (default %(default)s)")
    p.add_argument("--doc-tokens", type=int, default=256, help="scripted document length (default %(default)s)")
    p.add_argument("--doc-chars", type=int, default=1200, help="text document length (default %(default)s)")
    p.add_argument("--drafts", type=int, help="k, to name the suspect residue 117 + k (default: the server's config)")
    args = p.parse_args(argv)
    vb.check_run_args(p, args, "residue")
    try:
        args.residues = parse_residues(args.residues)
    except ValueError as err:
        p.error(str(err))
    if args.base is not None and (args.base < 0 or args.base % MODULUS):
        p.error(f"--base {args.base}: a non-negative multiple of {MODULUS} please")
    if args.doc_tokens <= CUE_TOKENS or args.doc_chars < 1:
        p.error(f"--doc-tokens must exceed the {CUE_TOKENS}-token cue and --doc-chars be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    opened = vb.open_run(args, SCHEMA, "residue", "residue_sweep", lambda client, model: copy_layout(args, client, model))
    if isinstance(opened, int):
        return opened
    path, client, report, (layout, expected, max_tokens) = opened
    model = report["server"]["model"]["id"]
    server = report["server"]
    base = args.base if args.base is not None else default_base(layout.minimum, block_size_of(server),
                                                                blocks_before_a_hit(server))
    if base < layout.minimum:
        print(f"residue_sweep: --base {base} is shorter than the prompt's {layout.minimum} tokens", file=sys.stderr)
        return 2
    drafts = args.drafts or drafts_of(report["server"])
    suspect = None if drafts is None else (SUSPECT_BASE + drafts) % MODULUS
    run_id = secrets.token_hex(4)  # a new salt per run: nothing earlier can answer the cold requests
    report.update(settings={"source": "scripted" if args.scripted else "text", "document": str(args.document or ""),
                            "base": base, "modulus": MODULUS, "max_tokens": max_tokens, "drafts": drafts,
                            "run_id": run_id, "seed": args.seed},
                  expected_len=len(expected), rows=[])
    page = None  # the last /metrics page: one read between two requests
    for r in args.residues:
        length = base + r
        case = vb.Case(f"r{r}", layout.prompt(length), expected, max_tokens)
        salt = f"{args.tag}-{run_id}-r{r}"
        try:
            row = {"residue": r, "length": length}
            for name in ("cold", "cached"):  # the same request twice: the second hits what the first left
                _, row[name], page = vb.ask_measured(client, model, case, salt=salt, ignore_eos=bool(args.scripted),
                                                     before=page)
        except (OSError, ValueError) as err:
            page = None
            report.setdefault("errors", []).append({"residue": r, "error": str(err)})
            print(f"r={r}: FAILED to run: {err}", file=sys.stderr)
            continue
        report["rows"].append(row)
        if len(report["rows"]) % SAVE_EVERY == 0:  # a stopped sweep keeps what it measured
            report["summary"] = summarize(report["rows"], args.residues, suspect)
            serving.write_json_atomic(path, report)
        marks = ", ".join(f"{name} {row[name]['verdict']} (hit {row[name]['cache_hit_tokens']})"
                          for name in ("cold", "cached"))
        print(f"r={r:3d} L={length}: {marks}", flush=True)
    summary = report["summary"] = summarize(report["rows"], args.residues, suspect)
    serving.write_json_atomic(path, report)
    for failure in summary["failed"]:
        print("FAILED " + failure_line(failure))
    all_hit = summary["cached_twins_hit_cache"] == summary["done"]
    if not all_hit:
        print(f"FAILED: only {summary['cached_twins_hit_cache']} of {summary['done']} cached twins hit the prefix "
              "cache, so the cached path was not tried (is prefix caching on? is --base longer than a block, two "
              "with a drafter under mamba align?)")
    if suspect is not None:
        print(f"suspect residue {suspect} (117 + {drafts}): {'passed' if summary['suspect_passed'] else 'FAILED'}"
              if summary["suspect_passed"] is not None else f"suspect residue {suspect} (117 + {drafts}): not swept")
    print(f"residue sweep: {summary['passed']}/{summary['residues']} residues passed; wrote {path}")
    return 0 if summary["passed"] == summary["residues"] and all_hit and not report.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
