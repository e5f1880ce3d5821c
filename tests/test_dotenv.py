""".env: qwen_serving/dotenv.py against the real Docker Compose binary, its refusals, and the launchers reading it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from qwen_serving import dotenv
from tests.helpers.compose_bin import compose_binary

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "compose-syntax.env"
LOOKUP = {"INHERITED": "from-env", "EMPTY": "", "WINS": "from-env"}


def compose_environment(tmp_path: Path, env_file: Path) -> subprocess.CompletedProcess:
    """`docker compose config` of a one-service project that reads env_file, with only LOOKUP in the environment."""
    (tmp_path / "compose.yml").write_text(f"services:\n  s:\n    image: x\n    env_file: {env_file}\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **LOOKUP}
    return subprocess.run([str(compose_binary()), "-f", str(tmp_path / "compose.yml"), "config", "--format", "json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_fixture_reads_as_compose_reads_it(tmp_path):
    result = compose_environment(tmp_path, FIXTURE)
    assert result.returncode == 0, result.stderr
    # `config` prints a literal $ as $$, so that its output is itself a valid Compose file
    theirs = {k: v.replace("$$", "$") for k, v in json.loads(result.stdout)["services"]["s"]["environment"].items()}
    ours = dotenv.parse(FIXTURE.read_text(), LOOKUP)
    assert ours == theirs
    # and the values are what the rules say, not merely what both happen to agree on
    assert ours["INDENTED"] == "spaced value" and ours["HASH"] == "val#not-a-comment"
    assert ours["SINGLE"] == "literal $EXPORTED ${EXPORTED} \\n it's"
    assert ours["DOUBLE"] == 'tab\tnewline\nslash\\ quote" octalA dollar$EXPORTED 1'
    assert ours["DOUBLE_HASH"] == "value # not a comment" and ours["MULTI"] == "first\nsecond"
    assert ours["OPS"] == "1||d1|d2||alt|set|" and ours["NESTED"] == "1-deep"
    assert ours["INHERITED"] == "from-env" and "INHERITED_UNSET" not in ours
    assert ours["ENV_WINS"] == "from-env" and ours["CRLF"] == "value-with-cr"
    assert ours["DOLLARS"] == "$literal $ and $1"


BAD_LINES = [
    ("A=1\n\nthis is garbage\n", 3, "cannot contain a space"),
    ("A=1\n!!!=1\n", 2, "unexpected character '!'"),
    ("A=1\nB=\"open\nC=2\n", 2, "unterminated"),
    ("A=1\nB=${C\n", 2, "unterminated ${"),
    ("A=${1}\n", 1, "invalid interpolation"),
    ("A=1\nB=${NOPE:?set NOPE in .env}\n", 2, "required variable NOPE is missing a value: set NOPE in .env"),
]


@pytest.mark.parametrize(("text", "line", "message"), BAD_LINES)
def test_a_line_compose_refuses_is_refused_with_its_number(tmp_path, text, line, message):
    path = tmp_path / "bad.env"
    path.write_text(text)
    with pytest.raises(dotenv.DotenvError) as err:
        dotenv.read(path, {})
    assert str(err.value).startswith(f"{path}:{line}: ") and message in str(err.value)
    assert compose_environment(tmp_path, path).returncode != 0  # Compose refuses the same file


@pytest.mark.parametrize("text", ['A="x" B=1\n', "A='x' junk\n", "=1\n"])
def test_what_compose_reads_oddly_is_refused(text):
    """Compose sets B from `A="x" B=1` and a variable named '' from `=1`; neither is what a user meant."""
    with pytest.raises(dotenv.DotenvError, match=r"^\.env:1: "):
        dotenv.parse(text, {})


def test_environment_wins_and_a_missing_file_is_empty(tmp_path):
    path = tmp_path / ".env"
    assert dotenv.merged(path, {"A": "env"}) == {"A": "env"}
    path.write_text("A=file\nB=file\n")
    assert dotenv.merged(path, {"A": "env"}) == {"A": "env", "B": "file"}


def run_module(tmp_path: Path, text: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / ".env").write_text(text)
    full = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), **env}
    return subprocess.run(["python3", "-m", "qwen_serving.dotenv", str(tmp_path / ".env")], env=full,
                          capture_output=True, text=True, timeout=60)


def test_exports_are_shell_safe_and_skip_what_is_set(tmp_path):
    r = run_module(tmp_path, "A='it\\'s $(touch pwned)'\nB=\"two\nlines\"\nSET=file\nODD.NAME=1\n", SET="env")
    assert r.returncode == 0, r.stderr
    shell = subprocess.run(["bash", "-c", r.stdout + '\nprintf "%s|%s|%s" "$A" "$B" "${SET-unset}"'],
                           cwd=tmp_path, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert shell.stdout == "it's $(touch pwned)|two\nlines|unset" and not (tmp_path / "pwned").exists()
    assert "SET" not in r.stdout and "ODD.NAME" not in r.stdout  # set already; not a shell name


def test_module_refuses_a_bad_file_in_one_line(tmp_path):
    r = run_module(tmp_path, "PORT=1\nnot a line\n")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"qwen-serving: {tmp_path / '.env'}:2: a variable name cannot contain a space: 'not a line' "
        "(Compose's env-file syntax: NAME=value)"]


def launcher_copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for part in ("qwen_serving", "batch", "single-user"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("folder", ["batch", "single-user"])
def test_both_launchers_read_dotenv_and_the_environment_wins(tmp_path, folder):
    root = launcher_copy(tmp_path)
    (root / ".env").write_text("export PORT=18555  # from .env\nMAX_SEQS='3'\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    r = subprocess.run(["bash", f"{folder}/start_qwen.sh", "--dry-run"], cwd=root, env={**env, "MAX_SEQS": "5"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--port 18555" in r.stdout and "--max-num-seqs 5" in r.stdout
    (root / ".env").write_text("PORT=18555\nPORT 18556\n")
    r = subprocess.run(["bash", f"{folder}/start_qwen.sh", "--dry-run"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and ".env:2: a variable name cannot contain a space" in r.stderr
    assert "vllm serve" not in r.stdout


def test_plan_reads_dotenv_when_run_directly(tmp_path):
    root = launcher_copy(tmp_path)
    (root / ".env").write_text("PORT=18557\n")
    r = subprocess.run(["python3", "-m", "qwen_serving.plan", "batch", "--dry-run"], cwd=root, capture_output=True,
                       text=True, timeout=120, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert r.returncode == 0 and "--port 18557" in r.stdout, r.stderr
