"""qwen_serving/engine/env_vars.py and patches/env-vars.patch: the VLLM_* variables our patches read,
declared once and registered in vLLM's own table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from qwen_serving.engine import env_vars, kv_groups, marlin_int8, mtp_draft_vocab
from qwen_serving.engine.env_vars import BY_NAME, DECLARED

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "qwen_serving" / "engine"
# A value other than the default for each declared variable (a new declaration needs one here).
SET_VALUES = {"VLLM_SMALL_TOPK_SAMPLER": "0", "VLLM_SPEC_DECODE_ATTN": "1", "VLLM_PREFILL_INT8_ATTN": "1",
              "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp|self_attn", "VLLM_MTP_DRAFT_VOCAB": "0",
              "VLLM_V2_CUDAGRAPH_MEM_MIB": "1200", "VLLM_DFLASH2_LOOKUP": "1", "VLLM_DFLASH2_LOOKUP_NMIN": "4",
              "VLLM_DFLASH2_LOOKUP_NMAX": "16", "VLLM_DFLASH2_LOOKUP_NSTRONG": "10", "VLLM_DFLASH2_LOOKUP_AGREE": "3",
              "VLLM_DFLASH2_LOOKUP_STICKY": "0", "VLLM_VISION_OFFLOAD": "1", "VLLM_VISION_OFFLOAD_GIB": "0.5"}
ENVS_READ = re.compile(r"\benvs\.(VLLM_[A-Z0-9_]+)")
DIRECT_READ = re.compile(r"""(?:os\.getenv\(|os\.environ\.get\(|os\.environ\[)\s*["'](VLLM_[A-Z0-9_]+)""")


def envs_table(envs_py: Path) -> set[str]:
    """The keys of the environment_variables dict literal in an envs.py."""
    for node in ast.parse(envs_py.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "environment_variables":
            return {key.value for key in node.value.keys}
    raise AssertionError(f"no environment_variables table in {envs_py}")


def type_checking_block(envs_py: Path) -> dict[str, tuple[str, str]]:
    """name -> (annotation, default as written) of the annotations under `if TYPE_CHECKING:`."""
    for node in ast.parse(envs_py.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            return {stmt.target.id: (ast.unparse(stmt.annotation), ast.unparse(stmt.value))
                    for stmt in node.body if isinstance(stmt, ast.AnnAssign) and stmt.value is not None}
    raise AssertionError(f"no TYPE_CHECKING block in {envs_py}")


def added_lines() -> str:
    return "\n".join(line[1:] for patch in sorted((REPO / "patches").glob("*.patch"))
                     for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++"))


def engine_source() -> str:
    return "\n".join(p.read_text() for p in sorted(ENGINE.rglob("*.py")) if p.name != "env_vars.py")


def test_vllm_envs_reads_each_variable_and_keys_the_compile_cache(monkeypatch):
    import vllm.envs as envs

    assert set(SET_VALUES) == set(BY_NAME)
    for var in DECLARED:
        monkeypatch.delenv(var.name, raising=False)
        assert envs.environment_variables[var.name] == var.read
        assert getattr(envs, var.name) == var.parse(var.default)
        before = envs.compile_factors()[var.name]
        monkeypatch.setenv(var.name, SET_VALUES[var.name])
        assert var.read() == var.parse(SET_VALUES[var.name]) != var.parse(var.default)
        assert envs.compile_factors()[var.name] != before, var.name


@pytest.mark.parametrize(("name", "value"), [("VLLM_MTP_DRAFT_VOCAB", "2"), ("VLLM_SPEC_DECODE_ATTN", "yes")])
def test_a_bad_value_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' is not valid"):
        BY_NAME[name].read()


def test_register_refuses_a_name_vllm_already_defines():
    table = {"VLLM_SPEC_DECODE_ATTN": lambda: "vLLM's own"}
    with pytest.raises(RuntimeError, match="vLLM already defines VLLM_SPEC_DECODE_ATTN"):
        env_vars.register(table)
    assert list(table) == ["VLLM_SPEC_DECODE_ATTN"]  # nothing added
    fresh: dict = {}
    env_vars.register(fresh)
    assert list(fresh) == [var.name for var in DECLARED]


def test_no_declared_name_is_one_of_pristine_vllms(pristine_vllm):
    assert not set(BY_NAME) & envs_table(pristine_vllm / "envs.py")


def test_the_type_checking_block_matches_the_declarations():
    import vllm.envs as envs

    block = type_checking_block(Path(envs.__file__))
    for var in DECLARED:
        annotation, default = block[var.name]
        declared = ast.unparse(ast.parse(var.annotation, mode="eval"))  # quotes as ast writes them
        assert (annotation, ast.literal_eval(default)) == (declared, var.parse(var.default)), var.name


def test_each_declared_variable_is_read_and_each_read_is_registered(pristine_vllm):
    """A declared variable no patch or hook reads would be a switch that does nothing; a patch reading an
    unregistered one fails at `envs.NAME`; one read from os.environ directly never keys the compile cache."""
    code = added_lines() + "\n" + engine_source()
    reads = set(ENVS_READ.findall(code))
    assert set(BY_NAME) <= reads, f"declared but never read: {sorted(set(BY_NAME) - reads)}"
    assert reads <= set(BY_NAME) | envs_table(pristine_vllm / "envs.py")
    assert not DIRECT_READ.findall(code), "read VLLM_* variables through vllm.envs"


def test_the_engine_modules_name_declared_variables():
    assert {kv_groups.CUDAGRAPH_ENV, marlin_int8.INCLUDE_ENV, mtp_draft_vocab.ENV} <= set(BY_NAME)
    assert BY_NAME[marlin_int8.INCLUDE_ENV].default == marlin_int8.DEFAULT_INCLUDE_RE


def test_only_the_first_patch_edits_vllm_envs():
    series = [line.split("#")[0].strip() for line in (REPO / "patches" / "series").read_text().splitlines()]
    series = [name for name in series if name]
    assert series[0] == "env-vars.patch"
    touching = [name for name in series if "+++ b/envs.py" in (REPO / "patches" / name).read_text()]
    assert touching == ["env-vars.patch"]
