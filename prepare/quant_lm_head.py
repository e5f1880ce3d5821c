"""lm_head (bf16) -> int8 symmetric group-128, in place (compressed-tensors pack-quantized; vLLM's int8 Marlin lm_head).

    python prepare/quant_lm_head.py models/Qwen3.8-27B-W4A16-AutoRound

Safe to interrupt and re-run; a finished step re-run prints one line. See prepare/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import steps  # noqa: E402

if __name__ == "__main__":
    sys.exit(steps.main("quant_lm_head", __doc__))
