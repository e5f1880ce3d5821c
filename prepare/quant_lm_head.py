"""lm_head (bf16) -> int8 symmetric group-128, in place (compressed-tensors pack-quantized; vLLM's int8 Marlin lm_head).

    python prepare/quant_lm_head.py models/Qwen3.8-27B-W4A16-AutoRound

Safe to interrupt and re-run; a finished step re-run prints one line. See prepare/README.md.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.quant import steps  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="checkpoint directory (changed in place, atomically)")
    args = parser.parse_args()
    return steps.run(args.model_dir, "quant_lm_head")


if __name__ == "__main__":
    sys.exit(main())
