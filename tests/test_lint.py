"""Every shell script in the repo is shellcheck-clean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shell_scripts() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    scripts = []
    for name in tracked:
        path = REPO / name
        if not path.is_file():
            continue
        if path.suffix == ".sh" or path.read_bytes()[:64].startswith((b"#!/usr/bin/env bash", b"#!/bin/bash", b"#!/bin/sh")):
            scripts.append(path)
    return scripts


def test_repo_has_shell_scripts():
    names = {p.relative_to(REPO).as_posix() for p in shell_scripts()}
    assert {"tests/run.sh", ".ci/run", "install.sh", "verify.sh"} <= names


def test_shellcheck_clean():
    # never a silent skip: tests/run.sh installs it where it can (apt-get as root); elsewhere this says how
    assert shutil.which("shellcheck"), "shellcheck is not installed: apt-get install shellcheck (or brew install shellcheck)"
    result = subprocess.run(["shellcheck", "-x", *map(str, shell_scripts())], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
