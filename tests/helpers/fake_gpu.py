"""Stand-ins for `nvidia-smi` and `df` in tests of the launchers, so qwen_serving/preflight.py sees a 3090 with room
for the download whatever machine the tests run on."""

from __future__ import annotations

from pathlib import Path

RTX_3090 = "NVIDIA GeForce RTX 3090, 24576, 580.95.05"  # name, MiB, driver: what preflight's query prints
ROOMY_DISK = 500 * 10**9


def _script(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(f"#!/usr/bin/env bash\n{body}\n")
    script.chmod(0o755)
    return folder


def fake_nvidia_smi(folder: Path, answer: str = RTX_3090, free_disk: int = ROOMY_DISK) -> Path:
    """folder/nvidia-smi answering `answer`, and folder/df answering `free_disk` free bytes; put folder first on PATH."""
    _script(folder, "df", f'echo Avail; echo {free_disk}')
    return _script(folder, "nvidia-smi", f'echo "{answer}"')
