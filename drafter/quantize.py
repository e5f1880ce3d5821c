"""GPTQ a drafter's captured linears to W4A16 g128: the fast variant, or (--dflash2) the DFlash2 drafter.

    drafter/.venv-quant/bin/python drafter/quantize.py MODEL_DIR [--capture MODEL_DIR.drafter-capture.safetensors]
        [--out MODEL_DIR-fast] [--method gptq|rtn] [--table FILE.md]
    drafter/.venv-quant/bin/python drafter/quantize.py DRAFTER_DIR --dflash2 [--bf16-qkv]
        [--capture DRAFTER_DIR.drafter-capture.safetensors] [--out DRAFTER_DIR-W4A16] ...

--dflash2: DRAFTER_DIR is the bf16 DFlash2 drafter (captured by `drafter/capture.py MODEL_DIR --dflash2
DRAFTER_DIR`); the new drafter directory holds all 36 matrices as int4: fc and every layer's q/k/v, o_proj,
gate/up and down_proj (int4 q/k/v load in this repo's patched vLLM, patches/dflash2-quantized-kv.patch; stock
vLLM 0.28.0 cannot load them: upstream vllm#51581). --bf16-qkv keeps q/k/v bf16 (21 int4 matrices), the
layout stock vLLM 0.28.0 loads. prepared.json records dflash2_w4a16.

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
    parser.add_argument("--dflash2", action="store_true", help="MODEL_DIR is a bf16 DFlash2 drafter")
    parser.add_argument("--bf16-qkv", action="store_true",
                        help="--dflash2: keep q/k/v bf16 (21 of 36 int4; for a vLLM without "
                             "patches/dflash2-quantized-kv.patch, vllm#51581)")
    args = parser.parse_args(argv)
    base = args.model_dir.rstrip("/")
    if args.bf16_qkv and not args.dflash2:
        parser.error("--bf16-qkv is for --dflash2")
    if args.dflash2:
        return drafter_quantize.build_dflash2(base, args.capture or base + ".drafter-capture.safetensors",
                                              args.out or base + "-W4A16", args.method, args.table, args.bf16_qkv)
    return drafter_quantize.build_variant(base, args.capture or base + ".drafter-capture.safetensors",
                                          args.out or base + "-fast", args.method, args.table)


if __name__ == "__main__":
    sys.exit(main())
