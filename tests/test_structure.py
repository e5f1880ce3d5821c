"""The layout's import rules (issue #14), checked by reading the source with ast, never by importing it.

1. The planning modules at the package root (plan, knobs, memory, patchset, model) and engine/env_vars
   (vllm/envs.py imports it while vLLM itself is being imported) are standard library only: no torch,
   numpy or vLLM, directly or through another qwen_serving module they import.
2. qwen_serving/engine/ never imports a root planning module, directly or through another module.
3. Nothing under qwen_serving/ imports bench.
4. Every qwen_serving import a patch adds resolves to a real module, and name, inside qwen_serving.engine;
   the module a patch imports is a hook module named by the rule in engine/__init__.py.
5. Tests: no module under tests/ imports a test module (test_*.py, conftest.py): code they share lives in
   tests/helpers/ (imported as tests.helpers.X) or in conftest fixtures, so tests/ itself holds only test
   modules. tests/gpu/ is the suite the device machine runs on its own: its helper library smoke_lib.py and
   its *_child.py scripts (run as plain scripts there) sit beside its tests and import smoke_lib as a
   sibling; it too never imports a test module.
6. No code under tests/ reaches into a private (_name) attribute of a qwen_serving or bench module.

Each checker takes a tree and returns what it found as messages; each test runs it on this repository
(nothing found) and on a synthetic tree with one deliberate violation (found, with a message that says
what to change).
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "qwen_serving"
ENGINE = f"{PACKAGE}.engine"
PLANNING = tuple(f"{PACKAGE}.{name}" for name in ("plan", "knobs", "memory", "patchset", "model"))
STDLIB_ONLY = (*PLANNING, f"{ENGINE}.env_vars")
PROJECT_PACKAGES = (PACKAGE, "bench")
TEST_FILE = re.compile(r"(test_.*|conftest)\.py")
GPU_SUITE = "tests/gpu"


@dataclass(frozen=True)
class Import:
    module: str  # the absolute module the statement names (`from M import a`: M)
    names: tuple[str, ...]  # `from M import a, b`: (a, b); `import M`: ()
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def index(root: Path, *packages: str) -> dict[str, Path]:
    """dotted module name -> file, for every module of the given packages under root."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(source: str, module: str = "", is_package: bool = False, filename: str = "<source>") -> list[Import]:
    """Every import statement that can run (function bodies too; `if TYPE_CHECKING:` blocks never run)."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, (), node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*anchor, *([base] if base else [])])
            found.append(Import(base, tuple(alias.name for alias in node.names), node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source, filename))
    return found


def loads(imp: Import, modules: dict[str, Path]) -> list[str]:
    """The modules of `modules` an import statement executes: the named one, its parent packages, and the
    submodules a from-import names."""
    parts = imp.module.split(".")
    loaded = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    loaded += [f"{imp.module}.{name}" for name in imp.names]
    return [name for name in loaded if name in modules]


def external(imp: Import, package: str) -> str | None:
    """The top-level name of an import from outside `package`, else None."""
    top = imp.module.split(".")[0]
    return None if top == package else top


def module_imports(modules: dict[str, Path], name: str) -> list[Import]:
    path = modules[name]
    return imports(path.read_text(), name, path.name == "__init__.py", str(path))


def reach(modules: dict[str, Path], start: str) -> Iterator[tuple[list[str], Import]]:
    """Every import statement `start` runs, directly or through package modules it loads: (chain, import)."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        current = todo.pop(0)
        for imp in module_imports(modules, current):
            yield chains[current], imp
            for loaded in loads(imp, modules):
                if loaded not in chains:
                    chains[loaded] = [*chains[current], loaded]
                    todo.append(loaded)


def where(chain: list[str], imp: Import) -> str:
    route = f" through {' -> '.join(chain)}" if len(chain) > 1 else ""
    return f"line {imp.line} of {chain[-1]}{route}"


# -- rules 1-3: the package's own import graph -------------------------------------------------------


def stdlib_violations(root: Path) -> list[str]:
    modules = index(root, PACKAGE)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for start in STDLIB_ONLY:
        if start not in modules:
            if start in PLANNING:
                found.append(f"{start} is missing: the planning modules are {', '.join(PLANNING)}")
            continue
        for chain, imp in reach(modules, start):
            top = external(imp, PACKAGE)
            if top and top not in stdlib:
                found.append(f"{start} imports {imp.module} ({where(chain, imp)}): it must stay standard "
                             "library only (no torch, numpy or vLLM)")
    return found


def engine_violations(root: Path) -> list[str]:
    modules = index(root, PACKAGE)
    found = []
    for start in (name for name in modules if name == ENGINE or name.startswith(ENGINE + ".")):
        for chain, imp in reach(modules, start):
            planning = [name for name in loads(imp, modules) if name in PLANNING]
            if planning:
                found.append(f"{start} imports {planning[0]} ({where(chain, imp)}): engine/ runs inside vLLM "
                             "and never imports the planning modules")
    return found


def bench_violations(root: Path) -> list[str]:
    modules = index(root, PACKAGE)
    return [f"{name} imports {imp.module} (line {imp.line}): nothing under {PACKAGE}/ imports bench"
            for name in modules for imp in module_imports(modules, name) if external(imp, PACKAGE) == "bench"]


# -- rule 4: what the patches import ----------------------------------------------------------------


def added_imports(patch_text: str) -> list[tuple[str, int]]:
    """(import statement, line in the patch) for every qwen_serving import on the patch's + lines."""
    lines = patch_text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        line = lines[i]
        code = line[1:].strip() if line.startswith("+") and not line.startswith("+++") else ""
        if re.match(rf"(from|import)\s+{PACKAGE}\b", code):
            statement, start = code, i + 1
            while statement.count("(") > statement.count(")") and i + 1 < len(lines):
                i += 1
                statement += " " + lines[i][1:].strip()
            found.append((statement, start))
        i += 1
    return found


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def hook_components(root: Path) -> tuple[str, ...]:
    for node in ast.parse((root / PACKAGE / "engine" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "HOOK_COMPONENTS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"{PACKAGE}/engine/__init__.py defines no HOOK_COMPONENTS")


def hook_name_problem(module: str, components: tuple[str, ...]) -> str | None:
    """Why `module` is not a hook module by the naming rule, or None if it is one."""
    parent, _, name = module.rpartition(".")
    if parent != ENGINE:
        return f"patches call hook modules directly under {ENGINE}, not {module}"
    component, _, change = name.partition("_")
    if component not in components or not change:
        return (f"{module} breaks the hook naming rule (<component>_<change>, component one of "
                f"{', '.join(components)}; {ENGINE}'s docstring)")
    return None


def patch_violations(root: Path) -> list[str]:
    modules = index(root, PACKAGE)
    components = hook_components(root)
    found = []
    for patch in sorted((root / "patches").glob("*.patch")):
        for statement, line in added_imports(patch.read_text()):
            at = f"{patch.name}:{line}: {statement}"
            try:
                (imp,) = imports(textwrap.dedent(statement))
            except (SyntaxError, ValueError):
                found.append(f"{at}: not one import statement this check can read")
                continue
            if not (imp.module == ENGINE or imp.module.startswith(ENGINE + ".")):
                found.append(f"{at}: patches import only from {ENGINE}")
                continue
            if imp.module not in modules:
                found.append(f"{at}: there is no module {imp.module}")
                continue
            hooks = {imp.module} if imp.module != ENGINE else set()
            for name in imp.names:
                if f"{imp.module}.{name}" in modules:
                    hooks.add(f"{imp.module}.{name}")
                elif name not in defined_names(modules[imp.module]):
                    found.append(f"{at}: {imp.module} defines no {name}")
            found += [f"{at}: {problem}" for problem in
                      filter(None, (hook_name_problem(hook, components) for hook in sorted(hooks)))]
    return found


# -- rules 5-6: the tests ---------------------------------------------------------------------------


def sources_under_tests(root: Path) -> list[Path]:
    return sorted(p for p in (root / "tests").rglob("*.py") if "fixtures" not in p.relative_to(root).parts)


def resolve_test_import(root: Path, importer: Path, module: str) -> Path | None:
    """The file under tests/ an import loads: tests.X.Y from the repo root, or a bare X beside the
    importer or at tests/ (pytest puts the test file's folder on sys.path)."""
    parts = module.split(".")
    bases = [root] if parts[0] == "tests" else [importer.parent, root / "tests"]
    for base in bases:
        for candidate in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


def layout_violations(root: Path) -> list[str]:
    found = []
    for path in sources_under_tests(root):
        rel = path.relative_to(root)
        folder = rel.parent.as_posix()
        if folder == "tests" and not TEST_FILE.fullmatch(path.name):
            found.append(f"{rel}: tests/ holds test modules and conftest.py only; shared code goes to tests/helpers/")
        for imp in imports(path.read_text(), filename=str(path)):
            for module in [imp.module, *(f"{imp.module}.{name}" for name in imp.names)]:
                target = resolve_test_import(root, path, module)
                if target is None:
                    continue
                target_rel = target.relative_to(root)
                if TEST_FILE.fullmatch(target.name):
                    found.append(f"{rel}:{imp.line} imports the test module {target_rel}: move what it shares to "
                                 "tests/helpers/ or a conftest.py fixture")
                elif not module.startswith("tests.") and folder != GPU_SUITE:
                    found.append(f"{rel}:{imp.line} imports {module} as a sibling; import tests.helpers.* instead")
                break
    return found


def bench_scripts(root: Path) -> dict[str, str]:
    """Bare names of bench/**/X.py (the tests put those folders on sys.path) -> their module name."""
    return {name.rpartition(".")[2]: name for name, path in index(root, "bench").items() if path.name != "__init__.py"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def project_module(module: str, scripts: dict[str, str]) -> str | None:
    """The qwen_serving/bench module an import names (a bare bench script name included), else None."""
    top, dot, rest = module.partition(".")
    if top in PROJECT_PACKAGES:
        return module
    return scripts[top] + dot + rest if top in scripts else None


def project_bindings(tree: ast.AST, scripts: dict[str, str]) -> dict[str, str]:
    """Local name -> the project module or object an import binds it to."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]  # `import a.b` binds a
                full = project_module(alias.name if alias.asname else name, scripts)
                if full:
                    bound[name] = full
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            full = project_module(node.module, scripts)
            if full:
                bound.update({alias.asname or alias.name: f"{full}.{alias.name}" for alias in node.names})
    return bound


def named(node: ast.AST, bound: dict[str, str]) -> str | None:
    """The project module/object an expression names (`patchset`, `qwen_serving.patchset`), else None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = named(node.value, bound)
        return f"{base}.{node.attr}" if base else None
    return None


def private_reaches(rel: Path, source: str, scripts: dict[str, str]) -> list[str]:
    found = []
    for imp in imports(source, filename=str(rel)):
        full = project_module(imp.module, scripts)
        if full and any(is_private(part) for part in imp.module.split(".")):
            found.append(f"{rel}:{imp.line} imports the private module {imp.module}")
        if full:
            found += [f"{rel}:{imp.line} imports the private name {name} from {full}"
                      for name in imp.names if is_private(name)]
    tree = ast.parse(source, str(rel))
    bound = project_bindings(tree, scripts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and named(node.value, bound):
            found.append(f"{rel}:{node.lineno} reaches into {named(node.value, bound)}.{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and named(node.args[0], bound):
            name = node.args[1]  # setattr/getattr/monkeypatch.setattr(module, "_name", ...)
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value):
                found.append(f"{rel}:{node.lineno} reaches into {named(node.args[0], bound)}.{name.value}")
    return found


def private_violations(root: Path) -> list[str]:
    scripts = bench_scripts(root)
    return sorted({found for path in sources_under_tests(root)
                   for found in private_reaches(path.relative_to(root), path.read_text(), scripts)})


# -- this repository ----------------------------------------------------------------------------------

@pytest.mark.parametrize("check", [stdlib_violations, engine_violations, bench_violations, patch_violations,
                                   layout_violations, private_violations], ids=lambda f: f.__name__)
def test_the_repository_keeps_the_rule(check):
    assert list(check(REPO)) == []


def test_the_checks_see_the_real_tree():
    """A check that finds nothing because it looks nowhere would pass every rule."""
    modules = index(REPO, PACKAGE)
    assert set(PLANNING) <= set(modules) and f"{ENGINE}.env_vars" in modules
    engine_modules = [name for name in modules if name.startswith(ENGINE + ".")]
    assert len(engine_modules) >= 8 and any(".kernels." in name for name in engine_modules)
    patched = [added_imports(p.read_text()) for p in sorted((REPO / "patches").glob("*.patch"))]
    assert sum(map(len, patched)) >= 15 and sum(1 for found in patched if found) >= 8
    assert len([p for p in sources_under_tests(REPO) if TEST_FILE.fullmatch(p.name)]) >= 40


# -- each rule catches a synthetic violation --------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


ENGINE_INIT = 'HOOK_COMPONENTS = ("attn", "kv")\n'
BASE = {
    "qwen_serving/__init__.py": "",
    "qwen_serving/plan.py": "from . import knobs, memory\n",
    "qwen_serving/knobs.py": "import re\n",
    "qwen_serving/memory.py": "from __future__ import annotations\nimport math\n",
    "qwen_serving/patchset.py": "from qwen_serving import VLLM_PIN\n",
    "qwen_serving/engine/__init__.py": ENGINE_INIT,
    "qwen_serving/engine/env_vars.py": "import os\n",
    "qwen_serving/engine/attn_routing.py": "import torch\n\ndef route():\n    pass\n",
    "qwen_serving/engine/kernels/__init__.py": "",
    "qwen_serving/engine/kernels/spec_attn.py": "import triton\n\ndef k():\n    pass\n",
    "qwen_serving/checkpoint/__init__.py": "",
    "qwen_serving/checkpoint/steps.py": "import numpy\n",
    "bench/__init__.py": "",
    "bench/report.py": "def _table():\n    pass\n",
    "patches/ok.patch": "Description: x\n--- a/f.py\n+++ b/f.py\n@@ -1 +1,2 @@\n+from qwen_serving.engine.attn_routing import route\n",
    "tests/conftest.py": "import pytest\n",
    "tests/test_a.py": "from tests.helpers.shared import make\n",
    "tests/helpers/__init__.py": "",
    "tests/helpers/shared.py": "def make():\n    pass\n",
    "tests/gpu/smoke_lib.py": "",
    "tests/gpu/test_smoke.py": "import smoke_lib as lib\n",
}


@pytest.fixture
def tree(tmp_path) -> Path:
    return write_tree(tmp_path, BASE)


def test_the_synthetic_tree_is_clean(tree):
    for check in (stdlib_violations, engine_violations, bench_violations, patch_violations, layout_violations,
                  private_violations):
        assert check(tree) == [], check.__name__


def test_a_planning_module_reaching_torch_through_another_module_is_caught(tree):
    write_tree(tree, {"qwen_serving/memory.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import numpy  # never runs: allowed
        def gib():
            from .checkpoint import steps  # runs when called: counted
    """})
    assert stdlib_violations(tree) == [
        f"qwen_serving.{start} imports numpy (line 1 of qwen_serving.checkpoint.steps through {route}): it must "
        "stay standard library only (no torch, numpy or vLLM)" for start, route in (
            ("plan", "qwen_serving.plan -> qwen_serving.memory -> qwen_serving.checkpoint.steps"),
            ("memory", "qwen_serving.memory -> qwen_serving.checkpoint.steps"))]


@pytest.mark.parametrize("module", ["model", "engine/env_vars"])
def test_model_and_env_vars_are_checked_once_present(tree, module):
    write_tree(tree, {f"qwen_serving/{module}.py": "import vllm.envs\n"})
    assert stdlib_violations(tree) == [f"qwen_serving.{module.replace('/', '.')} imports vllm.envs (line 1 of "
                                       f"qwen_serving.{module.replace('/', '.')}): it must stay standard library "
                                       "only (no torch, numpy or vLLM)"]


def test_a_missing_planning_module_is_reported(tree):
    (tree / "qwen_serving" / "knobs.py").unlink()
    assert any("qwen_serving.knobs is missing" in found for found in stdlib_violations(tree))


def test_engine_importing_a_planning_module_is_caught(tree):
    write_tree(tree, {"qwen_serving/engine/kv_groups.py": "from qwen_serving.checkpoint import steps\n",
                      "qwen_serving/checkpoint/steps.py": "from .. import memory\n"})
    found = engine_violations(tree)
    assert found == ["qwen_serving.engine.kv_groups imports qwen_serving.memory (line 1 of "
                     "qwen_serving.checkpoint.steps through qwen_serving.engine.kv_groups -> "
                     "qwen_serving.checkpoint.steps): engine/ runs inside vLLM and never imports the planning "
                     "modules"]


def test_the_package_importing_bench_is_caught(tree):
    write_tree(tree, {"qwen_serving/checkpoint/steps.py": "def f():\n    import bench.report\n"})
    assert bench_violations(tree) == ["qwen_serving.checkpoint.steps imports bench.report (line 2): nothing "
                                      "under qwen_serving/ imports bench"]


@pytest.mark.parametrize(("added", "message"), [
    ("+from qwen_serving.checkpoint import steps", "patches import only from qwen_serving.engine"),
    ("+import qwen_serving.plan", "patches import only from qwen_serving.engine"),
    ("+    from qwen_serving.engine.attn_routing import route, missing", "qwen_serving.engine.attn_routing "
     "defines no missing"),
    ("+        from qwen_serving.engine import (\n+            nowhere,\n+        )", "qwen_serving.engine defines no "
     "nowhere"),
    ("+from qwen_serving.engine.sampler_routing import x", "there is no module qwen_serving.engine.sampler_routing"),
    ("+from qwen_serving.engine.kernels.spec_attn import k", "patches call hook modules directly under "
     "qwen_serving.engine, not qwen_serving.engine.kernels.spec_attn"),
    ("+from qwen_serving.engine import env_vars", "qwen_serving.engine.env_vars breaks the hook naming rule"),
])
def test_a_bad_patch_import_is_caught(tree, added, message):
    write_tree(tree, {"patches/bad.patch": f"Why: x\n--- a/f.py\n+++ b/f.py\n@@ -1 +1,3 @@\n{added}\n"})
    (found,) = patch_violations(tree)
    assert found.startswith("bad.patch:5: ") and message in found, found


def test_a_removed_line_or_a_comment_is_not_an_import(tree):
    write_tree(tree, {"patches/old.patch": "--- a/f.py\n+++ b/f.py\n@@ -1 +1 @@\n-from qwen_serving.plan import x\n"
                                           "+# see qwen_serving.plan\n"})
    assert patch_violations(tree) == []


@pytest.mark.parametrize(("files", "message"), [
    ({"tests/test_b.py": "from test_a import x\n"}, "tests/test_b.py:1 imports the test module tests/test_a.py"),
    ({"tests/test_b.py": "def f():\n    from tests.test_a import x\n"}, "tests/test_b.py:2 imports the test module"),
    ({"tests/test_b.py": "from tests import conftest\n"}, "imports the test module tests/conftest.py"),
    ({"tests/gpu/smoke_lib.py": "import test_smoke\n"}, "tests/gpu/smoke_lib.py:1 imports the test module "
     "tests/gpu/test_smoke.py"),
    ({"tests/trees.py": ""}, "tests/trees.py: tests/ holds test modules and conftest.py only"),
    ({"tests/test_b.py": "from helpers.shared import make\n"}, "imports helpers.shared as a sibling"),
])
def test_a_test_importing_a_test_module_is_caught(tree, files, message):
    write_tree(tree, files)
    assert any(message in found for found in layout_violations(tree)), layout_violations(tree)


@pytest.mark.parametrize(("source", "message"), [
    ("from qwen_serving.engine import attn_routing\nattn_routing._shared.clear()\n",
     "tests/test_b.py:2 reaches into qwen_serving.engine.attn_routing._shared"),
    ("import qwen_serving.patchset\nqwen_serving.patchset._all_files([])\n",
     "tests/test_b.py:2 reaches into qwen_serving.patchset._all_files"),
    ("from qwen_serving.knobs import _holds\n", "tests/test_b.py:1 imports the private name _holds from "
     "qwen_serving.knobs"),
    ("from bench import report as br\nbr._table()\n", "tests/test_b.py:2 reaches into bench.report._table"),
    ("import report\nreport._table()\n", "tests/test_b.py:2 reaches into bench.report._table"),
    ("def t(monkeypatch):\n    from qwen_serving.checkpoint import steps\n"
     "    monkeypatch.setattr(steps, '_exchange', None)\n", "tests/test_b.py:3 reaches into "
     "qwen_serving.checkpoint.steps._exchange"),
])
def test_a_reach_into_a_private_name_is_caught(tree, source, message):
    write_tree(tree, {"tests/test_b.py": source})
    assert private_violations(tree) == [message]


def test_private_names_of_other_libraries_are_not_ours(tree):
    write_tree(tree, {"tests/test_b.py": "import torch\nfrom qwen_serving import plan\n"
                                         "torch.ops._C\nplan.__file__\nx = object()\nx._private\n"})
    assert private_violations(tree) == []
