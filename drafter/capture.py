"""Capture the fast variant's calibration statistics: the lm_head's and the MTP linears' inputs on a prompt set.

    python drafter/capture.py MODEL_DIR [--out MODEL_DIR.drafter-capture.safetensors] [--prompts FILE]
        [--max-prompts N] [--max-tokens 256] [--held-out-every 5] [--save-every 1] [--device cpu]

Runs the checkpoint's forward (float32; qwen_serving.checkpoint.scripted_reference) over the prompts
(default: prepare/calibration_prompts.json through the checkpoint's chat template; or a JSONL of
{"messages": [...]} / {"prompt": "..."}) and keeps, per linear, sum(x^T x) and the row count; every
Nth prompt is held out as raw rows for the error table. Saved after every prompt, atomically: an
interrupted run resumes where it stopped. Next: drafter/quantize.py (drafter/README.md).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import drafter_capture  # noqa: E402
from qwen_serving.checkpoint.model_dir import CheckpointError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--out", help="statistics file (default: <model_dir>.drafter-capture.safetensors)")
    parser.add_argument("--prompts", help="prompt set: templated .json or .jsonl (default: prepare/calibration_prompts.json)")
    parser.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts (0: all)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens kept per prompt")
    parser.add_argument("--held-out-every", type=int, default=5, help="every Nth prompt is held out")
    parser.add_argument("--held-out-rows", type=int, default=2048, help="raw held-out rows kept per linear")
    parser.add_argument("--save-every", type=int, default=1, help="prompts between saves of the state")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.model_dir.rstrip("/") + ".drafter-capture.safetensors")
    try:
        drafter_capture.capture(args.model_dir, out, prompts=args.prompts, max_prompts=args.max_prompts,
                                max_tokens=args.max_tokens, held_out_every=args.held_out_every,
                                held_out_cap=args.held_out_rows, save_every=args.save_every, device=args.device)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"capture: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
