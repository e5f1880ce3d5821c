"""embed_tokens (bf16) -> int8 symmetric group-128, in place (vLLM's dequant-on-gather embedding;
needs patches/qwen3_5-embed-quant.patch in the engine).

    python prepare/quant_embed.py models/Qwen3.8-27B-W4A16-AutoRound

Safe to interrupt and re-run; a finished step re-run prints one line. See prepare/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import steps  # noqa: E402

if __name__ == "__main__":
    sys.exit(steps.main("quant_embed", __doc__))
