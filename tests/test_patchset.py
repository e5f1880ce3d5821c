"""patchset: all-or-nothing apply/revert, state detection, version pin, headers; and the real series."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_serving import VLLM_PIN, patchset

REPO = Path(__file__).resolve().parents[1]
HEADER = "Description: {d}\nWhy: because\nMeasured: a CPU test\nUpstream: not upstream\n\n"


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def make_diff(root: Path, rel: str, new: str | None, old_override: str | None = None) -> str:
    """A unified diff (a/ b/ prefixes, package-relative) turning root/rel into `new` (None = delete)."""
    work = root.parent / "diffwork"
    shutil.rmtree(work, ignore_errors=True)
    (work / "a" / rel).parent.mkdir(parents=True, exist_ok=True)
    (work / "b" / rel).parent.mkdir(parents=True, exist_ok=True)
    old = old_override if old_override is not None else ((root / rel).read_text() if (root / rel).exists() else None)
    a = work / "a" / rel if old is not None else Path("/dev/null")
    b = work / "b" / rel if new is not None else Path("/dev/null")
    if old is not None:
        a.write_text(old)
    if new is not None:
        b.write_text(new)
    out = subprocess.run(["diff", "-u", "--label", f"a/{rel}" if old is not None else "/dev/null",
                          "--label", f"b/{rel}" if new is not None else "/dev/null", str(a), str(b)],
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    return out.stdout


@pytest.fixture
def fake(tmp_path: Path):
    """A miniature vllm package plus a two-patch series, the second stacked on the first's file."""
    vllm = tmp_path / "site" / "vllm"
    (vllm / "models").mkdir(parents=True)
    (vllm / "__init__.py").write_text("")
    (vllm / "_version.py").write_text(f"__version__ = version = '{VLLM_PIN}'\n")
    (vllm / "models" / "m.py").write_text("".join(f"line {i}\n" for i in range(30)))
    (vllm / "other.py").write_text("x = 1\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    base = (vllm / "models" / "m.py").read_text()
    first = base.replace("line 3\n", "line 3 patched\n")
    (patches / "one.patch").write_text(HEADER.format(d="first") + make_diff(vllm, "models/m.py", first))
    second = first.replace("line 5\n", "line 5 stacked\n")
    (patches / "two.patch").write_text(
        HEADER.format(d="second") + make_diff(vllm, "models/m.py", second, old_override=first)
        + make_diff(vllm, "new_module.py", "created = True\n"))
    (patches / "series").write_text("# comment line\none.patch\n\ntwo.patch  # trailing comment\n")
    return vllm, patches / "series"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen_serving.patchset", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_series_parsing_and_headers(fake):
    vllm, series = fake
    patches = patchset.read_series(series)
    assert [p.name for p in patches] == ["one.patch", "two.patch"]
    assert patches[0].header["Description"] == "first"
    assert patches[1].files == ["models/m.py", "new_module.py"]
    table = run_cli("list", "--series", str(series))
    assert table.returncode == 0
    assert "| 2 | `two.patch` | second | because | a CPU test | not upstream |" in table.stdout


def test_header_fields_are_required(fake, tmp_path):
    vllm, series = fake
    text = (series.parent / "one.patch").read_text().replace("Why: because\n", "")
    (series.parent / "one.patch").write_text(text)
    with pytest.raises(patchset.PatchError, match="lacks Why"):
        patchset.read_series(series)


def test_continuation_lines_join():
    header = patchset.parse_header("Description: a\n  longer text\nWhy: x\n\n--- a/f\n+++ b/f\n")
    assert header == {"Description": "a longer text", "Why": "x"}


def test_apply_verify_revert_cycle(fake):
    vllm, series = fake
    pristine = tree_digest(vllm)
    verify = run_cli("verify", "--vllm-dir", str(vllm), "--series", str(series))
    assert verify.returncode == 1 and "not applied" in verify.stdout

    applied = run_cli("apply", "--vllm-dir", str(vllm), "--series", str(series))
    assert applied.returncode == 0, applied.stderr
    text = (vllm / "models" / "m.py").read_text()
    assert "line 3 patched" in text and "line 5 stacked" in text
    assert (vllm / "new_module.py").read_text() == "created = True\n"
    patched = tree_digest(vllm)

    verify = run_cli("verify", "--vllm-dir", str(vllm), "--series", str(series))
    assert verify.returncode == 0, verify.stdout
    assert "2/2 patches applied" in verify.stdout

    again = run_cli("apply", "--vllm-dir", str(vllm), "--series", str(series))
    assert again.returncode == 0 and "already applied" in again.stdout
    assert tree_digest(vllm) == patched

    reverted = run_cli("revert", "--vllm-dir", str(vllm), "--series", str(series))
    assert reverted.returncode == 0, reverted.stderr
    assert tree_digest(vllm) == pristine
    assert not (vllm / "new_module.py").exists()
    again = run_cli("revert", "--vllm-dir", str(vllm), "--series", str(series))
    assert again.returncode == 0 and "not applied" in again.stdout


def test_partially_applied_tree_is_completed(fake):
    vllm, series = fake
    patches = patchset.read_series(series)
    patchset.apply(vllm, patches[:1])
    states = patchset.evaluate(vllm, patches).states
    assert states == {"one.patch": patchset.State.APPLIED, "two.patch": patchset.State.NOT_APPLIED}
    patchset.apply(vllm, patches)
    assert all(s is patchset.State.APPLIED for s in patchset.evaluate(vllm, patches).states.values())


def test_unappliable_patch_leaves_tree_byte_identical(fake):
    vllm, series = fake
    bad_old = "no such line\n"
    (series.parent / "bad.patch").write_text(
        HEADER.format(d="bad") + make_diff(vllm, "other.py", "x = 2\n", old_override=bad_old))
    series.write_text(series.read_text() + "bad.patch\n")
    before = tree_digest(vllm)
    result = run_cli("apply", "--vllm-dir", str(vllm), "--series", str(series))
    assert result.returncode != 0
    assert "bad.patch" in result.stderr and "Hunk #1 FAILED" in result.stderr
    assert "nothing was changed" in result.stderr
    assert tree_digest(vllm) == before
    verify = run_cli("verify", "--vllm-dir", str(vllm), "--series", str(series))
    assert verify.returncode == 1 and "bad.patch  conflicting" in verify.stdout


def test_wrong_vllm_version_is_refused(fake):
    vllm, series = fake
    (vllm / "_version.py").write_text("__version__ = version = '0.27.1'\n")
    before = tree_digest(vllm)
    result = run_cli("apply", "--vllm-dir", str(vllm), "--series", str(series))
    assert result.returncode == 1
    assert "0.27.1" in result.stderr and f"vllm=={VLLM_PIN}" in result.stderr and "--force" in result.stderr
    assert tree_digest(vllm) == before
    forced = run_cli("apply", "--vllm-dir", str(vllm), "--series", str(series), "--force")
    assert forced.returncode == 0, forced.stderr


def test_version_from_dist_metadata(tmp_path):
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    (tmp_path / f"vllm-{VLLM_PIN}.dist-info").mkdir()
    assert patchset.vllm_version(vllm) == VLLM_PIN


def test_real_series_applies_to_pristine_vllm(pristine_vllm, tmp_path):
    """The shipped series on the files it touches, copied from the pristine pinned package."""
    patches = patchset.read_series(patchset.DEFAULT_SERIES)
    tree = tmp_path / "vllm"
    for rel in ["__init__.py", "_version.py", *patchset.series_files(patches)]:
        if (pristine_vllm / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(pristine_vllm / rel, tree / rel)
    assert patchset.vllm_version(tree) == VLLM_PIN
    before = tree_digest(tree)
    assert all(s is patchset.State.NOT_APPLIED for s in patchset.evaluate(tree, patches).states.values())
    patchset.apply(tree, patches)
    assert all(s is patchset.State.APPLIED for s in patchset.evaluate(tree, patches).states.values())
    patchset.revert(tree, patches)
    assert tree_digest(tree) == before


def test_real_series_with_a_broken_patch_changes_nothing(pristine_vllm, tmp_path):
    series = tmp_path / "series"
    real = patchset.read_series(patchset.DEFAULT_SERIES)
    lines = [str(p.path) for p in real]
    broken = tmp_path / "broken.patch"
    broken.write_text(HEADER.format(d="broken") + "--- a/envs.py\n+++ b/envs.py\n@@ -1,2 +1,2 @@\n"
                      "-this line is not in envs.py\n+replacement\n context that does not exist\n")
    series.write_text("\n".join(lines + [str(broken)]) + "\n")
    patches = patchset.read_series(series)
    tree = tmp_path / "vllm"
    for rel in ["__init__.py", "_version.py", *patchset.series_files(patches)]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine_vllm / rel, tree / rel)
    before = tree_digest(tree)
    with pytest.raises(patchset.PatchError, match="broken.patch"):
        patchset.apply(tree, patches)
    assert tree_digest(tree) == before


def test_patched_copy_is_what_tests_import():
    """tests/run.sh applied the series to a copy; vllm must be imported from there, fully patched."""
    patched = os.environ.get("QS_PATCHED_VLLM")
    if not patched:
        pytest.skip("not run through tests/run.sh")
    import vllm

    assert Path(vllm.__file__).resolve().parent == Path(patched).resolve()
    result = patchset.evaluate(Path(patched), patchset.read_series(patchset.DEFAULT_SERIES))
    assert all(s is patchset.State.APPLIED for s in result.states.values()), result.failures
