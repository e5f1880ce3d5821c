"""Capture a drafter's calibration statistics: the inputs of its own linears on a prompt set.

    python drafter/capture.py MODEL_DIR [--out MODEL_DIR.drafter-capture.safetensors] [--prompts FILE]
        [--max-prompts N] [--max-tokens 256] [--held-out-every 5] [--save-every 1] [--device cpu]
    python drafter/capture.py MODEL_DIR --dflash2 DRAFTER_DIR [--anchor-every 4] [--out DRAFTER_DIR.drafter-capture.safetensors] ...

Without --dflash2: the fast variant's matrices (the lm_head and the MTP module's linears). With it:
the bf16 DFlash2 drafter's 36 matrices (fc and each layer's q/k/v/o, gate/up/down, the k/v rows of its
context-KV precompute included), run over MODEL_DIR's (the target's) hidden states.

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
    parser.add_argument("--dflash2", metavar="DRAFTER_DIR", help="capture this bf16 DFlash2 drafter over MODEL_DIR")
    parser.add_argument("--anchor-every", type=int, default=4,
                        help="--dflash2: one query block per this many prompt tokens")
    args = parser.parse_args(argv)
    owner = args.dflash2 or args.model_dir
    out = Path(args.out) if args.out else Path(owner.rstrip("/") + ".drafter-capture.safetensors")
    common = dict(prompts=args.prompts, max_prompts=args.max_prompts, max_tokens=args.max_tokens,
                  held_out_every=args.held_out_every, held_out_cap=args.held_out_rows, save_every=args.save_every,
                  device=args.device)
    try:
        if args.dflash2:
            drafter_capture.capture_dflash2(args.model_dir, args.dflash2, out, anchor_every=args.anchor_every, **common)
        else:
            drafter_capture.capture(args.model_dir, out, **common)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"capture: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
