"""Download the W4A16 DFlash2 block drafter (1.19 GB) for SPEC=dflash2 and verify it.

    python prepare/fetch_dflash2.py [--repo syvai/Qwen3.8-27B-DFlash2-W4A16] [--dir models/...]

Resumable; an existing complete copy is verified and not fetched again.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import hub  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    # a drafter, not a qwen3_5 model: config + complete safetensors shards is what is checked
    return hub.download_main("fetch_dflash2", __doc__, hub.DFLASH2_REPO, argv=argv,
                             require_qwen35=False)


if __name__ == "__main__":
    sys.exit(main())
