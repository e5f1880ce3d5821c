"""GPTQ the captured lm_head and MTP linears to W4A16 g128 and write the fast variant beside the base.

    drafter/.venv-quant/bin/python drafter/quantize.py MODEL_DIR [--capture MODEL_DIR.drafter-capture.safetensors]
        [--out MODEL_DIR-fast] [--method gptq|rtn] [--table FILE.md]

gptq (default) is llmcompressor's GPTQ (the quant venv, drafter/install.sh); rtn is round-to-nearest on
the same grid and runs in any venv with torch (a baseline, not the recipe). The new directory hard-links
the base's unchanged shards, records the step as prepared.json's fast_variant (with the held-out error
table), and is what single-user/start_qwen.sh picks up when it is models/<base>-fast. Prints the error
table (markdown; --table also writes it).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import drafter_quantize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="the base checkpoint (left unchanged)")
    parser.add_argument("--capture", help="drafter/capture.py's file (default: <model_dir>.drafter-capture.safetensors)")
    parser.add_argument("--out", help="the variant directory (default: <model_dir>-fast)")
    parser.add_argument("--method", choices=drafter_quantize.METHODS, default="gptq")
    parser.add_argument("--table", help="also write the held-out error table (markdown) here")
    args = parser.parse_args(argv)
    base = args.model_dir.rstrip("/")
    return drafter_quantize.build_variant(base, args.capture or base + ".drafter-capture.safetensors",
                                          args.out or base + "-fast", args.method, args.table)


if __name__ == "__main__":
    sys.exit(main())
