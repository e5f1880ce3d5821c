"""Download the W4A16 DFlash2 block drafter (1.19 GB) for SPEC=dflash2 and verify it.

    python prepare/fetch_dflash2.py [--repo syvai/Qwen3.8-27B-DFlash2-W4A16] [--dir models/...]

Resumable; an existing complete copy is verified and not fetched again.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.quant import hub  # noqa: E402
from qwen_serving.quant.checkpoint import CheckpointError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=hub.DFLASH2_REPO)
    parser.add_argument("--dir", help="target directory (default: models/<repo name>)")
    parser.add_argument("--revision")
    parser.add_argument("--token", help="Hugging Face token (default: HF_TOKEN)")
    args = parser.parse_args(argv)
    target = Path(args.dir) if args.dir else hub.default_dir(args.repo)
    try:
        # a drafter, not a qwen3_5 model: config + complete safetensors shards is what is checked
        hub.download(args.repo, target, revision=args.revision, token=args.token, require_qwen35=False)
    except (CheckpointError, OSError) as e:
        print(f"fetch_dflash2: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
