"""Build the MTP draft head: the lm_head rows of the K most frequent output tokens, in place.

    # from an id list you have (the first start does this with prepare/draft_vocab_ids.json or DRAFT_IDS)
    python prepare/build_draft_vocab.py models/Qwen3.8-27B-W4A16-AutoRound --ids prepare/draft_vocab_ids.json
    # from counts of the model's own outputs (prepare/count_outputs.py), reporting held-out coverage
    # (bash single-user/calibrate.sh does both)
    python prepare/build_draft_vocab.py MODEL --counts counts.json --holdout counts.json \
        --k 40000 --write-ids prepare/draft_vocab_ids.json

Writes mtp.draft_lm_head.* (same format as the lm_head at that moment: run quant_lm_head.py first
for an int8 head), draft_vocab_ids.json in the model directory and a "draft_vocab" entry in
config.json. The end-of-turn ids are always included. Safe to interrupt and re-run.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import draft_vocab, step_names, steps  # noqa: E402
from qwen_serving.checkpoint.console import say  # noqa: E402
from qwen_serving.checkpoint.rewrite import run_step  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ids", help="JSON id list to use as is")
    source.add_argument("--counts", nargs="+", help="token-count files from prepare/count_outputs.py")
    parser.add_argument("--k", type=int, default=draft_vocab.DEFAULT_K, help="draft vocabulary size (with --counts)")
    parser.add_argument("--holdout", nargs="+",
                        help="count files of outputs not used to choose the list (their held-out part, if they have one)")
    parser.add_argument("--write-ids", help="also write the chosen list here (e.g. prepare/draft_vocab_ids.json)")
    args = parser.parse_args()

    model = Path(args.model_dir)
    try:
        config = json.loads((model / "config.json").read_text())
        gen_path = model / "generation_config.json"
        always = draft_vocab.stop_ids(config, json.loads(gen_path.read_text()) if gen_path.exists() else None)
        if args.ids:
            ids = sorted(set(draft_vocab.read_id_list(args.ids)) | set(always))
            note = f"id list {Path(args.ids).name}"
        else:
            if args.k <= 0:
                raise ValueError("--k must be positive")
            counted = draft_vocab.read_counts(args.counts)
            ids = draft_vocab.top_k_ids(counted, args.k, always)
            note = f"top {args.k} of {sum(counted.values())} counted tokens"
            say(f"draft_vocab: {len(ids)} ids cover {100 * draft_vocab.coverage(ids, counted):.2f}% of the counted outputs")
        report = {}
        if args.holdout:
            held = draft_vocab.read_counts(args.holdout, "holdout")
            report = {"holdout_tokens": sum(held.values()), "holdout": round(draft_vocab.coverage(ids, held), 6)}
            say(f"draft_vocab: held-out coverage {100 * report['holdout']:.2f}% of {report['holdout_tokens']} tokens")
        if args.write_ids:
            draft_vocab.write_json_atomic(Path(args.write_ids), {"ids": ids, "source": note, **report})
    except (OSError, ValueError) as e:
        print(f"draft_vocab: error: {e}", file=sys.stderr)
        return 2
    return run_step(model, step_names.DRAFT_VOCAB, lambda m: steps.build_draft_head(m, ids, note, report or None))


if __name__ == "__main__":
    sys.exit(main())
